"""Hostile checkpoint files: refused with a clear error, in bounded time and memory, no code run.

``tests/unit/test_checkpoint.py`` already flips every byte of small files,
truncates at every length and forges header fields one by one. This file adds
what a file from an untrusted source can carry beyond that: live pickle
payloads in every framing a loader might be tricked into (raw pickle, ``.npy``
and ``.npz`` with object arrays, an object dtype in our own array table),
compressed bombs, random bytes at sizes up to megabytes, torn pages in a
larger checkpoint, and extreme values in every numeric field of a header with
valid digests. Every payload below would create ``marker`` if it were ever
unpickled or evaluated; the tests check it never appears.

Files are written in format 2 (the header's ``"state"`` is the buffer's
``state_dict()`` without arrays; arrays are named ``part/key``); framings that
do not depend on the header's layout are tried as format 1 too.
"""

from __future__ import annotations

import builtins
import copy
import functools
import hashlib
import io
import json
import pickle
import struct
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastper
from tests.oracles import refusal_cost

MAGIC = b"\x89FPCKPT\n"
PREFIX = struct.Struct("<8sIQ")
DIGEST = 32
VERSION = 2
FIELDS = {
    "obs": ((4,), np.float32),
    "reward": ((), np.float32),
    "next_obs": ((4,), np.float32),
    "done": ((), np.bool_),
}
REFUSED = (fastper.CheckpointError, fastper.ScheduleNotSerializableError)
V1_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints"
#: FIELDS have no truncation field: the n-step buffer must be told so
NO_TRUNCATION = {"truncated": None}


class _Payload:
    """Unpickling this runs ``exec``, which creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "marker"
    # the payload is live: unpickling it does create the marker
    pickle.loads(pickle.dumps(_Payload(path)))
    assert path.exists()
    path.unlink()
    return path


@pytest.fixture
def no_unpickling(monkeypatch, tmp_path):
    """Tripwires on every way to unpickle, besides the marker.

    Numba loads its cached kernels with pickle, so every kernel is loaded first.
    """
    warm = tmp_path / "warm"
    warm.mkdir()
    _exercise(fastper.load(_checkpoint(warm)))
    for cls in (fastper.ReplayBuffer, fastper.PrioritizedReplayBuffer):
        b = cls(8, FIELDS, seed=0)
        b.save(warm / "w.fpk")
        _exercise(fastper.load(warm / "w.fpk"))

    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint reader tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(np, "load", forbidden)


def _frame(header: bytes, data: bytes = b"", version: int = VERSION) -> bytes:
    head = PREFIX.pack(MAGIC, version, len(header)) + header
    body = head + hashlib.sha256(head).digest() + data
    return body + hashlib.sha256(body).digest()


def _split(raw: bytes, version: int = VERSION) -> tuple[dict[str, Any], bytes]:
    _, got, hlen = PREFIX.unpack(raw[: PREFIX.size])
    assert got == version
    header = json.loads(raw[PREFIX.size : PREFIX.size + hlen])
    return header, raw[PREFIX.size + hlen + DIGEST : -DIGEST]


def _refused_bounded(path: Path, *, max_bytes: int = 16 * 2**20, max_s: float = 5.0) -> None:
    """load and read_metadata(verify=True) raise CheckpointError, quickly and in little memory."""
    for reader in (fastper.load, lambda p: fastper.read_metadata(p, verify=True)):
        err, peak, elapsed = refusal_cost(reader, path, REFUSED)
        assert str(err), "an error without a message"
        assert peak < max_bytes, f"{peak} bytes allocated to refuse {path.name}"
        assert elapsed < max_s, f"{elapsed:.1f} s to refuse {path.name}"


def _checkpoint(tmp_path: Path, name: str = "good.fpk") -> Path:
    buf = fastper.RankBasedReplayBuffer(
        16, FIELDS, n_step=3, sort_every=4, beta=fastper.schedules.linear(0.4, 1.0, 50),
        nstep_keys=NO_TRUNCATION, seed=1,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for i in range(6):
        k = 4
        buf.add(
            {
                "obs": rng.random((k, 4)),
                "reward": rng.random(k),
                "next_obs": rng.random((k, 4)),
                "done": np.arange(k) == (i % 4),
            },
            env_ids=np.arange(k) % 2,  # two interleaved streams
        )
        s = buf.sample(5)
        buf.update_priorities(s.indices, rng.random(5), keys=s.keys)
    path = tmp_path / name
    buf.save(path)
    return path


# ---------------------------------------------------------------------------
# pickles in every framing
# ---------------------------------------------------------------------------


def _pickle_framings(marker: Path, good: bytes) -> dict[str, bytes]:
    payload = pickle.dumps(_Payload(marker), protocol=2)
    obj_array = np.array([_Payload(marker), 1], dtype=object)
    npy = io.BytesIO()
    np.save(npy, obj_array, allow_pickle=True)
    npz = io.BytesIO()
    np.savez(npz, evil=obj_array)
    header, data = _split(good)
    # our own format, an array declared as dtype object holding the pickle
    as_object = copy.deepcopy(header)
    entry = next(e for e in as_object["arrays"] if e["name"] == "sampler/priorities")
    as_object["arrays"] = [e for e in as_object["arrays"] if e is not entry]
    as_object["arrays"].append(
        {"name": "sampler/priorities", "dtype": "|O", "shape": [1],
         "offset": len(data) - entry["nbytes"], "nbytes": len(payload)}
    )  # fmt: skip
    start = entry["offset"]
    obj_data = data[:start] + data[start + entry["nbytes"] :] + payload
    # the pickle as the bytes of a legitimate-looking uint8 member
    as_bytes = copy.deepcopy(header)
    as_bytes["arrays"].append(
        {"name": "storage/columns/evil", "dtype": "|u1", "shape": [len(payload)],
         "offset": len(data), "nbytes": len(payload)}
    )  # fmt: skip
    # the pickle smuggled into the header as a callable schedule's text
    in_header = copy.deepcopy(header)
    sched = in_header["state"]["schedules"]
    sched["alpha"] = {"kind": "callable", "repr": payload.decode("latin-1")}
    sched["beta"] = {"kind": "pickle", "data": payload.hex()}
    sched["priority_noise"] = {"kind": "pickle", "data": payload.hex()}
    # ... and as a pending scheme switch's schedule, and the random state
    in_switch = copy.deepcopy(header)
    in_switch["state"]["buffer"]["pending_switch"] = {
        "scheme": "proportional", "at_step": 10**6, "options": {},
        "alpha": {"kind": "pickle", "data": payload.hex()},
    }  # fmt: skip
    in_rng = copy.deepcopy(header)
    in_rng["state"]["buffer"]["rng"] = {"bit_generator": "pickle", "state": payload.hex()}
    return {
        "raw-pickle": payload,
        "npy-object-array": npy.getvalue(),
        "npz-object-array": npz.getvalue(),
        "pickle-after-magic": MAGIC + payload,
        "object-dtype-member": _frame(json.dumps(as_object).encode(), obj_data),
        "pickle-as-uint8-member": _frame(json.dumps(as_bytes).encode(), data + payload),
        "pickle-in-header-strings": _frame(json.dumps(in_header).encode(), data),
        "pickle-in-pending-switch": _frame(json.dumps(in_switch).encode(), data),
        "pickle-as-random-state": _frame(json.dumps(in_rng).encode(), data),
        "object-dtype-member-format-1": _frame(json.dumps(as_object).encode(), obj_data, 1),
    }


#: well-framed files whose header is valid JSON: read_metadata returns it as
#: plain data (strings, numbers); only load, which builds a buffer, refuses them
HEADER_READABLE = {
    "pickle-as-uint8-member", "pickle-in-header-strings", "pickle-in-pending-switch",
    "pickle-as-random-state",
}  # fmt: skip


def test_pickle_payloads_are_refused_and_never_run(tmp_path, marker, no_unpickling):
    good = _checkpoint(tmp_path).read_bytes()
    framings = _pickle_framings(marker, good)
    for name, blob in framings.items():
        path = tmp_path / f"{name}.fpk"
        path.write_bytes(blob)
        if name in HEADER_READABLE:
            meta = fastper.read_metadata(path, verify=True)
            assert json.loads(json.dumps(meta)) == meta  # nothing but JSON data
            for kwargs in ({}, {"alpha": 0.5, "beta": 0.5}):  # beyond the callable alpha
                with pytest.raises(REFUSED) as info:
                    fastper.load(path, **kwargs)
                assert str(info.value)
        else:
            _refused_bounded(path)
            with pytest.raises(REFUSED):
                fastper.read_metadata(path)
    assert not marker.exists(), "a payload ran"


@pytest.mark.parametrize(
    "dtype",
    [
        "|O", "O8", "object", "[('a', 'O')]", "f8,O", "V8", "S4", "<U2", "M8[ns]", "m8[s]",
        "c16", "(2,)f8", "__import__('os').system('touch MARKER')",
        "eval(\"open('MARKER', 'w')\")", "f8" * 10_000,
    ],
)  # fmt: skip
def test_dtype_strings_cannot_smuggle_objects_or_code(dtype, tmp_path, marker, no_unpickling):
    good = _checkpoint(tmp_path).read_bytes()
    header, data = _split(good)
    dtype = dtype.replace("MARKER", str(marker))
    for e in header["arrays"]:
        if e["name"] == "storage/columns/done":
            e["dtype"] = dtype
    for f in header["state"]["settings"]["fields"]:
        if f[0] == "done":
            f[1]["dtype"] = dtype
    path = tmp_path / "dtype.fpk"
    path.write_bytes(_frame(json.dumps(header).encode(), data))
    _refused_bounded(path)
    assert not marker.exists()


# ---------------------------------------------------------------------------
# compressed bombs, random bytes, torn pages
# ---------------------------------------------------------------------------


@functools.cache
def _bombs() -> dict[str, bytes]:
    """Compressed files that expand to 32 MiB of zeros (about 32 KB each: 1000:1)."""
    comp = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip framing
    zero = bytes(2**20)
    gz = b"".join(comp.compress(zero) for _ in range(32)) + comp.flush()
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("sampler/priorities.npy", "w", force_zip64=True) as member:
            for _ in range(32):
                member.write(zero)
    return {
        "gzip-bomb": gz,
        "zip-bomb": zbuf.getvalue(),
        "gzip-after-magic": MAGIC + gz,
    }


@pytest.mark.parametrize("name", ["gzip-bomb", "zip-bomb", "gzip-after-magic"])
def test_compressed_bombs_are_refused_without_inflating(name, tmp_path):
    blob = _bombs()[name]
    assert len(blob) < 2**20
    path = tmp_path / f"{name}.fpk"
    path.write_bytes(blob)
    _refused_bounded(path, max_bytes=4 * 2**20, max_s=2.0)
    gz = _bombs()["gzip-bomb"]
    assert zlib.decompressobj(31).decompress(gz, 2**16) == bytes(2**16)  # a real bomb


def test_our_format_cannot_express_a_bomb(tmp_path):
    """No compression: a member's size is its size in the file, checked before allocating."""
    header, data = _split(_checkpoint(tmp_path).read_bytes())
    for nbytes, shape in ((2**40, [2**37]), (2**62, [2**59]), (2**63 + 8, [2**60 + 1])):
        forged = copy.deepcopy(header)
        e = next(e for e in forged["arrays"] if e["name"] == "sampler/priorities")
        e.update(nbytes=nbytes, shape=shape)
        path = tmp_path / "declared-huge.fpk"
        path.write_bytes(_frame(json.dumps(forged).encode(), data))
        _refused_bounded(path, max_bytes=2 * 2**20, max_s=1.0)


def test_random_bytes_of_every_size_are_refused(tmp_path):
    rng = np.random.default_rng(7)
    path = tmp_path / "noise.fpk"
    good = _checkpoint(tmp_path).read_bytes()
    for size in (8, 20, 53, 4096, 2**20, 8 * 2**20):
        noise = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        blobs = [
            noise,
            MAGIC + noise,
            good[: len(good) // 2] + noise,  # a valid start, then garbage
        ]
        for v in (1, 2):  # both format versions
            blobs += [
                PREFIX.pack(MAGIC, v, 2**64 - 1) + noise,  # a header length past everything
                PREFIX.pack(MAGIC, v, min(size, 100)) + noise,
                _frame(noise[:4096], version=v),  # random header bytes with valid digests
            ]
        for blob in blobs:
            path.write_bytes(blob)
            _refused_bounded(path, max_bytes=6 * 2**20)


def test_torn_pages_in_a_larger_checkpoint_are_detected(tmp_path):
    """A 4 KiB block zeroed or replaced (a torn or misdirected write) anywhere in a ~2 MB file."""
    buf = fastper.PrioritizedReplayBuffer(2**14, {"obs": ((32,), np.float32)}, seed=0)
    rng = np.random.default_rng(3)
    buf.add({"obs": rng.random((2**14, 32))})
    good = tmp_path / "large.fpk"
    buf.save(good)
    raw = good.read_bytes()
    assert len(raw) > 2 * 10**6
    bad = tmp_path / "torn.fpk"
    for start in rng.integers(0, len(raw) - 1, 12).tolist() + [0, len(raw) - 4096]:
        block = bytearray(raw)
        end = min(start + 4096, len(raw))
        filler = bytes(end - start) if start % 2 else rng.bytes(end - start)
        if block[start:end] == filler:  # pragma: no cover - the block already held that
            continue
        block[start:end] = filler
        bad.write_bytes(bytes(block))
        _refused_bounded(bad, max_bytes=12 * 2**20)
    for cut in (4096, len(raw) // 2, len(raw) - 4096, len(raw) - 1):
        bad.write_bytes(raw[:cut])
        _refused_bounded(bad, max_bytes=12 * 2**20)


# ---------------------------------------------------------------------------
# extreme values in every numeric field of a well-formed header
# ---------------------------------------------------------------------------

EXTREMES = [10**30, 2**63, -1, 1e308]


def _numeric_leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k != "arrays":
                out += _numeric_leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _numeric_leaves(v, (*path, i))
    elif isinstance(obj, int | float) and not isinstance(obj, bool) or obj is None:
        out.append(path)
    return out


def _exercise(buf) -> None:
    """A loaded buffer must work, or fail with a plain argument error (never crash)."""
    rng = np.random.default_rng(0)
    nstep = buf._nstep
    fields = buf.fields if nstep is None else nstep.fields  # without n-step's discount
    batch = {name: np.ones((3, *f.shape), dtype=f.dtype) for name, f in fields.items()}
    for name in ("done", "terminated", "truncated"):
        if name in batch:
            batch[name] = np.array([0, 0, 1], dtype=batch[name].dtype)  # an episode ends
    # one stream's steps (an n-step buffer needs to know whose steps a batch holds)
    env_ids = None if nstep is None or nstep.n_envs is not None else np.zeros(3, dtype=np.int64)
    for _ in range(3):
        buf.add(batch, env_ids=env_ids)
        s = buf.sample(5)
        buf.update_priorities(s.indices, rng.random(5), keys=s.keys)
    buf.probabilities(np.arange(len(buf)))


# a huge alpha makes a rank buffer's smallest probability underflow to 0 (weights
# of 0, with numpy's warning): a legal, if absurd, setting, not a file problem
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("version", [2, 1])
def test_extreme_numbers_in_any_header_field(version, tmp_path, marker):
    if version == 2:
        header, data = _split(_checkpoint(tmp_path).read_bytes())
    else:  # fastper 0.1.0's n-step file: its header is upgraded on load
        header, data = _split((V1_FIXTURES / "v1_nstep.fpk").read_bytes(), version=1)
    leaves = _numeric_leaves(header)
    assert len(leaves) >= 20
    path = tmp_path / "extreme.fpk"
    loaded_ok = refused = 0
    for leaf in leaves:
        for value in EXTREMES:
            forged = copy.deepcopy(header)
            node = forged
            for p in leaf[:-1]:
                node = node[p]
            node[leaf[-1]] = value
            path.write_bytes(_frame(json.dumps(forged).encode(), data, version))
            t0 = time.perf_counter()
            try:
                buf = fastper.load(path)
            except REFUSED:
                refused += 1
                continue
            try:
                _exercise(buf)
            except (ValueError, TypeError):
                pass  # e.g. a schedule that leaves [0, inf) later: a clear argument error
            loaded_ok += 1
            assert time.perf_counter() - t0 < 2.0, (leaf, value)
    assert refused > 0 and loaded_ok > 0
    assert not marker.exists()
