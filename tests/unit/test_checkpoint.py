"""Checkpoints: round trips, exact continuation, corruption, crafted files, atomic saves.

Crafted files are built by ``_build`` / ``_frame`` following the layout in
``fastper/checkpoint.py``'s docstring (prefix, JSON header, header SHA-256,
data, whole-file SHA-256), with both digests recomputed, so each crafted
defect reaches the checks behind the digests. Format 2 headers hold the
buffer's ``state_dict()`` without its arrays under ``"state"``, the arrays
named ``part/key`` (``storage/columns/obs``, ``sampler/priorities``,
``nstep/...``). Format 1 (fastper 0.1.0) headers are crafted from the frozen
fixtures in ``tests/fixtures/checkpoints`` (the same container, the old
header: see ``checkpoint.upgrade_v1``); loading the fixtures themselves is
tested in ``test_checkpoint_io.py``.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastper
from fastper import schedules
from tests.conftest import CARTPOLE_FIELDS, make_batch
from tests.oracles import assert_same_state, refusal_cost, snapshot

MAGIC = b"\x89FPCKPT\n"
PREFIX = struct.Struct("<8sIQ")
DIGEST = 32
VERSION = 2
REPO = Path(__file__).resolve().parents[2]
V1_FIXTURES = REPO / "tests" / "fixtures" / "checkpoints"
#: CARTPOLE_FIELDS have no truncation field: n-step buffers must be told so
NO_TRUNCATION = {"truncated": None}


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _transitions(k: int, start: int) -> dict[str, np.ndarray]:
    """make_batch, with an episode ending every 7 steps (exercises n-step windows)."""
    batch = make_batch(k, start)
    batch["done"] = ((np.arange(start, start + k) % 7) == 6).astype(np.float32)
    return batch


def _add(buf, batch: dict[str, np.ndarray]) -> np.ndarray:
    """``buf.add(batch)``; an n-step buffer's batch is one stream's consecutive steps."""
    if buf._nstep is None:
        return buf.add(batch)
    k = len(next(iter(batch.values())))
    return buf.add(batch, env_ids=np.zeros(k, dtype=np.int64))


def _state(buf) -> dict[str, Any]:
    """oracles.snapshot: the state_dict, every storage row and the sampler's structures."""
    return snapshot(buf)


def _settings(buf) -> dict[str, Any]:
    """What a buffer was built with, and the schedule objects themselves."""
    state = buf.state_dict()
    out = {
        "type": type(buf),
        "fields": buf.fields,
        "settings": state["settings"],
        "scheme": (buf.scheme, state["buffer"]["scheme_options"]),
        "n_step": None if buf._nstep is None else buf._nstep.settings(),
    }
    for name in ("_alpha_schedule", "_beta_schedule", "_noise_schedule"):
        sched = getattr(buf, name)
        out[name] = sched if isinstance(sched, schedules.Schedule) else "callable"
    return out


def _assert_same_batch(a, b) -> None:
    for name in ("indices", "weights", "probabilities", "keys"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name
    assert a.data.keys() == b.data.keys()
    for name in a.data:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


def _lockstep(a, b, rounds: int = 8, batch: int = 6, seed: int = 0) -> None:
    """Sample, update and add identically on both buffers; every batch must match bitwise."""
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        assert (a.step, a.alpha, a.beta) == (b.step, b.alpha, b.beta)
        sa, sb = a.sample(batch), b.sample(batch)
        _assert_same_batch(sa, sb)
        td = rng.normal(scale=3.0, size=batch)
        applied = a.update_priorities(sa.indices, td, keys=sa.keys)
        assert applied == b.update_priorities(sb.indices, td, keys=sb.keys)
        tr = _transitions(3, 1000 + 3 * r)
        np.testing.assert_array_equal(_add(a, tr), _add(b, tr))
    assert_same_state(_state(a), _state(b))


def _history(buf, seed: int = 1) -> None:
    """Wrap the ring, update priorities, make some updates stale."""
    rng = np.random.default_rng(seed)
    written = 0
    for k in (5, 9, 7, 6):
        _add(buf, _transitions(k, written))
        written += k
        s = buf.sample(4)
        buf.update_priorities(s.indices, rng.normal(scale=2.0, size=4), keys=s.keys)
    stale = buf.sample(5)
    _add(buf, _transitions(buf.capacity, written))  # overwrites everything sampled above
    written += buf.capacity
    buf.update_priorities(stale.indices, np.ones(5), keys=stale.keys)
    s = buf.sample(3)
    buf.update_priorities(s.indices, [0.3, 4.0, 1.7], keys=s.keys)  # re-rankings wait (sort_every)
    _add(buf, _transitions(2, written))  # leave an n-step window pending


def _switching() -> fastper.PrioritizedReplayBuffer:
    """Switched to rank now, with a switch back to proportional pending (step 8)."""
    buf = fastper.PrioritizedReplayBuffer(12, CARTPOLE_FIELDS, alpha=0.7, seed=3)
    buf.switch_scheme("rank", sort_every=2)
    buf.switch_scheme("proportional", at_step=8, alpha=schedules.linear(0.5, 0.9, 6))
    return buf


BUFFERS = {
    "uniform": lambda: fastper.ReplayBuffer(
        12, CARTPOLE_FIELDS, stratified=False, eps=1e-3, clip=5.0, seed=3
    ),
    "proportional": lambda: fastper.PrioritizedReplayBuffer(
        12, CARTPOLE_FIELDS, alpha=0.7, beta=0.5, eps=1e-3, clip=5.0, seed=3
    ),
    "proportional-batch-norm-unseeded": lambda: fastper.PrioritizedReplayBuffer(
        13, CARTPOLE_FIELDS, weight_norm="batch", stratified=False
    ),
    "proportional-current-max-in-order": lambda: fastper.PrioritizedReplayBuffer(
        12, CARTPOLE_FIELDS, max_priority="current", shuffle=False, alpha_every=3, seed=3
    ),
    "proportional-constant-max-priority": lambda: fastper.PrioritizedReplayBuffer(
        12, CARTPOLE_FIELDS, max_priority=4.9, clip=5.0, seed=3
    ),
    "proportional-switching-scheme": _switching,
    "rank": lambda: fastper.RankBasedReplayBuffer(12, CARTPOLE_FIELDS, alpha=0.8, seed=3),
    "rank-sort-every": lambda: fastper.RankBasedReplayBuffer(
        12, CARTPOLE_FIELDS, sort_every=4, weight_norm="none", seed=3
    ),
    "rank-segments": lambda: fastper.RankBasedReplayBuffer(
        12, CARTPOLE_FIELDS, segments=True, seed=3
    ),
    "uniform-nstep": lambda: fastper.ReplayBuffer(
        12, CARTPOLE_FIELDS, n_step=3, nstep_keys=NO_TRUNCATION, seed=3
    ),
    "proportional-nstep": lambda: fastper.PrioritizedReplayBuffer(
        12, CARTPOLE_FIELDS, n_step=3, gamma=0.9, nstep_keys=NO_TRUNCATION, seed=3
    ),
    "rank-nstep-sort-every": lambda: fastper.RankBasedReplayBuffer(
        12, CARTPOLE_FIELDS, n_step=4, gamma=0.8, sort_every=3, nstep_keys=NO_TRUNCATION, seed=3
    ),
}


def _split(raw: bytes, version: int = VERSION) -> tuple[dict[str, Any], bytes, int]:
    """(header JSON, data section, offset where data starts) of a checkpoint's bytes."""
    magic, got, hlen = PREFIX.unpack(raw[: PREFIX.size])
    assert (magic, got) == (MAGIC, version)
    header = raw[PREFIX.size : PREFIX.size + hlen]
    start = PREFIX.size + hlen + DIGEST
    assert hashlib.sha256(raw[: PREFIX.size + hlen]).digest() == raw[PREFIX.size + hlen : start]
    assert hashlib.sha256(raw[:-DIGEST]).digest() == raw[-DIGEST:]
    return json.loads(header), raw[start:-DIGEST], start


def _frame(header: bytes, data: bytes, version: int = VERSION, magic: bytes = MAGIC) -> bytes:
    head = PREFIX.pack(magic, version, len(header)) + header
    body = head + hashlib.sha256(head).digest() + data
    return body + hashlib.sha256(body).digest()


def _build(meta: dict[str, Any], arrays: dict[str, np.ndarray], version: int = VERSION) -> bytes:
    """A checkpoint with valid digests and a consistent array table."""
    table, blobs, offset = [], [], 0
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        table.append(
            {
                "name": name,
                "dtype": a.dtype.str,
                "shape": list(a.shape),
                "offset": offset,
                "nbytes": a.nbytes,
            }
        )
        offset += a.nbytes
        blobs.append(a.tobytes())
    header = json.dumps({**meta, "arrays": table}).encode()
    return _frame(header, b"".join(blobs), version)


def _parts(path: Path, version: int = VERSION) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Independent parse of a checkpoint: (header without table, arrays)."""
    meta, data, _ = _split(path.read_bytes(), version)
    arrays = {}
    for e in meta.pop("arrays"):
        arrays[e["name"]] = np.frombuffer(
            data[e["offset"] : e["offset"] + e["nbytes"]], dtype=e["dtype"]
        ).reshape(e["shape"])
    return meta, arrays


def _rewrite(path: Path, raw: bytes) -> None:
    """``path.write_bytes(raw)``, minus ext4's flush on truncating a written file.

    Truncating a file that holds data (``O_TRUNC``) makes ext4 flush the new
    data on close (``auto_da_alloc``): 3-4 ms a write on the test machine, most
    of the time of the tests that write thousands of corrupted variants of one
    checkpoint. Unlinking the old file first avoids it; the file read back holds
    exactly ``raw`` either way.
    """
    path.unlink(missing_ok=True)
    path.write_bytes(raw)


@pytest.fixture
def small_ckpt(tmp_path) -> Path:
    buf = fastper.PrioritizedReplayBuffer(6, CARTPOLE_FIELDS, seed=0)
    buf.add(make_batch(5))
    s = buf.sample(3)
    buf.update_priorities(s.indices, [0.5, 2.0, 3.0], keys=s.keys)
    path = tmp_path / "small.fpk"
    buf.save(path)
    return path


# ---------------------------------------------------------------------------
# round trips and exact continuation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BUFFERS))
def test_round_trip_state_and_continuation(name, tmp_path):
    original = BUFFERS[name]()
    _history(original)
    if original._nstep is not None:
        assert original.n_pending > 0
    if name == "rank-sort-every":
        assert original._sampler.pending.any()  # changes not yet merged into the order
    if name == "proportional-switching-scheme":
        assert original.scheme == "rank" and original._pending_switch is not None
    before = _state(original)
    path = tmp_path / "buf.fpk"
    original.save(path)
    assert_same_state(before, _state(original))  # saving changes nothing
    loaded = fastper.load(path)
    assert_same_state(_state(original), _state(loaded))
    assert _settings(loaded) == _settings(original)
    assert (len(loaded), loaded.total_added, loaded.stale_updates, loaded.n_pending) == (
        len(original),
        original.total_added,
        original.stale_updates,
        original.n_pending,
    )
    assert (loaded.max_priority, loaded.max_priority_ever) == (
        original.max_priority,
        original.max_priority_ever,
    )
    assert original.stale_updates > 0
    _lockstep(original, loaded, rounds=10)
    if name == "proportional-switching-scheme":
        assert loaded.scheme == "proportional" and loaded._pending_switch is None
    # and a buffer loaded from a checkpoint saves an identical checkpoint
    loaded.save(tmp_path / "again.fpk")
    original.save(tmp_path / "orig2.fpk")
    assert (tmp_path / "again.fpk").read_bytes() == (tmp_path / "orig2.fpk").read_bytes()


@pytest.mark.parametrize("name", ["uniform", "proportional", "rank"])
def test_empty_buffer_round_trip(name, tmp_path):
    original = BUFFERS[name]()
    original.save(tmp_path / "empty.fpk")
    loaded = fastper.load(tmp_path / "empty.fpk")
    assert len(loaded) == 0
    assert_same_state(_state(original), _state(loaded))
    with pytest.raises(fastper.EmptyBufferError):
        loaded.sample(2)
    original.add(make_batch(4))
    loaded.add(make_batch(4))
    _lockstep(original, loaded, rounds=3)


def test_segment_rank_continuation_with_exact_fallback(tmp_path):
    """segments=True falls back to exact draws while len < batch_size; both paths continue."""
    original = fastper.RankBasedReplayBuffer(40, CARTPOLE_FIELDS, segments=True, seed=5)
    original.add(make_batch(5))
    original.save(tmp_path / "s.fpk")
    loaded = fastper.load(tmp_path / "s.fpk")
    _lockstep(original, loaded, rounds=3, batch=8)  # len 5..11 < 8 at first
    _lockstep(original, loaded, rounds=4, batch=4)


SCHEDULES = {
    "linear": (schedules.linear(0.3, 1.0, 12), schedules.linear(0.4, 1.0, 9)),
    "cosine": (schedules.cosine(1.0, 0.2, 10), schedules.cosine(0.4, 1.0, 11)),
    "piecewise": (
        schedules.piecewise([(0, 0.5), (6, 1.0), (14, 0.3)]),
        schedules.piecewise([(2, 0.2), (9, 1.0)]),
    ),
    "step": (schedules.step([4, 9], [0.9, 0.4, 0.7]), schedules.step([7], [0.3, 1.0])),
}


@pytest.mark.parametrize("kind", ["uniform", "proportional", "rank"])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_schedules_round_trip(sched, kind, tmp_path):
    alpha, beta = SCHEDULES[sched]
    cls = {
        "uniform": fastper.ReplayBuffer,
        "proportional": fastper.PrioritizedReplayBuffer,
        "rank": fastper.RankBasedReplayBuffer,
    }[kind]
    # uniform replay refuses alpha: its state keeps the constant 1
    kw = {} if kind == "uniform" else {"alpha": alpha}
    original = cls(16, CARTPOLE_FIELDS, beta=beta, seed=11, **kw)
    original.add(make_batch(10))
    for _ in range(5):
        s = original.sample(4)
        original.update_priorities(s.indices, np.arange(1.0, 5.0), keys=s.keys)
    path = tmp_path / f"{sched}.fpk"
    original.save(path)
    meta = fastper.read_metadata(path)
    assert meta["state"]["schedules"]["alpha"]["kind"] == ("constant" if kind == "uniform" else sched)
    assert meta["state"]["schedules"]["beta"]["kind"] == sched
    loaded = fastper.load(path)
    assert loaded._alpha_schedule == original._alpha_schedule
    assert loaded._beta_schedule == beta
    assert loaded.step == original.step == 5
    assert (loaded.alpha, loaded.beta) == (original.alpha, original.beta)
    _lockstep(original, loaded, rounds=14, batch=4)  # runs past every breakpoint
    assert loaded.beta == beta(loaded.step)


def test_schedule_replaced_after_construction_and_step_set(tmp_path):
    original = fastper.PrioritizedReplayBuffer(16, CARTPOLE_FIELDS, seed=2)
    original.add(make_batch(12))
    original.set_alpha(schedules.step([3], [0.2, 0.9]))
    original.set_beta(schedules.linear(0.1, 0.7, 5))
    original.step = 2
    original.save(tmp_path / "c.fpk")
    loaded = fastper.load(tmp_path / "c.fpk")
    assert loaded.step == 2 and loaded.alpha == original.alpha == 0.2
    _lockstep(original, loaded, rounds=5)


def _custom_alpha(step: int) -> float:
    return 0.5 + 0.05 * (step % 4)


def test_custom_callable_schedule(tmp_path):
    original = fastper.PrioritizedReplayBuffer(
        16, CARTPOLE_FIELDS, alpha=_custom_alpha, beta=lambda t: min(1.0, 0.4 + 0.1 * t), seed=4
    )
    original.add(make_batch(10))
    original.sample(3)
    path = tmp_path / "custom.fpk"
    original.save(path)  # saving works
    meta = fastper.read_metadata(path)
    assert meta["state"]["schedules"]["alpha"]["kind"] == "callable"
    assert meta["state"]["schedules"]["beta"]["kind"] == "callable"
    with pytest.raises(fastper.ScheduleNotSerializableError, match="alpha") as info:
        fastper.load(path)
    assert isinstance(info.value, ValueError)
    with pytest.raises(fastper.ScheduleNotSerializableError, match="beta"):
        fastper.load(path, alpha=_custom_alpha)  # beta still missing
    loaded = fastper.load(path, alpha=_custom_alpha, beta=original._beta_schedule)
    assert loaded._alpha_schedule is _custom_alpha
    _lockstep(original, loaded, rounds=6)
    # a saved serialisable schedule can be overridden too
    plain = fastper.PrioritizedReplayBuffer(16, CARTPOLE_FIELDS, seed=4)
    plain.add(make_batch(4))
    plain.save(tmp_path / "plain.fpk")
    over = fastper.load(tmp_path / "plain.fpk", alpha=0.25, beta=schedules.linear(0.1, 1.0, 3))
    over.sample(2)
    assert over.alpha == 0.25 and over.beta == pytest.approx(0.4)


def test_custom_callable_schedule_in_a_pending_switch(tmp_path):
    """A custom alpha waiting in a scheme switch needs a way back too: either save
    refuses it, or load(path, alpha=...) restores the buffer, which then continues."""
    original = fastper.PrioritizedReplayBuffer(16, CARTPOLE_FIELDS, seed=4)
    original.add(make_batch(10))
    original.switch_scheme("rank", at_step=3, alpha=_custom_alpha)
    path = tmp_path / "switch.fpk"
    try:
        original.save(path)
    except fastper.ScheduleNotSerializableError:
        return  # refused up front: acceptable
    meta = fastper.read_metadata(path)
    assert meta["state"]["buffer"]["pending_switch"]["alpha"]["kind"] == "callable"
    with pytest.raises(fastper.ScheduleNotSerializableError, match="alpha"):
        fastper.load(path)
    loaded = fastper.load(path, alpha=_custom_alpha)
    _lockstep(original, loaded, rounds=6)  # switches at step 3
    assert loaded.scheme == "rank" and loaded._alpha_schedule is _custom_alpha


def test_read_metadata_returns_header_only(tmp_path):
    buf = BUFFERS["rank-nstep-sort-every"]()
    _history(buf)
    path = tmp_path / "m.fpk"
    buf.save(path)
    meta = fastper.read_metadata(path)
    header, data, start = _split(path.read_bytes())
    assert header["format"] == "fastper-checkpoint" and header["format_version"] == VERSION
    assert meta == {
        "format_version": VERSION,
        "fastper_version": fastper.__version__,
        "state": header["state"],
        "arrays": header["arrays"],
    }
    state = meta["state"]
    assert state["kind"] == "rank" and state["settings"]["capacity"] == 12
    assert state["writer"]["size"] == len(buf)
    assert state["writer"]["total_added"] == buf.total_added
    assert state["settings"]["sort_every"] == 3 and state["settings"]["nstep"]["n"] == 4
    assert state["buffer"]["step"] == buf.step
    names = {e["name"] for e in meta["arrays"]}
    assert {"sampler/priorities", "sampler/pending_slots", "sampler/pending_ranked"} <= names
    assert {f"storage/columns/{f}" for f in buf.fields} <= names
    assert {"nstep/stream_ids", "nstep/lengths", "nstep/skip_next"} <= names
    assert sum(e["nbytes"] for e in meta["arrays"]) == len(data)
    _, arrays = _parts(path)
    assert int(arrays["nstep/lengths"].sum()) == buf.n_pending > 0

    def no_arrays(obj):
        assert not isinstance(obj, np.ndarray)
        for v in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ():
            no_arrays(v)

    no_arrays(meta)
    assert json.loads(json.dumps(meta)) == meta  # plain JSON data
    # the data section is not read unless verify=True
    raw = bytearray(path.read_bytes())
    raw[start + len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert fastper.read_metadata(path) == meta
    with pytest.raises(fastper.CheckpointError):
        fastper.read_metadata(path, verify=True)
    with pytest.raises(fastper.CheckpointError):
        fastper.load(path)


# ---------------------------------------------------------------------------
# corruption
# ---------------------------------------------------------------------------


def test_checkpoint_error_is_a_value_error():
    assert issubclass(fastper.CheckpointError, ValueError)
    assert issubclass(fastper.CheckpointError, fastper.FastPERError)


@pytest.mark.parametrize("name", ["proportional", "rank-nstep-sort-every", "uniform"])
def test_every_single_byte_flip_is_detected(name, tmp_path):
    buf = BUFFERS[name]()
    _history(buf)
    good = tmp_path / "good.fpk"
    buf.save(good)
    raw = good.read_bytes()
    assert len(raw) < 12_000  # small enough to try every byte
    _, _, data_start = _split(raw)
    bad = tmp_path / "bad.fpk"
    masks = (0x01, 0x80, 0xFF) if name == "proportional" else (0x01,)
    for pos in range(len(raw)):
        for mask in masks:
            flipped = bytearray(raw)
            flipped[pos] ^= mask
            _rewrite(bad, bytes(flipped))
            with pytest.raises(fastper.CheckpointError):
                fastper.load(bad)
            with pytest.raises(fastper.CheckpointError):
                fastper.read_metadata(bad, verify=True)
            if pos < data_start:  # the header region is covered by its own digest
                with pytest.raises(fastper.CheckpointError):
                    fastper.read_metadata(bad)
    assert isinstance(fastper.load(good), type(buf))


def test_truncation_and_extension_are_detected(small_ckpt, tmp_path):
    raw = small_ckpt.read_bytes()
    bad = tmp_path / "bad.fpk"
    for length in range(len(raw)):
        _rewrite(bad, raw[:length])
        for reader in (fastper.load, fastper.read_metadata):
            with pytest.raises(fastper.CheckpointError):
                reader(bad)
    for extra in (b"\x00", b"x" * 31, b"\x00" * 32, raw[-DIGEST:], raw):
        _rewrite(bad, raw + extra)
        with pytest.raises(fastper.CheckpointError):
            fastper.load(bad)
        with pytest.raises(fastper.CheckpointError):
            fastper.read_metadata(bad)


def test_empty_and_random_files(tmp_path):
    bad = tmp_path / "bad.fpk"
    bad.write_bytes(b"")
    with pytest.raises(fastper.CheckpointError):
        fastper.load(bad)
    rng = np.random.default_rng(0)
    for size in (1, 19, 20, 21, 52, 84, 100, 1000, 10_000):
        noise = rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()
        for blob in (
            noise,
            MAGIC + noise,
            PREFIX.pack(MAGIC, 1, 10) + noise,
            PREFIX.pack(MAGIC, 2, 10) + noise,
        ):
            _rewrite(bad, blob)
            with pytest.raises(fastper.CheckpointError):
                fastper.load(bad)
            with pytest.raises(fastper.CheckpointError):
                fastper.read_metadata(bad)


def test_wrong_magic_and_unknown_versions(small_ckpt, tmp_path):
    raw = small_ckpt.read_bytes()
    header, data, _ = _split(raw)
    hbytes = json.dumps(header).encode()
    bad = tmp_path / "bad.fpk"
    bad.write_bytes(_frame(hbytes, data))
    assert len(fastper.load(bad)) == 5  # the framing helper itself is right
    for magic in (b"\x89FPCKPT\r", b"\x93NUMPY\x01\x00", b"PK\x03\x04\x00\x00\x00\x00"):
        bad.write_bytes(_frame(hbytes, data, magic=magic))
        with pytest.raises(fastper.CheckpointError, match="magic"):
            fastper.load(bad)
    for version in (0, 3, 7, 2**32 - 1):
        bad.write_bytes(_frame(hbytes, data, version=version))
        for reader in (fastper.load, fastper.read_metadata):
            with pytest.raises(fastper.CheckpointError, match="version") as info:
                reader(bad)
            # the message names the version found, then the versions this fastper reads
            found, _, rest = str(info.value).partition(f"version {version}")
            assert found and re.search(r"\b1\b", rest) and re.search(r"\b2\b", rest), rest
    # a version-2 header under version 1, and a version-1 header under version 2
    bad.write_bytes(_frame(hbytes, data, version=1))
    with pytest.raises(fastper.CheckpointError, match="format-1"):
        fastper.read_metadata(bad)
    with pytest.raises(fastper.CheckpointError, match="format-1"):
        fastper.load(bad)
    v1_header, v1_data, _ = _split((V1_FIXTURES / "v1_rank.fpk").read_bytes(), version=1)
    bad.write_bytes(_frame(json.dumps(v1_header).encode(), v1_data, version=2))
    with pytest.raises(fastper.CheckpointError):
        fastper.load(bad)
    # a pickle stream, or numpy's own format, is not a checkpoint
    bad.write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(fastper.CheckpointError):
        fastper.load(bad)


# ---------------------------------------------------------------------------
# crafted headers and states
# ---------------------------------------------------------------------------


def _mutated_header(path: Path, mutate, version: int = VERSION) -> bytes:
    header, data, _ = _split(path.read_bytes(), version)
    header = copy.deepcopy(header)
    mutate(header)
    return _frame(json.dumps(header).encode(), data, version)


def _set_entry(name, **changes):
    def mutate(h):
        entry = next(e for e in h["arrays"] if e["name"] == name)
        entry.update(changes)

    return mutate


def _huge_shape(h):
    e = next(e for e in h["arrays"] if e["name"] == "storage/columns/obs")
    e["shape"] = [10**12]
    e["nbytes"] = 4 * 10**12


def _in_state(*path, **changes):
    """Update the dict at ``h["state"][path...]`` (format 2)."""

    def mutate(h):
        node = h["state"]
        for key in path:
            node = node[key]
        node.update(changes)

    return mutate


def _state_pop(part):
    return lambda h: h["state"].pop(part)


#: the small checkpoint's layout: arrays sampler/priorities (first, offset 0),
#: then storage/columns/{obs, action, reward, next_obs, done} (5 rows each)
CRAFTED_TABLE = {
    "huge-shape-1e12": _huge_shape,
    "negative-shape": _set_entry("storage/columns/obs", shape=[-5, -4]),
    "object-dtype": _set_entry("storage/columns/done", dtype="|O"),
    "unicode-dtype": _set_entry("storage/columns/done", dtype="<U1", nbytes=20),
    "structured-dtype": _set_entry("storage/columns/done", dtype="f2,f2", shape=[5]),
    "nbytes-mismatch": _set_entry("storage/columns/done", nbytes=16),
    "offset-outside-data": _set_entry("sampler/priorities", offset=10**6),
    "offset-overlaps": _set_entry("storage/columns/done", offset=0),
    "missing-array-table": lambda h: h.pop("arrays"),
    "array-table-not-a-list": lambda h: h.update(arrays={"sampler/priorities": 1}),
    "array-entry-not-a-dict": lambda h: h["arrays"].__setitem__(0, "storage/columns/obs"),
    "array-entry-missing-key": lambda h: h["arrays"][0].pop("dtype"),
    "unparsable-dtype": _set_entry("storage/columns/done", dtype="not-a-dtype"),
    # the next four are well-formed JSON that reach non-CheckpointError exceptions
    "non-finite-shape": _set_entry("storage/columns/obs", shape=[float("inf"), 4]),
    "non-finite-offset": _set_entry("sampler/priorities", offset=float("inf")),
    "dtype-string-python-syntax-error": _set_entry("storage/columns/done", dtype="(3,"),
    "schedule-not-an-object": _in_state("schedules", alpha=[0.6]),
    "capacity-non-finite": _in_state("settings", capacity=float("inf")),
    "capacity-huge": _in_state("settings", capacity=10**12),
    "capacity-zero": _in_state("settings", capacity=0),
    "unknown-buffer-kind": _in_state(kind="fancy"),
    "size-over-capacity": _in_state("writer", size=7),
    "cursor-out-of-range": _in_state("writer", cursor=6),
    "added-below-size": _in_state("writer", total_added=3),
    "max-priority-below-one": _in_state("buffer", max_priority_ever=0.5),
    "bad-weight-norm": _in_state("settings", weight_norm="max"),
    "negative-seed": _in_state("settings", seed=-1),
    "bad-rng-state": _in_state("buffer", rng={"bit_generator": "MT19937"}),
    "unknown-schedule-kind": _in_state("schedules", alpha={"kind": "exp"}),
    "negative-alpha-schedule": _in_state("schedules", beta={"kind": "constant", "value": -1}),
    "fields-mismatch": lambda h: h["state"]["settings"]["fields"][0][1].update(shape=[5]),
    "field-object-dtype": lambda h: h["state"]["settings"]["fields"][1][1].update(dtype="|O"),
    # format 2: the state's parts
    "no-state": lambda h: h.pop("state"),
    "state-not-an-object": lambda h: h.update(state=[1, 2]),
    "state-without-writer": _state_pop("writer"),
    "state-without-buffer": _state_pop("buffer"),
    "state-without-sampler": _state_pop("sampler"),
    "state-without-storage": _state_pop("storage"),
    "state-without-settings": _state_pop("settings"),
    "buffer-part-not-an-object": _in_state(buffer=3),
    "unknown-scheme": _in_state("buffer", scheme="fancy"),
    "scheme-options-not-an-object": _in_state("buffer", scheme_options=[1]),
    "pending-switch-unknown-scheme": _in_state(
        "buffer", pending_switch={"scheme": "fancy", "at_step": 9, "alpha": None, "options": {}}
    ),
    "pending-switch-negative-step": _in_state(
        "buffer", pending_switch={"scheme": "rank", "at_step": -1, "alpha": None, "options": {}}
    ),
    "pending-switch-bad-alpha": _in_state(
        "buffer",
        pending_switch={"scheme": "rank", "at_step": 9, "alpha": {"kind": "exp"}, "options": {}},
    ),
    "negative-stale-updates": _in_state("buffer", stale_updates=-1),
    "step-not-an-int": _in_state("buffer", step=2.5),
    "negative-sampler-alpha": _in_state("sampler", alpha=-0.5),
    "unknown-max-priority-policy": _in_state("settings", max_priority="sometimes"),
    "shuffle-not-a-bool": _in_state("settings", shuffle=1),
    "alpha-every-zero": _in_state("settings", alpha_every=0),
    "nstep-state-without-nstep": _in_state(nstep={"format": 2, "dropped": 0}),
}


@pytest.mark.parametrize("case", list(CRAFTED_TABLE))
def test_crafted_header_is_rejected(case, small_ckpt, tmp_path):
    ok = tmp_path / "ok.fpk"
    ok.write_bytes(_mutated_header(small_ckpt, lambda h: None))
    assert len(fastper.load(ok)) == 5  # re-framing alone is fine: the mutation is the defect
    bad = tmp_path / "crafted.fpk"
    bad.write_bytes(_mutated_header(small_ckpt, CRAFTED_TABLE[case]))
    err, peak, _ = refusal_cost(fastper.load, bad, fastper.CheckpointError)
    assert str(err), "an error without a message"
    assert peak < 16 * 2**20, f"{peak} bytes allocated while rejecting the file"


def _unknown_part(h):
    h["state"]["extra"] = {}
    e = h["arrays"][-1]
    h["arrays"].append(
        {"name": "extra/blob", "dtype": "<f8", "shape": [0], "offset": e["offset"] + e["nbytes"],
         "nbytes": 0}
    )  # fmt: skip


#: entries no part of this fastper knows: every part refuses them (the settings,
#: the storage, the samplers, the n-step state, the buffer, writer and schedules)
UNKNOWN_ENTRIES = {
    "setting": _in_state("settings", turbo=True),
    "storage-entry": _in_state("storage", turbo=1),
    "state-part": _unknown_part,
    "buffer-entry": _in_state("buffer", turbo=1),
    "writer-entry": _in_state("writer", turbo=1),
    "proportional-sampler-entry": _in_state("sampler", turbo=1),
    "schedule": _in_state("schedules", gamma={"kind": "constant", "value": 1.0}),
}


@pytest.mark.parametrize("mutate", list(UNKNOWN_ENTRIES.values()), ids=list(UNKNOWN_ENTRIES))
def test_unknown_state_entries_are_rejected(mutate, small_ckpt, tmp_path):
    """A state this fastper cannot fully apply (e.g. from a newer writer) is refused,
    not loaded without what it does not know."""
    bad = tmp_path / "unknown.fpk"
    bad.write_bytes(_mutated_header(small_ckpt, mutate))
    with pytest.raises(fastper.CheckpointError) as info:
        fastper.load(bad)
    assert str(info.value)


def _v1_set(part, **changes):
    """Update ``h[part]`` of a format-1 header."""
    return lambda h: h[part].update(changes)


#: format-1 headers (fixture v1_proportional.fpk: capacity 16, size 16,
#: cursor 6, total_added 22, key_base 0), upgraded on load
CRAFTED_V1 = {
    "cursor-inconsistent": _v1_set("state", cursor=7),
    "cursor-out-of-range": _v1_set("state", cursor=16),
    "size-over-capacity": _v1_set("state", size=17),
    "added-below-size": _v1_set("state", total_added=3),
    "key-base-beyond-counter": _v1_set("state", key_base=23),
    "max-priority-below-one": _v1_set("state", max_priority=0.5),
    "negative-step": _v1_set("state", step=-1),
    "bad-rng-state": _v1_set("state", rng={"bit_generator": "MT19937"}),
    "unknown-buffer-kind": lambda h: h.update(buffer="fancy"),
    "capacity-huge": lambda h: h.update(capacity=10**12),
    "capacity-zero": lambda h: h.update(capacity=0),
    "unknown-schedule-kind": lambda h: h.update(alpha_schedule={"kind": "exp"}),
    "fields-mismatch": lambda h: h["fields"][0][1].update(shape=[5]),
    "unknown-setting": _v1_set("settings", turbo=True),
    "n-step-not-an-int": _v1_set("settings", n_step="three"),
    "n-step-without-its-window": _v1_set("settings", n_step=3),
    "nstep-keys-not-an-object": _v1_set("settings", nstep_keys=[1, 2]),
    # malformed format-1 headers: upgrade_v1 cannot read them
    "missing-settings": lambda h: h.pop("settings"),
    "missing-state": lambda h: h.pop("state"),
    "settings-not-an-object": lambda h: h.update(settings=[1, 2]),
    "state-not-an-object": lambda h: h.update(state=3),
    "missing-beta-schedule": lambda h: h.pop("beta_schedule"),
    "object-dtype": _set_entry("data/obs", dtype="|O"),
}


@pytest.mark.parametrize("case", list(CRAFTED_V1))
def test_crafted_format_1_header_is_rejected(case, tmp_path):
    fixture = V1_FIXTURES / "v1_proportional.fpk"
    ok = tmp_path / "ok.fpk"
    ok.write_bytes(_mutated_header(fixture, lambda h: None, version=1))
    assert len(fastper.load(ok)) == 16  # re-framing a format-1 file alone is fine
    bad = tmp_path / "crafted-v1.fpk"
    bad.write_bytes(_mutated_header(fixture, CRAFTED_V1[case], version=1))
    err, peak, _ = refusal_cost(fastper.load, bad, fastper.CheckpointError)
    assert str(err), "an error without a message"
    assert peak < 16 * 2**20, f"{peak} bytes allocated while rejecting the file"


def test_crafted_deeply_nested_header_is_rejected(small_ckpt, tmp_path):
    _, data, _ = _split(small_ckpt.read_bytes())
    bad = tmp_path / "nested.fpk"
    for version in (1, 2):
        bad.write_bytes(_frame(b"[" * 200_000 + b"]" * 200_000, data, version))
        with pytest.raises(fastper.CheckpointError):
            fastper.read_metadata(bad)
        with pytest.raises(fastper.CheckpointError):
            fastper.load(bad)
    # nested inside a valid state
    header, _, _ = _split(small_ckpt.read_bytes())
    hbytes = json.dumps(header).encode()
    deep = hbytes.replace(b'"storage": {}', b'"storage": ' + b"[" * 200_000 + b"]" * 200_000)
    assert deep != hbytes
    bad.write_bytes(_frame(deep, data))
    with pytest.raises(fastper.CheckpointError):
        fastper.load(bad)


def _rank_parts(tmp_path):
    """A rank buffer with sort_every (so re-rankings wait: pending slots in its state)."""
    buf = fastper.RankBasedReplayBuffer(8, CARTPOLE_FIELDS, sort_every=4, seed=0)
    buf.add(make_batch(8), priorities=np.arange(8.0, 0.0, -1.0))
    s = buf.sample(3)
    buf.update_priorities(s.indices, [5.0, 0.5, 2.5], keys=s.keys)
    buf.save(tmp_path / "rank.fpk")
    meta, arrays = _parts(tmp_path / "rank.fpk")
    assert arrays["sampler/pending_slots"].shape[0] >= 2
    return meta, arrays


def _pending_without_sort_every(m, a):
    for node in (m["state"]["settings"], m["state"]["buffer"]["scheme_options"]):
        node["sort_every"] = None


def _st(part, **changes):
    """Update ``meta["state"][part]`` (format 2)."""
    return lambda m, a: m["state"][part].update(changes)


CRAFTED_ARRAYS = {
    "negative-priority": lambda m, a: a.update({"sampler/priorities": -a["sampler/priorities"]}),
    "nan-priority": lambda m, a: a.update(
        {"sampler/priorities": np.where(np.arange(8) == 3, np.nan, a["sampler/priorities"])}
    ),
    "inf-priority": lambda m, a: a.update(
        {"sampler/priorities": np.where(np.arange(8) == 3, np.inf, a["sampler/priorities"])}
    ),
    "priorities-wrong-dtype": lambda m, a: a.update(
        {"sampler/priorities": a["sampler/priorities"].astype(np.float32)}
    ),
    "priorities-too-short": lambda m, a: a.update(
        {"sampler/priorities": a["sampler/priorities"][:5]}
    ),
    "missing-array": lambda m, a: a.pop("sampler/priorities"),
    "missing-column": lambda m, a: a.pop("storage/columns/reward"),
    "extra-array": lambda m, a: a.update({"storage/columns/extra": np.zeros(8)}),
    "data-wrong-dtype": lambda m, a: a.update(
        {"storage/columns/action": a["storage/columns/action"].astype(np.int32)}
    ),
    "column-too-short": lambda m, a: a.update(
        {"storage/columns/obs": a["storage/columns/obs"][:7]}
    ),
    # arrays go back into the parts of the state by name
    "array-in-unknown-part": lambda m, a: a.update({"bogus/x": np.zeros(2)}),
    "array-without-part": lambda m, a: a.update({"x": np.zeros(2)}),
    "array-inside-a-string": lambda m, a: a.update({"kind/x": np.zeros(2)}),
    "array-for-absent-nstep": lambda m, a: a.update({"nstep/lengths": np.zeros(1, np.int64)}),
    "array-replaces-a-counter": lambda m, a: a.update({"writer/size": np.array(8)}),
    "array-replaces-alpha": lambda m, a: a.update({"sampler/alpha": np.array([0.7])}),
    # the keys are derived from the ring: its counters must agree with each other
    "key-base-negative": _st("writer", key_base=-1),
    "key-base-beyond-counter": lambda m, a: m["state"]["writer"].update(
        key_base=m["state"]["writer"]["total_added"] + 1
    ),
    "cursor-disagrees-with-counter": lambda m, a: m["state"]["writer"].update(
        total_added=m["state"]["writer"]["total_added"] + 1
    ),
    # the rank order is rebuilt from the priorities and the pending re-rankings
    "pending-slot-out-of-range": lambda m, a: a.update(
        {"sampler/pending_slots": a["sampler/pending_slots"] + 8}
    ),
    "pending-slot-negative": lambda m, a: a.update(
        {"sampler/pending_slots": a["sampler/pending_slots"] - 100}
    ),
    "pending-slots-repeat-a-slot": lambda m, a: a.update(
        {"sampler/pending_slots": np.zeros_like(a["sampler/pending_slots"])}
    ),
    "pending-slots-not-integers": lambda m, a: a.update(
        {"sampler/pending_slots": a["sampler/pending_slots"].astype(np.float64)}
    ),
    # ranked priorities for only some of the pending slots
    "pending-ranked-incomplete": lambda m, a: a.update(
        {"sampler/pending_ranked": a["sampler/pending_ranked"][:1]}
    ),
    "pending-ranked-negative": lambda m, a: a.update(
        {"sampler/pending_ranked": -a["sampler/pending_ranked"]}
    ),
    "pending-with-exact-ranks": _pending_without_sort_every,
    "samples-since-sort-negative": _st("sampler", samples_since_sort=-1),
    "last-batch-size-zero": _st("sampler", last_batch_size=0),
    "unknown-sampler-entry": _st("sampler", order=[0, 1]),
    # values the public API refuses (`step` setter: >= 0; alpha: finite, >= 0)
    "negative-step": _st("buffer", step=-3),
    "nan-alpha": _st("sampler", alpha=float("nan")),
    "negative-alpha": _st("sampler", alpha=-1.0),
}


@pytest.mark.parametrize("case", list(CRAFTED_ARRAYS))
def test_crafted_state_is_rejected(case, tmp_path):
    meta, arrays = _rank_parts(tmp_path)
    ok = tmp_path / "ok.fpk"
    ok.write_bytes(_build(meta, arrays))
    assert len(fastper.load(ok)) == 8  # the untouched rebuild loads
    meta, arrays = copy.deepcopy(meta), dict(arrays)
    CRAFTED_ARRAYS[case](meta, arrays)
    bad = tmp_path / "bad.fpk"
    bad.write_bytes(_build(meta, arrays))
    with pytest.raises(fastper.CheckpointError) as info:
        fastper.load(bad)
    assert str(info.value)


def _nstep_parts(tmp_path):
    """An n-step buffer with two streams, each with steps pending."""
    buf = fastper.PrioritizedReplayBuffer(
        8, CARTPOLE_FIELDS, n_step=3, gamma=0.9, nstep_keys=NO_TRUNCATION, seed=0
    )
    for t in range(4):
        buf.add(make_batch(2, 2 * t), env_ids=np.array([3, 5]))
    buf.save(tmp_path / "nstep.fpk")
    meta, arrays = _parts(tmp_path / "nstep.fpk")
    assert arrays["nstep/lengths"].tolist() == [2, 2]
    return meta, arrays


def _nstep_arrays(**changes):
    def mutate(m, a):
        for key, fn in changes.items():
            a[f"nstep/{key}"] = fn(a[f"nstep/{key}"])

    return mutate


CRAFTED_NSTEP = {
    "window-longer-than-n-1": _nstep_arrays(lengths=lambda x: x + 1),
    "negative-window": _nstep_arrays(lengths=lambda x: x - 3),
    "lengths-disagree-with-rows": _nstep_arrays(lengths=lambda x: x - 1),
    "duplicate-stream-ids": _nstep_arrays(stream_ids=lambda x: np.zeros_like(x)),
    "negative-stream-id": _nstep_arrays(stream_ids=lambda x: -x),
    "stream-ids-not-integers": _nstep_arrays(stream_ids=lambda x: x.astype(np.float64)),
    "skip-next-without-autoreset": _nstep_arrays(skip_next=lambda x: np.ones_like(x)),
    "pending-rows-wrong-dtype": _nstep_arrays(**{"pending/obs": lambda x: x.astype(np.float64)}),
    "missing-pending-rows": lambda m, a: a.pop("nstep/pending/obs"),
    "missing-stream-ids": lambda m, a: a.pop("nstep/stream_ids"),
    "unknown-nstep-array": lambda m, a: a.update({"nstep/pending/bogus": np.zeros(4)}),
    "unknown-nstep-format": _st("nstep", format=3),
    "negative-dropped": _st("nstep", dropped=-1),
    "nstep-state-missing": lambda m, a: (
        m["state"].update(nstep=None),
        [a.pop(k) for k in list(a) if k.startswith("nstep/")],
    ),
    "nstep-n-mismatch": lambda m, a: m["state"]["settings"]["nstep"].update(n=2),
}


@pytest.mark.parametrize("case", list(CRAFTED_NSTEP))
def test_crafted_nstep_state_is_rejected(case, tmp_path):
    meta, arrays = _nstep_parts(tmp_path)
    ok = tmp_path / "ok.fpk"
    ok.write_bytes(_build(meta, arrays))
    assert fastper.load(ok).n_pending == 4  # the untouched rebuild loads
    meta, arrays = copy.deepcopy(meta), dict(arrays)
    CRAFTED_NSTEP[case](meta, arrays)
    bad = tmp_path / "bad.fpk"
    bad.write_bytes(_build(meta, arrays))
    with pytest.raises(fastper.CheckpointError) as info:
        fastper.load(bad)
    assert str(info.value)


def _v1_parts():
    return _parts(V1_FIXTURES / "v1_proportional.fpk", version=1)


CRAFTED_V1_ARRAYS = {
    "negative-priority": lambda m, a: a.update({"sampler/priorities": -a["sampler/priorities"]}),
    "priorities-wrong-dtype": lambda m, a: a.update(
        {"sampler/priorities": a["sampler/priorities"].astype(np.float32)}
    ),
    "missing-priorities": lambda m, a: a.pop("sampler/priorities"),
    "missing-column": lambda m, a: a.pop("data/reward"),
    "extra-column": lambda m, a: a.update({"data/extra": np.zeros(16)}),
    "data-wrong-dtype": lambda m, a: a.update({"data/action": a["data/action"].astype(np.int32)}),
    "column-too-short": lambda m, a: a.update({"data/obs": a["data/obs"][:15]}),
    "nstep-window-without-n-step": lambda m, a: a.update({"nstep/obs": np.zeros((1, 3), "<f4")}),
}


@pytest.mark.parametrize("case", list(CRAFTED_V1_ARRAYS))
def test_crafted_format_1_state_is_rejected(case, tmp_path):
    meta, arrays = _v1_parts()
    ok = tmp_path / "ok.fpk"
    ok.write_bytes(_build(meta, arrays, version=1))
    assert len(fastper.load(ok)) == 16  # the untouched rebuild loads
    meta, arrays = copy.deepcopy(meta), dict(arrays)
    CRAFTED_V1_ARRAYS[case](meta, arrays)
    bad = tmp_path / "bad.fpk"
    bad.write_bytes(_build(meta, arrays, version=1))
    with pytest.raises(fastper.CheckpointError) as info:
        fastper.load(bad)
    assert str(info.value)


@pytest.mark.parametrize(
    "mutate",
    [
        _set_entry("sampler/order", dtype="|O"),
        _set_entry("sampler/changed", dtype="<U1", nbytes=64),
        _set_entry("sampler/changed", offset=10**6),
        _set_entry("sampler/order", shape=[10**12], nbytes=8 * 10**12),
    ],
    ids=["object-dtype", "unicode-dtype", "outside-data", "huge-shape"],
)
def test_format_1_arrays_no_longer_used_are_still_checked(mutate, tmp_path):
    """A format-1 rank file's order arrays are skipped on load, but their table entries
    are checked like any other (by read_metadata too, which reads no arrays)."""
    fixture = V1_FIXTURES / "v1_rank.fpk"
    ok = tmp_path / "ok.fpk"
    ok.write_bytes(_mutated_header(fixture, lambda h: None, version=1))
    assert fastper.read_metadata(ok, verify=True)["state"]["kind"] == "rank"
    bad = tmp_path / "bad.fpk"
    bad.write_bytes(_mutated_header(fixture, mutate, version=1))
    for reader in (fastper.read_metadata, fastper.load):
        err, peak, _ = refusal_cost(reader, bad, fastper.CheckpointError)
        assert "sampler/" in str(err)
        assert peak < 16 * 2**20


def _load_in_subprocess(path: Path, limit_gib: int = 6) -> tuple[str, float]:
    """load(path) in a subprocess under an address-space limit: (outcome, seconds).

    The outcome is ``loaded`` or the exception's class name; a runaway
    allocation is then a clean MemoryError there rather than memory pressure
    here.
    """
    script = textwrap.dedent(
        f"""
        import resource, time
        resource.setrlimit(resource.RLIMIT_AS, ({limit_gib} << 30, {limit_gib} << 30))
        import fastper
        t0 = time.perf_counter()
        try:
            fastper.load({str(path)!r})
        except Exception as exc:
            outcome = type(exc).__name__
        else:
            outcome = "loaded"
        print(outcome, time.perf_counter() - t0)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    outcome, seconds = out.stdout.split()
    return outcome, float(seconds)


def test_crafted_huge_field_shape_is_rejected_before_allocating(tmp_path):
    """A 2 KB file must not make load() allocate terabytes (capacity x field size)."""
    empty = fastper.PrioritizedReplayBuffer(6, CARTPOLE_FIELDS, seed=0)
    empty.save(tmp_path / "empty.fpk")
    meta, arrays = _parts(tmp_path / "empty.fpk")
    meta["state"]["settings"]["fields"][0][1]["shape"] = [10**6, 10**6]  # 10**12 per item
    arrays["storage/columns/obs"] = np.zeros((0, 10**6, 10**6), dtype=np.float32)  # 0 bytes
    bad = tmp_path / "huge-field.fpk"
    bad.write_bytes(_build(meta, arrays))
    outcome, _ = _load_in_subprocess(bad)
    assert outcome == "CheckpointError"


def test_crafted_huge_n_envs_is_rejected_before_allocating(tmp_path):
    """The n-step streams' memory comes from the header too: a forged n_envs must not
    make load() allocate per-stream windows and tables for a billion envs."""
    buf = fastper.PrioritizedReplayBuffer(
        8, CARTPOLE_FIELDS, n_step=3, n_envs=2, nstep_keys=NO_TRUNCATION, seed=0
    )
    buf.add(_transitions(2, 0))
    buf.save(tmp_path / "envs.fpk")
    meta, arrays = _parts(tmp_path / "envs.fpk")
    assert meta["state"]["settings"]["nstep"]["n_envs"] == 2
    meta["state"]["settings"]["nstep"]["n_envs"] = 10**9
    bad = tmp_path / "huge-n-envs.fpk"
    bad.write_bytes(_build(meta, arrays))
    outcome, seconds = _load_in_subprocess(bad)
    assert outcome == "CheckpointError", outcome
    assert seconds < 5.0


# ---------------------------------------------------------------------------
# atomic saves
# ---------------------------------------------------------------------------


class _FullDisk:
    """A file object whose writes fail (ENOSPC) once ``limit`` bytes are written."""

    def __init__(self, f, limit: int) -> None:
        self._f, self._left = f, limit

    def write(self, chunk) -> int:
        data = bytes(chunk)
        if len(data) > self._left:
            self._f.write(data[: self._left])
            self._left = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._left -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def _fail_disk_full(limit):
    def install(mp):
        real = os.fdopen
        mp.setattr(os, "fdopen", lambda *a, **k: _FullDisk(real(*a, **k), limit))

    return install


def _fail_attr(module, name, exc):
    def install(mp):
        def boom(*args, **kwargs):
            raise exc

        mp.setattr(module, name, boom)

    return install


FAILURES = {
    "disk-full-in-header": (_fail_disk_full(100), OSError),
    "disk-full-in-data": (_fail_disk_full(2500), OSError),
    "fsync-fails": (_fail_attr(os, "fsync", OSError(errno.EIO, "I/O error")), OSError),
    "interrupted-at-fsync": (_fail_attr(os, "fsync", KeyboardInterrupt()), KeyboardInterrupt),
    "rename-fails": (_fail_attr(os, "replace", OSError(errno.EXDEV, "cross-device")), OSError),
    "array-conversion-fails": (
        _fail_attr(np, "ascontiguousarray", MemoryError("boom")),
        MemoryError,
    ),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_save_keeps_previous_checkpoint(failure, tmp_path, monkeypatch):
    install, exc_type = FAILURES[failure]
    buf = fastper.PrioritizedReplayBuffer(64, CARTPOLE_FIELDS, seed=0)
    buf.add(make_batch(10))
    work = tmp_path / "work"
    work.mkdir()
    path = work / "ckpt.fpk"
    buf.save(path)
    previous = path.read_bytes()
    state_then = _state(buf)
    buf.add(make_batch(40, 10))
    buf.sample(8)
    buf.save(tmp_path / "probe.fpk")
    _, data, data_start = _split((tmp_path / "probe.fpk").read_bytes())
    assert data_start < 2500 < data_start + len(data)  # "in-data" really fails mid-data
    with monkeypatch.context() as mp:
        install(mp)
        with pytest.raises(exc_type):
            buf.save(path)
    assert path.read_bytes() == previous
    assert sorted(p.name for p in work.iterdir()) == ["ckpt.fpk"]  # no temporary left
    assert_same_state(state_then, _state(fastper.load(path)))
    # a failed save into a fresh name leaves nothing behind either
    with monkeypatch.context() as mp:
        install(mp)
        with pytest.raises(exc_type):
            buf.save(work / "fresh.fpk")
    assert sorted(p.name for p in work.iterdir()) == ["ckpt.fpk"]
    # the buffer itself is untouched by the failures: a later save works
    buf.save(path)
    assert path.read_bytes() == (tmp_path / "probe.fpk").read_bytes()
    assert sorted(p.name for p in work.iterdir()) == ["ckpt.fpk"]


def test_successful_save_replaces_atomically(tmp_path):
    buf = fastper.RankBasedReplayBuffer(16, CARTPOLE_FIELDS, seed=0)
    path = tmp_path / "r.fpk"
    for k in range(1, 4):
        buf.add(make_batch(3, 3 * k))
        buf.save(str(path))  # str paths work too
        assert len(fastper.load(path)) == 3 * k
        assert sorted(p.name for p in tmp_path.iterdir()) == ["r.fpk"]


# ---------------------------------------------------------------------------
# no pickle
# ---------------------------------------------------------------------------


def test_save_and_load_never_unpickle(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle / np.load used by a checkpoint")

    for name, factory in BUFFERS.items():  # numba loads its compiled kernels with pickle:
        warm = factory()  # every kernel the checks below use is loaded first
        _history(warm)
        warm.save(tmp_path / f"warm-{name}.fpk")
        fastper.load(tmp_path / f"warm-{name}.fpk")
    for module, names in (
        (pickle, ("load", "loads", "Unpickler", "dump", "dumps", "Pickler")),
        (np, ("load", "save", "savez")),
    ):
        for name in names:
            monkeypatch.setattr(module, name, forbidden)
    for name, factory in BUFFERS.items():
        buf = factory()
        _history(buf)
        path = tmp_path / f"{name}.fpk"
        buf.save(path)
        loaded = fastper.load(path)
        assert_same_state(_state(buf), _state(loaded))
        assert fastper.read_metadata(path, verify=True)["state"]["kind"] == buf.kind


@pytest.mark.parametrize("max_priority", ["ever", 4.9])
def test_a_state_with_a_priority_nothing_could_have_recorded_is_refused(max_priority):
    """A stored priority above ``max_priority_ever`` and above the constant new
    items get: an inconsistent (edited or corrupt) state, refused; the buffer
    keeps its own."""
    buf = fastper.PrioritizedReplayBuffer(12, CARTPOLE_FIELDS, max_priority=max_priority, clip=9.0, seed=3)
    _history(buf)
    state = copy.deepcopy(buf.state_dict())
    bound = max(buf.max_priority_ever, 4.9 if max_priority == 4.9 else 0.0)
    state["sampler"]["priorities"][3] = np.nextafter(bound, np.inf)
    before = _state(buf)
    with pytest.raises(ValueError, match="below a stored priority"):
        buf.load_state_dict(state)
    assert_same_state(before, _state(buf))
    state["sampler"]["priorities"][3] = bound  # at the bound: a priority it could hold
    buf.load_state_dict(state)
