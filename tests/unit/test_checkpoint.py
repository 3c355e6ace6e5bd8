"""Checkpoints: round trips, exact continuation, corruption, crafted files, atomic saves.

Crafted files are built by ``_build`` following the layout in
``fastper/checkpoint.py``'s docstring (prefix, JSON header, header SHA-256,
data, whole-file SHA-256), with both digests recomputed, so each crafted
defect reaches the checks behind the digests.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import pickle
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
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _transitions(k: int, start: int) -> dict[str, np.ndarray]:
    """make_batch, with an episode ending every 7 steps (exercises n-step windows)."""
    batch = make_batch(k, start)
    batch["done"] = ((np.arange(start, start + k) % 7) == 6).astype(np.float32)
    return batch


def _state(buf) -> dict[str, Any]:
    """oracles.snapshot minus what carries no meaning for a rank sampler.

    ``_scratch`` is the merge's double buffer and ``order[m:]`` unused space
    (neither is read before being overwritten); ``_seg_cache`` is a cache of
    segment bounds (snapshot keeps it only while it is None). None is saved.
    """
    snap = snapshot(buf)
    snap.pop("sampler/_scratch", None)
    snap.pop("sampler/_seg_cache", None)
    if "sampler/m" in snap:
        snap["sampler/order"] = snap["sampler/order"][: snap["sampler/m"]]
    return snap


def _settings(buf) -> dict[str, Any]:
    out = {
        "type": type(buf),
        "capacity": buf.capacity,
        "fields": buf.fields,
        "eps": buf._eps,
        "clip": buf._clip,
        "stratified": buf._stratified,
        "weight_norm": buf._weight_norm,
        "gamma": buf._gamma,
        "seed": buf._seed,
        "n_step": None if buf._nstep is None else buf._nstep.settings(),
        "sampler": buf._sampler_settings(),
    }
    for name in ("_alpha_schedule", "_beta_schedule"):
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
        np.testing.assert_array_equal(a.add(tr), b.add(tr))
    assert_same_state(_state(a), _state(b))


def _history(buf, seed: int = 1) -> None:
    """Wrap the ring, update priorities, make some updates stale."""
    rng = np.random.default_rng(seed)
    written = 0
    for k in (5, 9, 7, 6):
        buf.add(_transitions(k, written))
        written += k
        s = buf.sample(4)
        buf.update_priorities(s.indices, rng.normal(scale=2.0, size=4), keys=s.keys)
    stale = buf.sample(5)
    buf.add(_transitions(buf.capacity, written))  # overwrites everything sampled above
    written += buf.capacity
    buf.update_priorities(stale.indices, np.ones(5), keys=stale.keys)
    buf.add(_transitions(2, written))  # leave an n-step window pending


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
    "rank": lambda: fastper.RankBasedReplayBuffer(12, CARTPOLE_FIELDS, alpha=0.8, seed=3),
    "rank-sort-every": lambda: fastper.RankBasedReplayBuffer(
        12, CARTPOLE_FIELDS, sort_every=4, weight_norm="none", seed=3
    ),
    "rank-segments": lambda: fastper.RankBasedReplayBuffer(
        12, CARTPOLE_FIELDS, segments=True, seed=3
    ),
    "uniform-nstep": lambda: fastper.ReplayBuffer(12, CARTPOLE_FIELDS, n_step=3, seed=3),
    "proportional-nstep": lambda: fastper.PrioritizedReplayBuffer(
        12, CARTPOLE_FIELDS, n_step=3, gamma=0.9, seed=3
    ),
    "rank-nstep-sort-every": lambda: fastper.RankBasedReplayBuffer(
        12, CARTPOLE_FIELDS, n_step=4, gamma=0.8, sort_every=3, seed=3
    ),
}


def _split(raw: bytes) -> tuple[dict[str, Any], bytes, int]:
    """(header JSON, data section, offset where data starts) of a checkpoint's bytes."""
    magic, version, hlen = PREFIX.unpack(raw[: PREFIX.size])
    assert (magic, version) == (MAGIC, 1)
    header = raw[PREFIX.size : PREFIX.size + hlen]
    start = PREFIX.size + hlen + DIGEST
    assert hashlib.sha256(raw[: PREFIX.size + hlen]).digest() == raw[PREFIX.size + hlen : start]
    assert hashlib.sha256(raw[:-DIGEST]).digest() == raw[-DIGEST:]
    return json.loads(header), raw[start:-DIGEST], start


def _frame(header: bytes, data: bytes, version: int = 1, magic: bytes = MAGIC) -> bytes:
    head = PREFIX.pack(magic, version, len(header)) + header
    body = head + hashlib.sha256(head).digest() + data
    return body + hashlib.sha256(body).digest()


def _build(meta: dict[str, Any], arrays: dict[str, np.ndarray], version: int = 1) -> bytes:
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


def _parts(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Independent parse of a checkpoint: (header without table, arrays)."""
    meta, data, _ = _split(path.read_bytes())
    arrays = {}
    for e in meta.pop("arrays"):
        arrays[e["name"]] = np.frombuffer(
            data[e["offset"] : e["offset"] + e["nbytes"]], dtype=e["dtype"]
        ).reshape(e["shape"])
    return meta, arrays


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
        assert original._sampler.n_changed > 0  # changes not yet merged into the order
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
    assert original.stale_updates > 0
    _lockstep(original, loaded, rounds=10)
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
    original = cls(16, CARTPOLE_FIELDS, alpha=alpha, beta=beta, seed=11)
    original.add(make_batch(10))
    for _ in range(5):
        s = original.sample(4)
        original.update_priorities(s.indices, np.arange(1.0, 5.0), keys=s.keys)
    path = tmp_path / f"{sched}.fpk"
    original.save(path)
    meta = fastper.read_metadata(path)
    assert meta["alpha_schedule"]["kind"] == sched
    assert meta["beta_schedule"]["kind"] == sched
    loaded = fastper.load(path)
    assert loaded._alpha_schedule == alpha and loaded._beta_schedule == beta
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
    assert meta["alpha_schedule"]["kind"] == "callable"
    with pytest.raises(fastper.ScheduleNotSerializableError) as info:
        fastper.load(path)
    assert isinstance(info.value, ValueError)
    with pytest.raises(fastper.ScheduleNotSerializableError):
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


def test_read_metadata_returns_header_only(tmp_path):
    buf = BUFFERS["rank-nstep-sort-every"]()
    _history(buf)
    path = tmp_path / "m.fpk"
    buf.save(path)
    meta = fastper.read_metadata(path)
    header, data, start = _split(path.read_bytes())
    assert meta == header
    assert meta["buffer"] == "rank" and meta["capacity"] == 12
    assert meta["state"]["size"] == len(buf) and meta["state"]["n_pending"] == buf.n_pending
    assert meta["state"]["total_added"] == buf.total_added
    assert meta["settings"]["sort_every"] == 3 and meta["settings"]["n_step"] == 4
    names = {e["name"] for e in meta["arrays"]}
    assert {"sampler/priorities", "sampler/order", "sampler/changed"} <= names
    assert {f"data/{f}" for f in buf.fields} <= names
    assert sum(e["nbytes"] for e in meta["arrays"]) == len(data)

    def no_arrays(obj):
        assert not isinstance(obj, np.ndarray)
        for v in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ():
            no_arrays(v)

    no_arrays(meta)
    # the data section is not read unless verify=True
    raw = bytearray(path.read_bytes())
    raw[start + len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert fastper.read_metadata(path) == header
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
            bad.write_bytes(bytes(flipped))
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
        bad.write_bytes(raw[:length])
        for reader in (fastper.load, fastper.read_metadata):
            with pytest.raises(fastper.CheckpointError):
                reader(bad)
    for extra in (b"\x00", b"x" * 31, b"\x00" * 32, raw[-DIGEST:], raw):
        bad.write_bytes(raw + extra)
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
        for blob in (noise, MAGIC + noise, PREFIX.pack(MAGIC, 1, 10) + noise):
            bad.write_bytes(blob)
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
    for version in (0, 2, 7, 2**32 - 1):
        bad.write_bytes(_frame(hbytes, data, version=version))
        with pytest.raises(fastper.CheckpointError, match="version"):
            fastper.load(bad)
        with pytest.raises(fastper.CheckpointError, match="version"):
            fastper.read_metadata(bad)
    # a pickle stream, or numpy's own format, is not a checkpoint
    bad.write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(fastper.CheckpointError):
        fastper.load(bad)


def _mutated_header(path: Path, mutate) -> bytes:
    header, data, _ = _split(path.read_bytes())
    header = copy.deepcopy(header)
    mutate(header)
    return _frame(json.dumps(header).encode(), data)


def _set_entry(name, **changes):
    def mutate(h):
        entry = next(e for e in h["arrays"] if e["name"] == name)
        entry.update(changes)

    return mutate


def _huge_shape(h):
    e = next(e for e in h["arrays"] if e["name"] == "data/obs")
    e["shape"] = [10**12]
    e["nbytes"] = 4 * 10**12


CRAFTED_TABLE = {
    "huge-shape-1e12": _huge_shape,
    "negative-shape": _set_entry("data/obs", shape=[-5, -4]),
    "object-dtype": _set_entry("data/done", dtype="|O"),
    "unicode-dtype": _set_entry("data/done", dtype="<U1", nbytes=20),
    "structured-dtype": _set_entry("data/done", dtype="f2,f2", shape=[5]),
    "nbytes-mismatch": _set_entry("data/done", nbytes=16),
    "offset-outside-data": _set_entry("sampler/priorities", offset=10**6),
    "offset-overlaps": _set_entry("sampler/priorities", offset=0),
    "missing-array-table": lambda h: h.pop("arrays"),
    "array-table-not-a-list": lambda h: h.update(arrays={"sampler/priorities": 1}),
    "array-entry-not-a-dict": lambda h: h["arrays"].__setitem__(0, "data/obs"),
    "array-entry-missing-key": lambda h: h["arrays"][0].pop("dtype"),
    "unparsable-dtype": _set_entry("data/done", dtype="not-a-dtype"),
    # the next four are well-formed JSON that reach non-CheckpointError exceptions
    "non-finite-shape": _set_entry("data/obs", shape=[float("inf"), 4]),
    "non-finite-offset": _set_entry("sampler/priorities", offset=float("inf")),
    "dtype-string-python-syntax-error": _set_entry("data/done", dtype="(3,"),
    "schedule-not-an-object": lambda h: h.update(alpha_schedule=[0.6]),
    "capacity-non-finite": lambda h: h.update(capacity=float("inf")),
    "capacity-huge": lambda h: h.update(capacity=10**12),
    "capacity-zero": lambda h: h.update(capacity=0),
    "unknown-buffer-kind": lambda h: h.update(buffer="fancy"),
    "size-over-capacity": lambda h: h["state"].update(size=7),
    "cursor-out-of-range": lambda h: h["state"].update(cursor=6),
    "added-below-size": lambda h: h["state"].update(total_added=3),
    "max-priority-below-one": lambda h: h["state"].update(max_priority=0.5),
    "unknown-setting": lambda h: h["settings"].update(turbo=True),
    "bad-weight-norm": lambda h: h["settings"].update(weight_norm="max"),
    "negative-seed": lambda h: h["settings"].update(seed=-1),
    "bad-rng-state": lambda h: h["state"].update(rng={"bit_generator": "MT19937"}),
    "unknown-schedule-kind": lambda h: h.update(alpha_schedule={"kind": "exp"}),
    "negative-alpha-schedule": lambda h: h.update(beta_schedule={"kind": "constant", "value": -1}),
    "fields-mismatch": lambda h: h["fields"][0][1].update(shape=[5]),
    "field-object-dtype": lambda h: h["fields"][1][1].update(dtype="|O"),
}


@pytest.mark.parametrize("case", list(CRAFTED_TABLE))
def test_crafted_header_is_rejected(case, small_ckpt, tmp_path):
    ok = tmp_path / "ok.fpk"
    ok.write_bytes(_mutated_header(small_ckpt, lambda h: None))
    assert len(fastper.load(ok)) == 5  # re-framing alone is fine: the mutation is the defect
    bad = tmp_path / "crafted.fpk"
    bad.write_bytes(_mutated_header(small_ckpt, CRAFTED_TABLE[case]))
    _, peak, _ = refusal_cost(fastper.load, bad, fastper.CheckpointError)
    assert peak < 16 * 2**20, f"{peak} bytes allocated while rejecting the file"


def test_crafted_deeply_nested_header_is_rejected(small_ckpt, tmp_path):
    _, data, _ = _split(small_ckpt.read_bytes())
    bad = tmp_path / "nested.fpk"
    bad.write_bytes(_frame(b"[" * 200_000 + b"]" * 200_000, data))
    with pytest.raises(fastper.CheckpointError):
        fastper.read_metadata(bad)
    with pytest.raises(fastper.CheckpointError):
        fastper.load(bad)


def _rank_parts(tmp_path):
    buf = fastper.RankBasedReplayBuffer(8, CARTPOLE_FIELDS, seed=0)
    buf.add(make_batch(8), priorities=np.arange(8.0, 0.0, -1.0))
    buf.sample(2)
    buf.save(tmp_path / "rank.fpk")
    return _parts(tmp_path / "rank.fpk")


CRAFTED_ARRAYS = {
    "negative-priority": lambda m, a: a.update({"sampler/priorities": -a["sampler/priorities"]}),
    "nan-priority": lambda m, a: a.update(
        {"sampler/priorities": np.where(np.arange(8) == 3, np.nan, a["sampler/priorities"])}
    ),
    "priorities-wrong-dtype": lambda m, a: a.update(
        {"sampler/priorities": a["sampler/priorities"].astype(np.float32)}
    ),
    "missing-array": lambda m, a: a.pop("sampler/priorities"),
    "extra-array": lambda m, a: a.update({"data/extra": np.zeros(8)}),
    "data-wrong-dtype": lambda m, a: a.update({"data/action": a["data/action"].astype(np.int32)}),
    # the keys are derived from the ring: its counters must agree with each other
    "key-base-negative": lambda m, a: m["state"].update(key_base=-1),
    "key-base-beyond-counter": lambda m, a: m["state"].update(
        key_base=m["state"]["total_added"] + 1
    ),
    "cursor-disagrees-with-counter": lambda m, a: m["state"].update(
        total_added=m["state"]["total_added"] + 1
    ),
    "order-out-of-range": lambda m, a: a.update({"sampler/order": a["sampler/order"] + 5}),
    "order-repeats-a-slot": lambda m, a: a.update({"sampler/order": np.zeros(8, np.int64)}),
    # an order that covers only half the slots, with nothing marked changed
    "order-incomplete": lambda m, a: a.update({"sampler/order": a["sampler/order"][:4]}),
    # values the public API refuses (`step` setter: >= 0; alpha: finite, >= 0)
    "negative-step": lambda m, a: m["state"].update(step=-3),
    "nan-alpha": lambda m, a: m["state"].update(alpha=float("nan")),
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
    with pytest.raises(fastper.CheckpointError):
        fastper.load(bad)


def test_crafted_huge_field_shape_is_rejected_before_allocating(small_ckpt, tmp_path):
    """A 2 KB file must not make load() allocate terabytes (capacity x field size).

    Runs in a subprocess under a 6 GiB address-space limit, so a failure is a
    clean MemoryError there rather than memory pressure here.
    """
    empty = fastper.PrioritizedReplayBuffer(6, CARTPOLE_FIELDS, seed=0)
    empty.save(tmp_path / "empty.fpk")
    meta, arrays = _parts(tmp_path / "empty.fpk")
    meta["fields"][0][1]["shape"] = [10**6, 10**6]  # 10**12 elements per transition
    arrays["data/obs"] = np.zeros((0, 10**6, 10**6), dtype=np.float32)  # 0 bytes
    bad = tmp_path / "huge-field.fpk"
    bad.write_bytes(_build(meta, arrays))
    script = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import fastper
        try:
            fastper.load({str(bad)!r})
        except Exception as exc:
            print(type(exc).__name__)
        else:
            print("loaded")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "CheckpointError", out.stdout + out.stderr


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
        assert fastper.read_metadata(path, verify=True)["buffer"] == buf.kind
