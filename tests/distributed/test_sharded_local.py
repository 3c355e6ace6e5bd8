"""Sharded replay without Ray: exact global sampling, routing, stale keys, losses, manifests."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from scipy import stats

import fastper
from fastper.distributed import (
    LocalTransport,
    Shard,
    ShardedReplayBuffer,
    ShardLostError,
    ShardLostWarning,
    rendezvous,
)

FIELDS = {"x": ((), np.float64), "tag": ((), np.int64)}


def rows(values: np.ndarray, tag: int) -> dict[str, np.ndarray]:
    return {"x": np.asarray(values, dtype=np.float64), "tag": np.full(len(values), tag)}


def sharded_and_single(prios: list[np.ndarray], *, seed: int = 7, **kw):
    """K full shards and one buffer holding the same items in shard order."""
    sizes = [len(p) for p in prios]
    shards = [
        Shard(fastper.PrioritizedReplayBuffer(n, FIELDS, alpha=1.0, eps=0.0, seed=s))
        for s, n in enumerate(sizes)
    ]
    single = fastper.PrioritizedReplayBuffer(
        sum(sizes), FIELDS, alpha=1.0, eps=0.0, seed=seed, **kw
    )
    start = 0
    for s, p in enumerate(prios):
        vals = np.arange(start, start + len(p), dtype=np.float64)
        shards[s].buffer.add(rows(vals, s), priorities=p)
        single.add(rows(vals, s), priorities=p)
        start += len(p)
    sharded = ShardedReplayBuffer(LocalTransport(shards), seed=seed, beta=0.7, **kw)
    return sharded, single


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
def test_integer_priorities_give_the_single_buffers_draws_and_weights(norm: str) -> None:
    rng = np.random.default_rng(0)
    prios = [rng.integers(1, 50, size=n).astype(float) for n in (37, 5, 120, 64)]
    sharded, single = sharded_and_single(prios, weight_norm=norm)
    offsets = np.cumsum([0] + [len(p) for p in prios])
    for _ in range(40):
        a, b = sharded.sample(64), single.sample(64, beta=0.7)
        np.testing.assert_array_equal(a.indices, b.indices)
        # keys count a shard's own inserts: here each item's slot in its shard
        shard = np.searchsorted(offsets, a.indices, side="right") - 1
        np.testing.assert_array_equal(a.keys, a.indices - offsets[shard])
        np.testing.assert_array_equal(a.data["x"], b.data["x"])
        np.testing.assert_allclose(a.probabilities, b.probabilities, rtol=1e-12)
        np.testing.assert_allclose(a.weights, b.weights, rtol=1e-12)
        td = rng.integers(1, 60, size=64).astype(float)  # integer priorities stay integer
        sharded.update_priorities(a.indices, td, a.keys)
        single.update_priorities(b.indices, td, keys=b.keys)
    sharded.flush()
    assert sharded.step == 40


def test_chi_square_over_shard_masses_1_10_100_and_per_shard_sampling_fails() -> None:
    # three shards of 4 items; shard masses 1 : 10 : 100
    prios = [np.array([0.1, 0.2, 0.3, 0.4]), np.array([1.0, 2.0, 3.0, 4.0]),
             np.array([10.0, 20.0, 30.0, 40.0])]  # fmt: skip
    sharded, _ = sharded_and_single(prios)
    p = np.concatenate(prios)
    expected_p = p / p.sum()
    counts = np.zeros(12)
    draws = 0
    for _ in range(250):
        batch = sharded.sample(4000)
        counts += np.bincount(batch.indices, minlength=12)
        np.testing.assert_allclose(batch.probabilities, expected_p[batch.indices], rtol=1e-12)
        draws += 4000
    assert draws >= 10**6
    assert stats.chisquare(counts, expected_p * draws).pvalue > 1e-3
    # negative control: a shard picked uniformly, then a draw within it (RLlib's way)
    rng = np.random.default_rng(1)
    shard = rng.integers(0, 3, size=draws)
    counts_rl = np.zeros(12)
    for s in range(3):
        n = int((shard == s).sum())
        within = prios[s] / prios[s].sum()
        counts_rl[4 * s : 4 * s + 4] += rng.multinomial(n, within)
    assert stats.chisquare(counts_rl, expected_p * draws).pvalue < 1e-12


def test_weights_use_the_global_size_and_smallest_probability() -> None:
    prios = [np.array([1.0, 4.0]), np.array([2.0, 8.0, 16.0])]
    sharded, _ = sharded_and_single(prios, weight_norm="none")
    b = sharded.sample(256)
    p_all = np.concatenate(prios) / 31.0
    np.testing.assert_allclose(b.weights, (5 * p_all[b.indices]) ** -0.7, rtol=1e-12)


def test_partly_filled_shards_map_global_indices_to_their_slots() -> None:
    s = ShardedReplayBuffer.local(3, 10, FIELDS, buffer_kwargs={"alpha": 1.0}, seed=0)
    for i in range(3):
        s.add(rows([float(i)] * (i + 2), i), shard=i)
    assert len(s) == 2 + 3 + 4 and s.capacity == 30
    b = s.sample(500)
    owner = b.indices // 10
    np.testing.assert_array_equal(b.data["tag"], owner)
    assert set(np.unique(b.indices % 10)) <= set(range(4))
    np.testing.assert_allclose(b.probabilities, 1.0 / 9.0)


def test_stale_updates_are_dropped_after_the_shard_overwrote_the_slot() -> None:
    s = ShardedReplayBuffer.local(2, 4, FIELDS, buffer_kwargs={"alpha": 1.0}, seed=0)
    s.add(rows(np.arange(4.0), 0), shard=0)
    s.add(rows(np.arange(4.0), 1), shard=1)
    b = s.sample(16)
    s.add(rows(np.arange(4.0, 8.0), 0), shard=0)  # shard 0 wraps: its slots hold new items
    sent = s.update_priorities(b.indices, np.full(16, 50.0), b.keys)
    assert sent == 16
    applied = s.update_priorities(b.indices, np.full(16, 50.0), b.keys, wait=True)
    on_1 = int((b.indices >= 4).sum())
    assert applied == on_1  # only shard 1's entries still name their transitions
    shard0 = s._t.shards[0]  # noqa: SLF001 - the test looks inside its own local shards
    np.testing.assert_array_equal(shard0.buffer.priorities(np.arange(4)), 1.0)
    assert shard0.stale_updates() == 2 * (16 - on_1)


def test_update_errors_name_the_problem_and_send_nothing() -> None:
    s = ShardedReplayBuffer.local(2, 4, FIELDS, seed=0)
    s.add(rows(np.arange(4.0), 0))
    with pytest.raises(ValueError, match="indices"):
        s.update_priorities([8], [1.0])
    with pytest.raises(ValueError, match="td_errors"):
        s.update_priorities([0], [np.nan])
    with pytest.raises(ValueError, match="keys"):
        s.update_priorities([0, 1], [1.0, 1.0], keys=[0])


def test_rendezvous_is_stable_and_moves_only_the_lost_shards_keys() -> None:
    keys = [f"actor-{i}" for i in range(2000)]
    before = {k: rendezvous(k, [0, 1, 2, 3]) for k in keys}
    assert before == {k: rendezvous(k, [0, 1, 2, 3]) for k in keys}  # no salted hash
    counts = np.bincount(list(before.values()), minlength=4)
    assert stats.chisquare(counts).pvalue > 1e-3
    after = {k: rendezvous(k, [0, 1, 3]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 2 for k in moved)
    assert all(after[k] == before[k] for k in keys if before[k] != 2)


def test_inserts_with_a_key_stay_on_one_shard() -> None:
    s = ShardedReplayBuffer.local(4, 100, FIELDS, seed=0)
    idx = np.concatenate([s.add(rows([1.0], 0), key="actor-7") for _ in range(10)])
    assert len(set((idx // 100).tolist())) == 1
    rr = np.concatenate([s.add(rows([1.0], 0)) for _ in range(8)])
    np.testing.assert_array_equal(np.bincount(rr // 100, minlength=4), [2, 2, 2, 2])


def make_three(policy: str) -> tuple[ShardedReplayBuffer, LocalTransport]:
    shards = [
        Shard(fastper.PrioritizedReplayBuffer(50, FIELDS, alpha=1.0, seed=i)) for i in range(3)
    ]
    t = LocalTransport(shards, loader=Shard.load)
    s = ShardedReplayBuffer(t, on_shard_loss=policy, seed=3)
    for i in range(3):
        s.add(rows(np.arange(10.0), i), shard=i)
    return s, t


def test_loss_policy_raise_leaves_everything_as_it_was() -> None:
    s, t = make_three("raise")
    s.sample(8)
    state = s._rng.bit_generator.state  # noqa: SLF001
    t.kill(1)
    with pytest.raises(ShardLostError, match="shard 1"):
        s.sample(64)
    assert s._rng.bit_generator.state == state and s.step == 1  # noqa: SLF001
    assert s.lost_shards == []


def test_loss_policy_continue_samples_exactly_over_the_survivors() -> None:
    s, t = make_three("continue")
    t.kill(1)
    with pytest.warns(ShardLostWarning, match="shard 1 was lost"):
        b = s.sample(3000)
    assert s.lost_shards == [1] and len(s) == 20
    owner = b.indices // 50
    assert set(owner.tolist()) == {0, 2}
    np.testing.assert_allclose(b.probabilities, 1.0 / 20.0)
    idx = s.add(rows([5.0], 9), key="somebody")  # routed to a survivor
    assert int(idx[0] // 50) in (0, 2)
    assert s.update_priorities(b.indices[:4], np.ones(4), b.keys[:4], wait=True) == 4


def test_loss_policy_restore_reloads_the_last_checkpoint(tmp_path) -> None:
    s, t = make_three("restore")
    s.save(tmp_path)
    s.add(rows(np.arange(5.0), 1), shard=1)  # not in the checkpoint
    t.kill(1)
    with pytest.warns(ShardLostWarning, match="restored"):
        b = s.sample(600)
    assert s.views()[1].size == 10  # the 5 added after the checkpoint are gone
    assert set((b.indices // 50).tolist()) == {0, 1, 2}
    s2, t2 = make_three("restore")
    t2.kill(0)
    with pytest.raises(ShardLostError, match="no checkpoint"):
        s2.sample(4)


def test_manifest_round_trip_continues_with_the_same_draws(tmp_path) -> None:
    s = ShardedReplayBuffer.local(3, 64, FIELDS, buffer_kwargs={"alpha": 0.6}, seed=11)
    rng = np.random.default_rng(0)
    for i in range(60):
        s.add(rows(rng.random(3), i), key=i)
    b = s.sample(32)
    s.update_priorities(b.indices, rng.random(32) * 5, b.keys, wait=True)
    manifest = s.save(tmp_path)
    m = json.loads(manifest.read_text())
    assert sorted(m["shards"]) == ["0", "1", "2"] and m["coordinator"]["step"] == 1
    back = ShardedReplayBuffer.load_local(tmp_path, seed=999)
    for _ in range(5):
        x, y = s.sample(32), back.sample(32)
        np.testing.assert_array_equal(x.indices, y.indices)
        np.testing.assert_allclose(x.weights, y.weights, rtol=0, atol=0)
        np.testing.assert_array_equal(x.data["x"], y.data["x"])
    # the checkpoint files are fastper's pickle-free format
    assert fastper.read_metadata(tmp_path / "shard-0.fpk")["state"]["kind"] == "proportional"


def test_bad_checkpoint_directories_are_named(tmp_path) -> None:
    from fastper import CheckpointError

    with pytest.raises(CheckpointError, match="no manifest.json"):
        ShardedReplayBuffer.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="readable manifest"):
        ShardedReplayBuffer.read_manifest(tmp_path)
    s = ShardedReplayBuffer.local(2, 8, FIELDS, seed=0)
    s.add(rows([1.0], 0))
    s.save(tmp_path)
    (tmp_path / "shard-1.fpk").unlink()
    with pytest.raises(CheckpointError, match="missing shard files"):
        ShardedReplayBuffer.read_manifest(tmp_path)
    # a missing folder is created, parents too; a file where the folder goes is named
    manifest = s.save(tmp_path / "new" / "ckpt")
    assert manifest == tmp_path / "new" / "ckpt" / "manifest.json" and manifest.is_file()
    assert ShardedReplayBuffer.read_manifest(tmp_path / "new" / "ckpt")["kind"] == "fastper.sharded"
    (tmp_path / "a-file").write_text("")
    with pytest.raises(FileExistsError, match="a-file.*which is a file"):
        s.save(tmp_path / "a-file")


def test_rank_based_shards_are_refused_and_mixed_shards_too() -> None:
    with pytest.raises(TypeError, match="rank-based"):
        Shard(fastper.RankBasedReplayBuffer(8, FIELDS))
    t = LocalTransport([Shard(fastper.ReplayBuffer(8, FIELDS)),
                        Shard(fastper.PrioritizedReplayBuffer(8, FIELDS))])  # fmt: skip
    with pytest.raises(ValueError, match="same fields and scheme"):
        ShardedReplayBuffer(t)


def test_empty_shards_raise_empty_buffer_and_leave_the_generator() -> None:
    s = ShardedReplayBuffer.local(2, 8, FIELDS, seed=0)
    with pytest.raises(fastper.EmptyBufferError):
        s.sample(4)
    assert s.step == 0


def test_uniform_shards_give_one_over_global_n() -> None:
    s = ShardedReplayBuffer.local(3, 20, FIELDS, uniform=True, seed=0)
    for i, n in enumerate((3, 7, 10)):
        s.add(rows(np.arange(float(n)), i), shard=i)
    b = s.sample(20_000)
    np.testing.assert_allclose(b.probabilities, 1.0 / 20)
    np.testing.assert_allclose(b.weights, 1.0)
    per_shard = np.bincount(b.indices // 20, minlength=3)
    assert stats.chisquare(per_shard, np.array([3, 7, 10]) / 20 * 20_000).pvalue > 1e-3


def test_concurrent_change_returns_the_probability_actually_used() -> None:
    s = ShardedReplayBuffer.local(2, 8, FIELDS, buffer_kwargs={"alpha": 1.0}, seed=0)
    s.add(rows(np.arange(4.0), 0), shard=0)
    s.add(rows(np.arange(4.0), 1), shard=1)
    s.refresh()
    # shard 1 changes behind the coordinator's back (an actor's insert)
    s._t.shards[1].buffer.add(rows(np.arange(4.0), 1), priorities=np.full(4, 3.0))  # noqa: SLF001
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = s.sample(4000)
    on1 = b.indices >= 8
    # shares drawn with the stale view (4 : 4), within shard 1 the current masses (1,1,1,1,3,3,3,3)
    np.testing.assert_allclose(b.probabilities[~on1], 0.5 / 4)
    cur = np.where(b.indices[on1] % 8 < 4, 1.0, 3.0) / 16.0
    np.testing.assert_allclose(b.probabilities[on1], 0.5 * cur, rtol=1e-12)
    assert s.views()[1].total == 16.0  # the reply brought the new view


def test_updates_sampled_before_a_restore_never_reach_items_added_after_it(tmp_path) -> None:
    s, t = make_three("restore")
    s.save(tmp_path)
    s.add(rows(np.arange(5.0), 1), shard=1)  # lost with the shard: keys 10..14 on shard 1
    old = s.sample(400)
    t.kill(1)
    with pytest.warns(ShardLostWarning, match="restored"):
        s.sample(8)
    new_idx = s.add(rows(np.arange(5.0), 7), shard=1)  # reuse keys 10..14 on shard 1
    on1 = old.indices // 50 == 1
    assert on1.any()
    applied = s.update_priorities(old.indices, np.full(400, 1000.0), old.keys, wait=True)
    assert applied == int((~on1).sum())  # every shard-1 entry dropped: an older generation
    assert s.stale_updates == int(on1.sum())
    shard1 = t.shards[1].buffer
    np.testing.assert_array_equal(shard1.priorities(new_idx - 50), shard1.max_priority_ever)
    fresh = s.sample(400)
    assert (fresh.keys[fresh.indices // 50 == 1] >> 40 == 1).all()
    assert s.update_priorities(fresh.indices, np.ones(400), fresh.keys, wait=True) == 400
