"""Edge cases RL code hits: capacity 1, capacities near 2^31, small dtypes, NaN, big batches.

Capacities near 2^31. A real buffer of 2^31 + 5 slots needs ~17 bytes of
index per slot (raw priority, sum-tree leaf, inner nodes): 36 GiB of address
space. Zeroed arrays are mapped lazily (calloc), so only the pages written are
resident; the min tree (filled with ``inf``) is left out (``weight_norm="batch"``)
and no full state is copied. The test builds a uniform buffer of 2^31 - 1
slots and a proportional one of 2^31 + 5 slots in a forked child, places the
ring's cursor a few slots before the end with a key counter past 2^32 (the
state after about 3 x 2^31 adds, which would take hours to reach by adding;
the unwritten slots keep priority 0), and checks that adds wrap, that
sampling, keys, stale-key detection and probabilities are exact there.
Measured: the child peaks at about 170 MiB resident (it used to take 21.7 GB
when the trees were filled eagerly and the test copied the whole state). It
is skipped without fork or with less than 1 GiB available.
The key arithmetic and the tree
layout are also checked directly at 2^31, 2^32 and 2^40 without allocating.
"""

from __future__ import annotations

import math
import multiprocessing
import os

import numpy as np
import pytest

import fastper
from fastper._kernels import ring as _ring
from fastper._kernels import tree as _tk

KINDS = {
    "uniform": lambda cap, fields, **kw: fastper.ReplayBuffer(cap, fields, **kw),
    "proportional": lambda cap, fields, **kw: fastper.PrioritizedReplayBuffer(cap, fields, **kw),
    "rank": lambda cap, fields, **kw: fastper.RankBasedReplayBuffer(cap, fields, **kw),
    "rank-segments": lambda cap, fields, **kw: fastper.RankBasedReplayBuffer(
        cap, fields, segments=True, **kw
    ),
}
FIELDS = {"id": ((), np.int64), "obs": ((2,), np.float32)}


def _tr(ids) -> dict[str, np.ndarray]:
    ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
    return {"id": ids, "obs": np.stack([ids, -ids], axis=1).astype(np.float32)}


# ---------------------------------------------------------------------------
# capacity 1
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_capacity_one(kind, tmp_path):
    buf = KINDS[kind](1, FIELDS, seed=0)
    with pytest.raises(fastper.EmptyBufferError):
        buf.sample(1)
    np.testing.assert_array_equal(buf.add({"id": 7, "obs": [7.0, -7.0]}), [0])
    s = buf.sample(5)
    assert s.indices.tolist() == [0] * 5 and s.keys.tolist() == [0] * 5
    assert s.data["id"].tolist() == [7] * 5
    np.testing.assert_array_equal(s.probabilities, np.ones(5))
    np.testing.assert_array_equal(s.weights, np.ones(5))
    assert buf.update_priorities(s.indices, [0.5] * 5, keys=s.keys) == 5  # last one wins
    assert buf.priorities([0])[0] == pytest.approx(0.5 + 1e-6)
    # a batch larger than the ring is refused, and changes nothing
    with pytest.raises(ValueError, match="capacity"):
        buf.add(_tr([8, 9]))
    assert buf.total_added == 1 and len(buf) == 1
    # each add replaces the only slot; a batch sampled before it goes stale
    buf.add(_tr([8]))
    assert buf.keys([0]).tolist() == [1]
    assert buf.update_priorities(s.indices, [3.0] * 5, keys=s.keys) == 0
    assert buf.stale_updates == 5
    buf.save(tmp_path / "one.fpk")
    loaded = fastper.load(tmp_path / "one.fpk")
    assert loaded.sample(3).data["id"].tolist() == [8] * 3
    assert loaded.sample(1).indices.tolist() == buf.sample(1).indices.tolist()
    buf.clear()
    with pytest.raises(fastper.EmptyBufferError):
        buf.sample(1)
    buf.add(_tr([10]))
    assert buf.keys([0]).tolist() == [2] and buf.sample(2).data["id"].tolist() == [10, 10]


@pytest.mark.parametrize("kind", ["uniform", "proportional", "rank"])
def test_capacity_one_with_n_step(kind):
    fields = {"obs": np.float32, "reward": np.float32, "next_obs": np.float32,
              "terminated": np.bool_}  # fmt: skip
    buf = KINDS[kind](1, fields, n_step=3, gamma=0.5, seed=0, nstep_keys={"truncated": None})
    steps = {"obs": np.arange(5.0), "reward": np.ones(5), "next_obs": np.arange(1.0, 6.0),
             "terminated": np.arange(5) == 4}  # fmt: skip
    with pytest.raises(ValueError, match="capacity"):
        buf.add(steps, env_ids=np.zeros(5, np.int64))  # would complete 5 transitions at once
    assert buf.n_pending == 0 and len(buf) == 0
    for j in range(5):
        buf.add({k: v[j] for k, v in steps.items()})
    assert len(buf) == 1 and buf.n_pending == 0 and buf.total_added == 5
    # only the last one (one step before the end) remains
    s = buf.sample(2)
    assert s.data["obs"].tolist() == [4.0, 4.0] and s.data["discount"].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------
# capacities near 2^31 and key counters past 2^32
# ---------------------------------------------------------------------------


def _ref_key(s: int, key_base: int, added: int, cap: int) -> int:
    """Key of slot s's occupant: the latest k < added - key_base with k % cap == s, + base."""
    since = added - key_base
    return key_base + s + cap * ((since - 1 - s) // cap)


@pytest.mark.parametrize("cap", [2**31 - 1, 2**31, 2**31 + 5, 2**32 + 7, 2**40 + 3])
def test_key_arithmetic_at_huge_capacities(cap):
    """slot_keys and the update kernel's stale-key check, with Python ints as reference."""
    slots = np.array([0, 1, 2, cap // 2, cap - 2, cap - 1], dtype=np.int64)
    for key_base, added in ((0, cap), (5, 3 * cap - 1), (2**33, 2**33 + 2 * cap + 17),
                            (2**61, 2**61 + 5 * cap), (0, 2**62)):  # fmt: skip
        out = np.empty(slots.shape[0], dtype=np.int64)
        _ring.slot_keys(slots, key_base, added, cap, out)
        want = [_ref_key(int(s), key_base, added, cap) for s in slots]
        assert out.tolist() == want
        assert all(key_base <= k < added for k in want)
        # the update kernel keeps current keys and drops stale ones (a ring behind)
        keys = np.array(want, dtype=np.int64)
        keys[::2] -= cap
        keys = np.maximum(keys, 0)
        td = np.linspace(0.5, 3.0, slots.shape[0])
        out_idx = np.empty_like(slots)
        out_p = np.empty(slots.shape[0])
        status = np.zeros(4, dtype=np.int64)
        _ring.td_priorities(slots, td, keys, True, 1e-6, np.inf, math.inf, cap, key_base,
                          added, cap, out_idx, out_p, status)  # fmt: skip
        assert status[0] == 0
        fresh = [j for j in range(slots.shape[0]) if keys[j] == want[j]]
        assert status[2] == len(fresh) and status[3] == slots.shape[0] - len(fresh)
        assert out_idx[: status[2]].tolist() == slots[fresh].tolist()


@pytest.mark.parametrize("cap", [2**31 - 1, 2**31 + 5, 2**32 + 7, 2**40])
def test_tree_layout_at_huge_capacities(cap):
    n_leaves, offs, depth = _tk.layout(cap)
    assert offs.dtype == np.int64 and n_leaves >= cap and n_leaves % 8 == 0
    width, total = n_leaves, 0
    for level in range(1, depth + 1):  # each level covers the one below, padded to 8
        assert offs[level] == total
        nodes = -(-width // 8)
        width = -(-nodes // 8) * 8 if nodes > 1 else 8
        total += width
    assert offs[depth + 1] == total and 8**depth >= cap


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss_reset() -> bool:
    try:  # Linux: "5" resets the peak resident set size (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _near_2_31_child(conn) -> None:  # runs in a forked child
    try:
        measured = _peak_rss_reset()
        # the pages the fork shares with the test process count from the start: only
        # the growth since is this test's own
        start = _peak_rss()
        fields = {"flag": ((), np.bool_)}
        for cap, cls in ((2**31 - 1, fastper.ReplayBuffer),
                         (2**31 + 5, fastper.PrioritizedReplayBuffer)):  # fmt: skip
            # weight_norm="batch": no min tree, whose inf fill would touch 2.3 GiB
            alpha = {} if cls is fastper.ReplayBuffer else {"alpha": 1.0}
            buf = cls(cap, fields, beta=1.0, seed=0, stratified=False, weight_norm="batch",
                      **alpha)  # fmt: skip
            # the state after 2 full rings and cap - 3 more adds: key counter ~3 * 2^31
            before = 3 * cap - 3
            buf._writer.load_state_dict(
                {"size": cap, "cursor": cap - 3, "total_added": before, "key_base": 0}
            )
            slots = buf.add({"flag": np.ones(5, dtype=bool)}, priorities=[1.0, 2.0, 3.0, 4.0, 5.0])
            assert slots.tolist() == [cap - 3, cap - 2, cap - 1, 0, 1], slots
            assert buf._writer.cursor == 2 and buf.total_added == before + 5
            want = {cap - 3: before, cap - 2: before + 1, cap - 1: before + 2,
                    0: before + 3, 1: before + 4}  # fmt: skip
            keys = buf.keys(list(want)).tolist()
            assert keys == list(want.values()) and keys[0] > 2**32, keys
            s = buf.sample(2000)
            assert s.indices.dtype == np.int64 and s.keys.dtype == np.int64
            assert s.keys.tolist() == [
                _ref_key(int(i), 0, buf.total_added, cap) for i in s.indices
            ]
            if cls is fastper.PrioritizedReplayBuffer:
                # the other slots have priority 0: only the five written are drawn
                assert set(s.indices.tolist()) == set(want)
                probs = buf.probabilities(list(want))
                np.testing.assert_allclose(probs, np.arange(1.0, 6.0) / 15.0, rtol=1e-12)
                counts = np.array([np.count_nonzero(s.indices == i) for i in want])
                assert (np.abs(counts - 2000 * probs) < 6 * np.sqrt(2000 * probs)).all()
                total = buf._sampler.tree.total
                assert math.isclose(total, 15.0, rel_tol=1e-12), total
            else:
                assert s.indices.min() >= 0 and s.indices.max() < cap
                assert s.indices.max() > 2**30  # the draws do cover the top half
            # a fresh update applies; the same keys after one more ring are stale
            sel = np.array([cap - 1, 0], dtype=np.int64)
            k = buf.keys(sel)
            assert buf.update_priorities(sel, [7.0, 8.0], keys=k) == 2
            assert buf.update_priorities(sel, [7.0, 8.0], keys=k - cap) == 0
            assert buf.stale_updates == 2
            del buf
        # regression: this test took 21.7 GB (eager tree fills, a full state copy)
        if measured:
            grown = _peak_rss() - start
            assert grown < 2**30, f"peak RSS grew by {grown / 2**20:.0f} MiB"
        conn.send("ok")
    except BaseException as exc:  # pragma: no cover - reported by the parent
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


@pytest.mark.skipif(
    not hasattr(os, "fork") or _mem_available() < 2**30,
    reason="needs fork and 1 GiB of available memory (about 170 MiB are touched)",
)
def test_buffers_of_capacity_near_2_31_wrap_and_key_exactly():
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_near_2_31_child, args=(child,))
    proc.start()
    child.close()
    result = parent.recv() if parent.poll(180) else "timed out"
    proc.join(30)
    if proc.exitcode is None:  # pragma: no cover
        proc.kill()
    assert result == "ok", result


# ---------------------------------------------------------------------------
# small dtypes, NaN
# ---------------------------------------------------------------------------


def test_uint8_float16_bool_and_extreme_integers_round_trip_exactly(tmp_path):
    fields = {
        "frame": ((3, 4), np.uint8),
        "half": ((3,), np.float16),
        "flag": ((), np.bool_),
        "i8": ((), np.int8),
        "u64": ((), np.uint64),
        "i64": ((), np.int64),
    }
    k = 6
    half = np.array(
        [[0.0, -0.0, 65504.0], [-65504.0, 6e-8, 2**-14], [np.inf, -np.inf, np.nan],
         [1 / 3, 0.1, 1e-4], [1.0, 2.0, 3.0], [np.float16(0.5), -1.5, 1024.0]],
        dtype=np.float16,
    )  # fmt: skip
    batch = {
        "frame": np.arange(k * 12).reshape(k, 3, 4).astype(np.uint8) * 5,  # wraps past 255
        "half": half,
        "flag": np.array([True, False, True, True, False, False]),
        "i8": np.array([-128, 127, 0, -1, 1, 5], dtype=np.int8),
        "u64": np.array([0, 2**64 - 1, 2**63, 1, 2, 3], dtype=np.uint64),
        "i64": np.array([-(2**63), 2**63 - 1, 0, -1, 1, 2], dtype=np.int64),
    }
    for name, cls in (("uniform", fastper.ReplayBuffer), ("rank", fastper.RankBasedReplayBuffer),
                      ("proportional", fastper.PrioritizedReplayBuffer)):  # fmt: skip
        buf = cls(8, fields, seed=0)
        buf.add(batch)
        path = tmp_path / f"{name}.fpk"
        buf.save(path)
        for b in (buf, fastper.load(path)):
            s = b.sample(64)
            for f, arr in batch.items():
                got = s.data[f]
                assert got.dtype == np.dtype(fields[f][1]), f
                assert got.tobytes() == arr[s.indices].tobytes(), f  # bit for bit, NaN too
    # values that would change are refused, not wrapped or rounded
    buf = fastper.ReplayBuffer(4, fields)
    one = {f: a[0] for f, a in batch.items()}
    for field, value in (("frame", np.full((3, 4), 256)), ("frame", np.full((3, 4), -1)),
                         ("flag", 2), ("flag", 0.5), ("i8", 128), ("half", np.full(3, 1e6)),
                         ("u64", -1)):  # fmt: skip
        with pytest.raises(fastper.FieldTypeError):
            buf.add({**one, field: value})
    assert len(buf) == 0
    # within range, wider types are cast: uint8 from int64, float16 from float64, bool from 0/1
    buf.add({**one, "frame": np.full((3, 4), 255, dtype=np.int64), "half": [0.25] * 3, "flag": 1})
    s = buf.sample(1)
    assert s.data["frame"].max() == 255 and s.data["half"][0, 0] == 0.25 and s.data["flag"][0]


def test_nan_and_inf_observations_are_stored_as_given(tmp_path):
    """Documented in ``add``: float fields are not checked, NaN payload bits survive."""
    fields = {"obs": ((4,), np.float32), "reward": ((), np.float64)}
    quiet = np.float32(np.nan)
    payload = np.array([0x7FC0DEAD], dtype=np.uint32).view(np.float32)[0]  # NaN with payload
    obs = np.array([[quiet, np.inf, -np.inf, -0.0], [payload, 1.0, np.nan, 2.0]], dtype=np.float32)
    reward = np.array([np.nan, -np.inf])
    for cls in (fastper.ReplayBuffer, fastper.PrioritizedReplayBuffer,
                fastper.RankBasedReplayBuffer):  # fmt: skip
        buf = cls(4, fields, seed=0, allow_nonfinite_rewards=True)
        buf.add({"obs": obs, "reward": reward})
        buf.add({"obs": obs.astype(np.float64)[0], "reward": np.float32(np.nan)})  # cast: NaN
        buf.save(tmp_path / "nan.fpk")
        for b in (buf, fastper.load(tmp_path / "nan.fpk")):
            stored = b.storage.columns["obs"][:2]
            assert stored.tobytes() == obs.tobytes()  # bit for bit, payload included
            assert np.isnan(b.storage.columns["obs"][2, 0])
            s = b.sample(16)
            assert np.isnan(s.data["reward"][s.indices == 0]).all()
            assert np.isfinite(s.weights).all() and np.isfinite(s.probabilities).all()
    # NaN is refused where it would be a bug: priorities, td errors, integer fields
    buf = fastper.PrioritizedReplayBuffer(4, {"obs": ((4,), np.float32), "a": np.int64})
    with pytest.raises(fastper.FieldTypeError):
        buf.add({"obs": obs[0], "a": np.nan})
    with pytest.raises(ValueError):
        buf.add({"obs": obs[0], "a": 1}, priorities=[np.nan])
    buf.add({"obs": obs[0], "a": 1})
    with pytest.raises(ValueError, match="finite"):
        buf.update_priorities([0], [np.nan])
    assert buf.priorities([0])[0] == 1.0


# ---------------------------------------------------------------------------
# batch larger than the buffer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("stratified", [True, False])
def test_batch_larger_than_the_buffer_samples_with_replacement(kind, stratified):
    buf = KINDS[kind](64, FIELDS, stratified=stratified, seed=1)
    buf.add(_tr([10, 11, 12]), priorities=[1.0, 2.0, 5.0])
    b = 3000  # > len, and > capacity
    s = buf.sample(b)
    assert len(s) == b and s.indices.dtype == np.int64
    assert set(s.indices.tolist()) == {0, 1, 2}
    np.testing.assert_array_equal(s.data["id"], 10 + s.indices)
    np.testing.assert_array_equal(s.keys, s.indices)
    assert np.isfinite(s.weights).all() and (s.weights > 0).all()
    probs = buf.probabilities([0, 1, 2])
    assert probs.sum() == pytest.approx(1.0)
    counts = np.bincount(s.indices, minlength=3)
    if stratified:
        # one draw per 1/b of the mass: each slot gets its share to within one or two
        assert (np.abs(counts - b * probs) <= 2).all(), (counts, b * probs)
    else:
        assert (np.abs(counts - b * probs) < 5 * np.sqrt(b * probs)).all(), (counts, b * probs)
    # the update of a batch with many duplicates: the last occurrence wins
    td = np.arange(b, dtype=np.float64)
    assert buf.update_priorities(s.indices, td, keys=s.keys) == b
    last = {int(i): td[j] for j, i in enumerate(s.indices)}
    for i, t in last.items():
        assert buf.priorities([i])[0] == pytest.approx(t + 1e-6)
