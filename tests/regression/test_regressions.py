"""One test per fixed bug, named after what went wrong."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import numpy as np
import pytest

import fastper
from fastper.checkpoint import _PREFIX, FORMAT_VERSION, MAGIC
from tests.oracles import assert_same_state, refusal_cost, snapshot


def test_float_just_past_int64_max_is_rejected_not_wrapped() -> None:
    # float(2**63 - 1) rounds up to 2**63, so a `hi > max` check let 2.0**63 through
    store = fastper.Storage({"x": np.int64}, 2)
    with pytest.raises(fastper.FieldTypeError, match="overflow"):
        store.prepare({"x": 2.0**63})
    ustore = fastper.Storage({"x": np.uint64}, 2)
    with pytest.raises(fastper.FieldTypeError, match="overflow"):
        ustore.prepare({"x": 2.0**64})
    buf = fastper.ReplayBuffer(2, {"x": np.int64})
    with pytest.raises(fastper.FieldTypeError, match="overflow"):
        buf.add({"x": 2.0**63})
    assert len(buf) == 0


def test_alpha_zero_never_samples_zero_priority() -> None:
    # 0.0 ** 0.0 == 1 made zero-priority slots sampleable at alpha = 0
    buf = fastper.PrioritizedReplayBuffer(4, {"x": np.float32}, alpha=0.0, eps=0.0, seed=0)
    buf.add({"x": np.zeros(3)}, priorities=[0.0, 1.0, 2.0])
    drawn = buf.sample(512).indices
    assert 0 not in drawn
    np.testing.assert_allclose(buf.probabilities([0, 1, 2]), [0.0, 0.5, 0.5])
    buf.update_priorities([1, 2], [0.0, 0.0])
    with pytest.raises(fastper.ZeroPriorityError):
        buf.sample(4)


def test_find_at_total_reaches_last_positive_leaf_across_levels() -> None:
    # the rounding clamp used to leave the target at ~0, so the levels below
    # went to their *first* child (returned 512 instead of 998 at capacity 1000)
    tree = fastper.SumTree(1000)
    rng = np.random.default_rng(0)
    values = rng.random(1000)
    values[999] = 0.0
    tree.set(np.arange(1000), values)
    for t in (tree.total, tree.total * (1 - 2**-52), tree.total * (1 - 4 * 2**-52)):
        assert tree.find(t) == 998


def test_leaves_cannot_overflow_the_total() -> None:
    tree = fastper.SumTree(2)
    with pytest.raises(ValueError, match="total stays finite"):
        tree.set([0, 1], [1e308, 1e308])
    assert tree.total == 0.0
    buf = fastper.PrioritizedReplayBuffer(8, {"x": np.float32}, alpha=1.0)
    buf.add({"x": np.zeros(2)})
    with pytest.raises(ValueError, match="stays finite"):
        buf.update_priorities([0], [1e308])
    buf.update_priorities([0], [1e200])
    with pytest.raises(ValueError, match="stays finite"):
        buf.set_alpha(2.0)  # 1e200**2 overflows
    assert buf.alpha == 1.0 and math.isfinite(buf._sampler.total)


def test_find_rejects_2d_targets() -> None:
    tree = fastper.SumTree(4)
    tree.set([0, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="scalar or 1-D"):
        tree.find([[0.0, 1.0], [0.5, 1.5]])


def test_negative_zero_is_stored_as_positive_zero() -> None:
    tree = fastper.SumTree(3)
    tree.set([1], [-0.0])
    assert math.copysign(1.0, tree.get([1])[0]) == 1.0


def _reframe(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw)) + raw
    body = head + hashlib.sha256(head).digest() + data
    return body + hashlib.sha256(body).digest()


def _split(blob: bytes) -> tuple[dict, bytes]:
    _, _, hlen = struct.unpack_from("<8sIQ", blob)
    start = _PREFIX.size
    header = json.loads(blob[start : start + hlen])
    return header, blob[start + hlen + 32 : -32]


def test_non_finite_number_in_header_is_a_checkpoint_error(tmp_path) -> None:
    # json accepts Infinity / NaN; int(inf) used to escape as OverflowError
    buf = fastper.PrioritizedReplayBuffer(8, {"x": np.float32}, seed=0)
    buf.add({"x": np.zeros(3)})
    path = tmp_path / "a.fpk"
    buf.save(path)
    header, data = _split(path.read_bytes())
    header["state"]["settings"]["capacity"] = float("inf")
    path.write_bytes(_reframe(header, data))
    with pytest.raises(fastper.CheckpointError, match="non-finite"):
        fastper.load(path)


def test_incomplete_rank_order_is_rejected(tmp_path) -> None:
    # format 1 stored the rank order: one missing slots (none marked changed) used to
    # load and never sample them. Format 2 stores no order (it is rebuilt from the
    # priorities); what it stores, the slots whose re-ranking is pending, is checked.
    buf = fastper.RankBasedReplayBuffer(8, {"x": np.float32}, seed=0, sort_every=100)
    buf.add({"x": np.zeros(8)}, priorities=np.arange(8.0, 0.0, -1.0))
    buf.sample(2)
    buf.update_priorities([6], [50.0])  # pending until the next sort
    path = tmp_path / "r.fpk"
    buf.save(path)
    header, data = _split(path.read_bytes())
    names = [a["name"] for a in header["arrays"]]
    assert not [n for n in names if "order" in n]
    table = {a["name"]: a for a in header["arrays"]}
    pend = table["sampler/pending_slots"]
    assert pend["shape"] == [1]
    forged = bytearray(data)
    forged[pend["offset"] : pend["offset"] + 8] = np.int64(8).tobytes()  # slot 8 of 8
    path.write_bytes(_reframe(header, bytes(forged)))
    with pytest.raises(fastper.CheckpointError, match="pending"):
        fastper.load(path)


# --- found by the reliability work (issue 5): threads, crashes, hostile files ----------


def _in_forked_child(fn) -> int | None:
    """Run ``fn`` in a forked child; its exit code (negative: killed by that signal)."""
    import multiprocessing

    proc = multiprocessing.get_context("fork").Process(target=fn)
    proc.start()
    proc.join(60)
    if proc.exitcode is None:  # hung (the old bug could corrupt memory into a hang)
        proc.kill()
        proc.join()
        return None
    return proc.exitcode


def _hammer_one_sum_tree() -> None:
    import threading

    tree = fastper.SumTree(2**16)

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(1500):
            tree.set(rng.integers(0, 2**16, 1024), rng.random(1024))

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    state = tree.state()
    tree.rebuild()
    assert np.array_equal(state, tree.state())  # no stale or torn internal node
    assert math.isclose(tree.total, math.fsum(tree.leaves().tolist()), rel_tol=1e-12)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_threads_sharing_a_sum_tree_wrote_out_of_bounds() -> None:
    # the kernels release the GIL and every call shared one scratch array: two
    # threads' set() mixed their node indices and wrote out of bounds (segfault)
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        assert _in_forked_child(_hammer_one_sum_tree) == 0
    finally:
        sys.setswitchinterval(old)


def test_temporary_files_of_killed_saves_piled_up(tmp_path) -> None:
    # a save killed outright (SIGKILL) left its random-named temporary file, and
    # nothing ever removed it: one more per crash
    buf = fastper.PrioritizedReplayBuffer(8, {"x": np.float32}, seed=0)
    buf.add({"x": np.zeros(3)})
    for i in range(5):  # what five killed saves leave (nobody holds their lock)
        (tmp_path / f".a.fpk.killed{i}.fpk.tmp").write_bytes(b"\x89FPCKPT\n partial")
    buf.save(tmp_path / "a.fpk")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.fpk"]


def test_header_of_empty_json_objects_took_gigabytes(tmp_path) -> None:
    # the header cap was 64 MiB and JSON of "{}," makes ~22x its size in Python
    # objects: one small file took 1.7 GiB and 10 s to refuse. Now 4 MiB -> < 100 MiB.
    from fastper.checkpoint import _MAX_HEADER

    def objects(size: int) -> bytes:
        return b'{"arrays": [], "x": [' + b"{}," * ((size - 40) // 3) + b"{}]}"

    # past the new cap (the old one parsed it: 420 MiB), and the worst case at the cap
    for body in (objects(16 * 2**20), objects(_MAX_HEADER)):
        bad = tmp_path / "objects.fpk"
        bad.write_bytes(_frame_raw(body))
        _, peak, seconds = refusal_cost(fastper.load, bad, fastper.CheckpointError)
        assert peak < 160 * 2**20, (len(body), peak)
        assert seconds < 20
    # one byte over the cap is refused before the header is read
    over = tmp_path / "over.fpk"
    over.write_bytes(_PREFIX.pack(MAGIC, 1, _MAX_HEADER + 1) + b" " * (_MAX_HEADER + 100))
    with pytest.raises(fastper.CheckpointError, match="exceeds the limit"):
        fastper.read_metadata(over)


def test_save_refuses_a_header_that_load_would_refuse(tmp_path, monkeypatch) -> None:
    from fastper import checkpoint

    buf = fastper.PrioritizedReplayBuffer(
        4, {"x": np.float32}, beta=fastper.schedules.step(list(range(1, 2001)), [0.5] * 2001)
    )
    buf.save(tmp_path / "ok.fpk")
    monkeypatch.setattr(checkpoint, "_MAX_HEADER", 16_000)  # the header is ~20 KB
    before = snapshot(buf)
    with pytest.raises(ValueError, match="header"):
        buf.save(tmp_path / "huge.fpk")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.fpk"]
    assert_same_state(before, snapshot(buf))


def _frame_raw(header: bytes, data: bytes = b"") -> bytes:
    head = _PREFIX.pack(MAGIC, 1, len(header)) + header
    body = head + hashlib.sha256(head).digest() + data
    return body + hashlib.sha256(body).digest()


@pytest.mark.parametrize("shape", [[0] * 40, [0, 2**70], [0, 2**62, 2**62], [2**64, 0]])
def test_zero_size_array_with_absurd_shape_escaped_as_plain_value_error(tmp_path, shape) -> None:
    # nbytes 0 matched the data section, then np.empty(shape) raised numpy's own
    # ValueError (too many dimensions / too big), and read_metadata accepted it
    buf = fastper.PrioritizedReplayBuffer(8, {"x": np.float32}, seed=0)
    path = tmp_path / "e.fpk"
    buf.save(path)
    header, data = _split(path.read_bytes())
    header["arrays"][0]["shape"] = shape
    path.write_bytes(_reframe(header, data))
    for reader in (fastper.load, fastper.read_metadata):
        with pytest.raises(fastper.CheckpointError, match="shape"):
            reader(path)


@pytest.mark.parametrize("added", [2**63 + 3, 2**64 + 3])
def test_key_counter_beyond_int64_loaded_then_every_sample_overflowed(tmp_path, added) -> None:
    buf = fastper.PrioritizedReplayBuffer(8, {"x": np.float32}, seed=0)
    buf.add({"x": np.zeros(3)})
    path = tmp_path / "k.fpk"
    buf.save(path)
    header, data = _split(path.read_bytes())
    header["state"]["writer"].update(total_added=added, key_base=added - 3)
    path.write_bytes(_reframe(header, data))
    with pytest.raises(fastper.CheckpointError, match="key counter"):
        fastper.load(path)
    # large counters that fit still work end to end
    header["state"]["writer"].update(total_added=2**40 + 3, key_base=2**40)
    path.write_bytes(_reframe(header, data))
    loaded = fastper.load(path)
    s = loaded.sample(4)
    assert set(s.keys.tolist()) <= {2**40, 2**40 + 1, 2**40 + 2}
    assert loaded.update_priorities(s.indices, np.ones(4), keys=s.keys) == 4


def test_huge_step_overflowed_linear_and_cosine_schedules(tmp_path) -> None:
    # step / steps with a huge int step raised OverflowError (int too large for a float)
    for sched in (fastper.schedules.linear(0.4, 1.0, 7), fastper.schedules.cosine(0.4, 1.0, 7)):
        assert sched(10**400) == 1.0 and sched(7) == 1.0
    buf = fastper.PrioritizedReplayBuffer(
        8, {"x": np.float32}, beta=fastper.schedules.linear(0.4, 1.0, 10), seed=0
    )
    buf.add({"x": np.zeros(3)})
    buf.step = 10**30
    assert buf.sample(2).weights.shape == (2,)
    path = tmp_path / "s.fpk"
    buf.save(path)
    assert fastper.load(path).sample(2).weights.shape == (2,)


def test_huge_n_step_overflowed_or_hung_the_nstep_writer() -> None:
    # pos + n - 1 overflowed int64 (n >= 2**63: OverflowError) and the return
    # loop ran n times per add (n = 2**62: a hang); a checkpoint can declare any n
    fields = {"obs": ((2,), np.float32), "reward": np.float32, "next_obs": ((2,), np.float32),
              "terminated": np.bool_}  # fmt: skip

    def steps(k, end):
        return {"obs": np.zeros((k, 2)), "reward": np.arange(1.0, k + 1.0),
                "next_obs": np.ones((k, 2)), "terminated": np.arange(k) == end}  # fmt: skip

    out = []
    for n in (1000, 2**62, 10**30):
        buf = fastper.ReplayBuffer(
            16, fields, n_step=n, gamma=0.5, seed=0, nstep_keys={"truncated": None}
        )
        assert buf.add(steps(4, -1), env_ids=[0] * 4).shape == (0,)  # windows not complete yet
        buf.add(steps(3, 2), env_ids=[0] * 3)  # the episode ends: all 7 are written
        assert len(buf) == 7 and buf.n_pending == 0
        out.append(buf.storage.columns["reward"][:7].copy())
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], out[2])


def test_nstep_episode_end_completing_more_than_capacity_was_refused() -> None:
    # an episode end flushes the pending window with the batch: a batch that fits
    # could complete more than `capacity` transitions, and add() refused it (with
    # capacity < n_step no episode end could ever be stored)
    fields = {"obs": np.float32, "reward": np.float32, "next_obs": np.float32,
              "terminated": np.bool_}  # fmt: skip
    stream = {"obs": np.arange(30.0), "reward": np.arange(30.0) % 7, "next_obs": np.arange(1.0, 31.0),
              "terminated": np.arange(30) % 10 == 9}  # fmt: skip

    def part(lo, hi):
        return {k: v[lo:hi] for k, v in stream.items()}

    for cap, n, cuts in ((8, 3, (0, 2, 10, 12, 20, 28, 30)), (1, 3, tuple(range(31))),
                         (2, 4, tuple(range(31)))):  # fmt: skip
        buf = fastper.PrioritizedReplayBuffer(
            cap, fields, n_step=n, gamma=0.5, seed=0, nstep_keys={"truncated": None}
        )
        twin = fastper.PrioritizedReplayBuffer(
            64, fields, n_step=n, gamma=0.5, seed=0, nstep_keys={"truncated": None}
        )
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            slots = buf.add(part(lo, hi), env_ids=np.zeros(hi - lo, np.int64))
            assert (slots < cap).all()
        twin.add(part(0, 30), env_ids=np.zeros(30, np.int64))
        assert buf.total_added == twin.total_added == 30 and buf.n_pending == 0
        # the ring holds the last `cap` of the transitions the big twin holds
        order = np.argsort(buf.keys(np.arange(cap)))
        for f in buf.fields:
            np.testing.assert_array_equal(
                buf.storage.columns[f][order], twin.storage.columns[f][30 - cap : 30]
            )


def test_load_mixed_the_size_of_one_file_with_the_bytes_of_another(tmp_path, monkeypatch) -> None:
    """A save renaming a new file over the path between load's stat and open."""
    import builtins

    import fastper.checkpoint as ckpt

    fields = {"x": ((3,), np.float32)}
    path, newer = tmp_path / "c.fpk", tmp_path / "newer.fpk"
    small = fastper.PrioritizedReplayBuffer(64, fields, seed=0)
    small.add({"x": np.ones((10, 3))})
    small.save(path)
    big = fastper.PrioritizedReplayBuffer(64, fields, seed=0)
    big.add({"x": np.ones((50, 3))})
    big.save(newer)
    real_open = builtins.open

    def open_after_a_rename(file, *args, **kwargs):
        if os.path.exists(newer):
            os.replace(newer, path)  # the concurrent save lands now
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(ckpt, "open", open_after_a_rename, raising=False)
    assert len(fastper.load(path)) == 50


@pytest.mark.parametrize("algo", ["dqn", "sac"])
def test_agent_sampled_an_empty_nstep_buffer_when_learning_started_at_once(algo) -> None:
    """With n_step > 1 nothing is stored for the first n - 1 steps of an episode."""
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    from fastper.agents import dqn, sac

    if algo == "dqn":
        cfg = dqn.DQNConfig(total_steps=6, learning_starts=0, train_freq=1, n_step=3,
                            batch_size=4, hidden=(8,))  # fmt: skip
        res = dqn.train(cfg, progress=False)
    else:
        cfg = sac.SACConfig(total_steps=6, learning_starts=0, n_step=3, batch_size=4,
                            hidden=(8,))  # fmt: skip
        res = sac.train(cfg, progress=False)
    assert res.steps == 6
