"""How ``fastper.load`` reads a checkpoint: one pass, little memory, digests still checked.

And the frozen format-1 files of ``tests/fixtures/checkpoints`` (written by
fastper 0.1.0 with ``make_v1.py`` there) load to the state that script
recorded in ``v1_expected.json``; ``read_metadata`` reads both versions.
"""

from __future__ import annotations

import builtins
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastper
from fastper import checkpoint as ckpt
from fastper.errors import CheckpointError
from tests.conftest import CARTPOLE_FIELDS
from tests.oracles import naive_nstep_streams

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "checkpoints"
PREFIX = struct.Struct("<8sIQ")
DIGEST = 32
SLACK = 64 * 1024  # what one read pass may read past the file's size
KINDS = {
    "uniform": fastper.ReplayBuffer,
    "proportional": fastper.PrioritizedReplayBuffer,
    "rank": fastper.RankBasedReplayBuffer,
}


def _rows(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.standard_normal((k, 4), dtype=np.float32),
        "action": rng.integers(0, 2, k),
        "reward": rng.standard_normal(k, dtype=np.float32),
        "next_obs": rng.standard_normal((k, 4), dtype=np.float32),
        "done": (rng.random(k) < 0.05).astype(np.float32),
    }


def _filled(kind: str, capacity: int, seed: int = 0) -> Any:
    """A full buffer whose ring has wrapped, with some priorities updated."""
    buf = KINDS[kind](capacity, CARTPOLE_FIELDS, seed=seed)
    rng = np.random.default_rng(seed)
    buf.add(_rows(rng, capacity))
    buf.add(_rows(rng, capacity // 3))
    s = buf.sample(64)
    buf.update_priorities(s.indices, rng.normal(size=64), keys=s.keys)
    return buf


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        _, _, hlen = PREFIX.unpack(f.read(PREFIX.size))
    return PREFIX.size + hlen + DIGEST


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise KeyError("rchar")


# ---------------------------------------------------------------------------
# (a) one read pass
# ---------------------------------------------------------------------------


class _CountingFile:
    """A file object that counts the bytes read through it."""

    def __init__(self, f: Any, counter: dict[str, int]) -> None:
        self._f = f
        self._counter = counter

    def read(self, *args: Any) -> bytes:
        out = self._f.read(*args)
        self._counter["bytes"] += len(out)
        return out

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        self._counter["bytes"] += n or 0
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_load_reads_the_file_once(kind, tmp_path, monkeypatch):
    path = tmp_path / "b.fpk"
    _filled(kind, 2**14).save(path)
    size = path.stat().st_size
    assert size > 8 * SLACK  # a second pass could not hide in the slack
    fastper.load(path)  # warm: lazy imports and kernels are not counted below

    counter = {"bytes": 0, "opens": 0}
    real_open = builtins.open

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, *args, **kwargs)
        if isinstance(file, str | os.PathLike) and Path(file) == path:
            counter["opens"] += 1
            return _CountingFile(f, counter)
        return f

    linux = os.path.exists("/proc/self/io")
    monkeypatch.setattr(builtins, "open", counting_open)
    r0 = _rchar() if linux else 0
    buf = fastper.load(path)
    r1 = _rchar() if linux else 0
    monkeypatch.undo()
    assert len(buf) == 2**14
    # every byte goes through the digest, and none twice
    assert size <= counter["bytes"] <= size + SLACK, (counter, size)
    if linux:  # any read call of the process, however the file was opened
        assert r1 - r0 <= size + SLACK, (r1 - r0, size)


# ---------------------------------------------------------------------------
# (b) peak memory
# ---------------------------------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import fastper

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    fastper.load(sys.argv[2]).sample(4)  # warm: kernels and lazy imports
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) restarts from the current RSS
        how = "VmHWM"
    except OSError:
        how = "ru_maxrss"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss0 = status("VmRSS")
    buf = fastper.load(sys.argv[1])
    if how == "VmHWM":
        peak = status("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if peak <= before:
            peak = None  # the load stayed below an earlier peak: not measurable
    print(json.dumps({"how": how, "rss0": rss0, "peak": peak, "rss1": status("VmRSS"),
                      "buffer": sum(buf.nbytes().values())}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_load_peak_memory_is_about_the_loaded_buffer(tmp_path):
    path, warm = tmp_path / "big.fpk", tmp_path / "warm.fpk"
    _filled("proportional", 2**18).save(path)
    _filled("proportional", 256).save(warm)
    size = path.stat().st_size
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), str(warm)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["peak"] is None:
        pytest.skip("peak RSS not measurable here (no clear_refs, earlier peak higher)")
    peak = (r["peak"] - r["rss0"]) / size
    print(
        f"file {size / 2**20:.1f} MiB; peak RSS increase {peak:.3f}x the file ({r['how']}), "
        f"kept {(r['rss1'] - r['rss0']) / size:.3f}x; loaded buffer's nbytes "
        f"{r['buffer'] / size:.3f}x"
    )
    # The loaded buffer itself is ~1.19x the file (its trees are larger than
    # the 8 bytes of priority a slot takes in the file); read_state adds one
    # chunk of scratch (documented: "plus one chunk", 4 MiB, 0.29x of this
    # file). Reading the file into a blob, or into arrays then copied into
    # the buffer, would add 1x more.
    assert r["peak"] - r["rss0"] <= 1.35 * size + ckpt._CHUNK


# ---------------------------------------------------------------------------
# (c) integrity checks are kept
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    ["first data byte", "storage rows", "priorities", "last data byte", "digest first",
     "digest last"],
)  # fmt: skip
def test_a_corrupted_byte_in_data_or_digest_is_an_error(where, tmp_path):
    path = tmp_path / "b.fpk"
    _filled("proportional", 64).save(path)
    meta = fastper.read_metadata(path)
    start = _data_start(path)
    size = path.stat().st_size
    table = {a["name"]: a for a in meta["arrays"]}
    pos = {
        "first data byte": start,
        "storage rows": start + table["storage/columns/obs"]["offset"] + 37,
        "priorities": start + table["sampler/priorities"]["offset"] + 11,
        "last data byte": size - DIGEST - 1,
        "digest first": size - DIGEST,
        "digest last": size - 1,
    }[where]
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x10
    path.write_bytes(bytes(raw))
    result = None
    with pytest.raises(CheckpointError, match="checksum"):
        result = fastper.load(path)
    assert result is None


# ---------------------------------------------------------------------------
# (d), (e) format-1 files
# ---------------------------------------------------------------------------


def _v1_data(k: int, off: int) -> dict[str, np.ndarray]:
    """``data()`` of make_v1.py."""
    r = np.arange(off, off + k)
    return {
        "obs": np.stack([r, r + 0.5, -r], 1).astype(np.float32),
        "action": r % 3,
        "reward": (r % 5).astype(np.float32),
        "next_obs": np.stack([r + 1, r + 1.5, -r - 1], 1).astype(np.float32),
        "terminated": (r % 7 == 6),
        "truncated": (r % 11 == 10),
    }


def _v1_slots(kind: str, capacity: int = 16) -> dict[str, list[Any]]:
    """What each slot of a format-1 fixture holds: the last transition the ring put there.

    make_v1.py added rows 0..21 (12, 8, then 2); the n-step buffer stored their
    3-step transitions (gamma 0.9; terminated / truncated end episodes), given
    here by the definition (tests.oracles.naive_nstep_streams).
    """
    data = _v1_data(22, 0)
    rows = [{f: v[i] for f, v in data.items()} for i in range(22)]
    if kind == "nstep":
        done, pending, _ = naive_nstep_streams([(0, row) for row in rows], 3, 0.9)
        assert pending == {0: 0}
        rows = [t for batch in done for t in batch]
    slots: dict[int, dict[str, Any]] = {}
    for j, row in enumerate(rows):
        slots[j % capacity] = row
    return {f: [slots[s][f] for s in range(capacity)] for f in slots[0] if f != "_m"}


_V1_BROKEN: dict[str, Any] = {}  # every format-1 fixture loads


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=_V1_BROKEN.get(k, ())) for k in ("uniform", "proportional",
             "rank", "nstep")],
)  # fmt: skip
def test_format_1_fixtures_load(kind):
    expect = json.loads((FIXTURES / "v1_expected.json").read_text())[kind]
    buf = fastper.load(FIXTURES / f"v1_{kind}.fpk")
    assert len(buf) == expect["len"] == 16
    assert buf.total_added == expect["total_added"]
    assert buf.n_pending == expect["n_pending"]
    # make_v1.py recorded step after drawing its next sample
    assert buf.step == expect["step"] - 1
    got = buf.priorities(np.arange(len(buf)))
    assert got.tolist() == expect["priorities"]  # exact
    want = _v1_slots(kind)
    cols = buf.state_dict()["storage"]
    assert sorted(cols) == sorted(f"columns/{f}" for f in want)
    for field, values in want.items():
        col = cols[f"columns/{field}"]
        np.testing.assert_array_equal(col, np.asarray(values).astype(col.dtype), err_msg=field)
    if kind in ("uniform", "proportional"):
        s = buf.sample(6)
        # A format-1 buffer comes back with shuffle=False (0.1.0 returned batches
        # in slot order) and the saved random state, so the next batch is the
        # one 0.1.0 drew: same indices in the same order, and the same weights.
        assert sorted(s.indices.tolist()) == sorted(expect["next_sample_indices"])
        assert s.indices.tolist() == expect["next_sample_indices"]
        assert s.weights.tolist() == expect["next_sample_weights"]
        assert buf.step == expect["step"]


def test_read_metadata_of_both_versions(tmp_path):
    v1 = fastper.read_metadata(FIXTURES / "v1_proportional.fpk")
    assert v1["format_version"] == 1
    assert v1["fastper_version"] == "0.1.0"
    path = tmp_path / "v2.fpk"
    buf = _filled("rank", 128)
    buf.save(path)
    v2 = fastper.read_metadata(path, verify=True)
    assert v2["format_version"] == 2
    assert v2["fastper_version"] == fastper.__version__
    for meta, kind, size, added in ((v1, "proportional", 16, 22), (v2, "rank", 128, 128 + 42)):
        state = meta["state"]
        assert state["kind"] == kind
        assert {"writer", "buffer", "settings", "schedules", "sampler", "storage"} <= set(state)
        assert state["writer"]["size"] == size
        assert state["writer"]["total_added"] == added
        assert isinstance(state["buffer"]["step"], int)
        assert "rng" in state["buffer"]
        # no arrays: the header only
        assert all(not isinstance(v, np.ndarray) for v in state["storage"].values())
    assert v2["state"]["writer"] == buf.state_dict()["writer"]
    assert v2["state"]["buffer"]["step"] == buf.step
