"""Issue 10: max-priority policies, alpha granularity, scheme switching, priority
noise, the storage protocol and buffer states. One regression test per bug fixed,
named after it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

import fastper
from fastper.storage import Storage
from tests.oracles import assert_same_state, proportional_probs, rank_probs, snapshot

FIELDS = {"x": np.float32}
P_MIN = 1e-3


def _data(k: int, start: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.arange(start, start + k, dtype=np.float32)}


# ---------------------------------------------------------------------------
# max priority of new transitions (item 6)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls", [fastper.ReplayBuffer, fastper.PrioritizedReplayBuffer, fastper.RankBasedReplayBuffer]
)
def test_clip_was_ignored_by_the_initial_max_priority(cls):
    buf = cls(16, FIELDS, clip=0.1, eps=1e-6, seed=0)
    slots = buf.add(_data(4))
    np.testing.assert_array_equal(buf.priorities(slots), np.full(4, 0.1 + 1e-6))
    assert buf.max_priority == 0.1 + 1e-6 and buf.max_priority_ever == 1.0
    # an update can never exceed clip + eps, and new items never get more than that
    buf.update_priorities(slots[:1], [50.0])
    assert buf.add(_data(1)).size == 1 and buf.max_priority == 0.1 + 1e-6


def _newest_share(policy) -> float:
    """Share of draws that go to the newest 1% after one outlier TD error is corrected."""
    n = 10_000
    buf = fastper.PrioritizedReplayBuffer(n, FIELDS, alpha=1.0, max_priority=policy, seed=0)
    buf.add(_data(n - 100), priorities=np.ones(n - 100))
    buf.update_priorities([5], [1000.0])  # one outlier...
    buf.update_priorities([5], [1.0])  # ...corrected at once
    new = buf.add(_data(100, n))
    draws = np.concatenate([buf.sample(256).indices for _ in range(40)])
    return float(np.isin(draws, new).mean())


def test_one_corrected_outlier_sent_most_draws_to_the_newest_items():
    # "ever" (the paper's rule, the default) keeps 1000 for every new item: ~91% of the
    # mass sits on the newest 1% (100 x 1000 vs 9,900 x 1); "current" uses the largest
    # priority held now (1.0), so the newest 1% get ~1% of the draws.
    assert _newest_share("ever") > 0.85
    assert _newest_share("current") < 0.02
    assert _newest_share(2.0) == pytest.approx(200 / (9_900 + 200), abs=0.01)


def test_current_max_follows_what_the_buffer_holds():
    buf = fastper.PrioritizedReplayBuffer(4, FIELDS, max_priority="current", seed=0)
    assert buf.max_priority == 1.0  # empty: the paper's starting value
    buf.add(_data(4), priorities=[0.5, 9.0, 0.25, 2.0])
    assert buf.max_priority == 9.0
    buf.update_priorities([1], [3.0], keys=buf.keys([1]))
    assert buf.max_priority == pytest.approx(3.0 + 1e-6)
    buf.add(_data(2), priorities=[0.1, 0.1])  # overwrites slots 0, 1: 3.0 is gone
    assert buf.max_priority == 2.0
    slots = buf.add(_data(1))  # new item: the largest held, 2.0
    assert buf.priorities(slots).tolist() == [2.0]
    buf.clear()
    assert buf.max_priority == 1.0


def _assert_max_tree_whole(buf, clip=None, eps=1e-6) -> None:
    """The current-max tree is what a rebuild from the priorities gives, and the
    buffer's max is the largest valid priority held (1.0 when none), within the cap."""
    tree = buf._current_max
    inner = tree.inner.copy()
    tree.rebuild()
    np.testing.assert_array_equal(tree.inner, inner)
    everything = np.arange(len(buf))
    held = buf.priorities(everything)[buf.is_valid(everything)]
    expect = held.max() if held.size and held.max() > 0 else 1.0
    assert buf.max_priority == min(expect, (np.inf if clip is None else clip + eps))


KINDS_WITH_PRIORITIES = [
    fastper.PrioritizedReplayBuffer,
    fastper.RankBasedReplayBuffer,
    fastper.ReplayBuffer,
]


@pytest.mark.parametrize("cls", KINDS_WITH_PRIORITIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("capacity", [4, 23, 600])
@pytest.mark.parametrize("clip", [None, 2.0])
def test_current_max_gives_adds_in_runs_what_adds_one_at_a_time_get(cls, capacity, clip):
    # New slots' priorities wait in a run until the next call that reads the index;
    # the max tree takes them then (a proportional index keeps it in its own writes,
    # the others leave it to the buffer). A buffer whose runs are flushed after
    # every add (through a locked read) must end with the same priorities and max,
    # whatever the ring overwrote meanwhile (the max's own slot included).
    rng = np.random.default_rng(11 + capacity)
    kw = {"max_priority": "current", "clip": clip, "eps": 1e-6, "seed": 0}
    runs, one = cls(capacity, FIELDS, **kw), cls(capacity, FIELDS, **kw)
    if cls is fastper.PrioritizedReplayBuffer:
        assert runs._sampler.max_tree is runs._current_max  # kept by the index's writes
    longest = 0
    old_keys = None
    for round_ in range(120):
        for _ in range(int(rng.integers(1, 9))):
            k = int(rng.integers(1, 4))
            if rng.random() < 0.1:  # given priorities: written at once
                p = 10.0 ** rng.uniform(-3, 1, k)
                np.testing.assert_array_equal(
                    runs.add(_data(k), priorities=p), one.add(_data(k), priorities=p)
                )
            else:
                np.testing.assert_array_equal(runs.add(_data(k)), one.add(_data(k)))
            one.is_valid([0])  # a locked call: its run goes into the index now
            assert runs.max_priority == one.max_priority  # runs': read with its run pending
            longest = max(longest, runs._run_count)
        n = len(runs)
        idx = rng.integers(0, n, int(rng.integers(1, 6)))
        td = 10.0 ** rng.uniform(-3, 1, idx.shape[0])
        keys = runs.keys(idx)
        if old_keys is not None and rng.random() < 0.3:  # some of them stale by now
            keys[0] = old_keys[0]
        old_keys = keys
        assert runs.update_priorities(idx, td, keys=keys) == one.update_priorities(
            idx, td, keys=keys
        )
        if rng.random() < 0.2:
            slot = [int(rng.integers(0, n))]
            assert runs.invalidate(slot) == one.invalidate(slot)
        if round_ % 40 == 39 and cls is not fastper.ReplayBuffer:  # the other scheme, and back
            scheme = "rank" if runs.scheme == "proportional" else "proportional"
            runs.switch_scheme(scheme)
            one.switch_scheme(scheme)
        everything = np.arange(n)
        np.testing.assert_array_equal(runs.priorities(everything), one.priorities(everything))
        assert runs.max_priority == one.max_priority
        _assert_max_tree_whole(runs, clip)
    assert runs.stale_updates > 0
    assert longest >= min(8, capacity)  # the runs were runs (at most to the ring's end)


@pytest.mark.parametrize("cls", KINDS_WITH_PRIORITIES, ids=lambda c: c.__name__)
def test_current_max_counts_new_transitions_of_a_frame_buffer(cls):
    # A frame buffer writes new slots' priorities at once (frames invalidate
    # slots): the max tree must take them then, under every index.
    fields = {
        "obs": ((2,), np.uint8), "next_obs": ((2,), np.uint8), "action": ((), np.int64),
        "reward": ((), np.float32), "terminated": ((), np.bool_), "truncated": ((), np.bool_),
    }  # fmt: skip
    buf = cls(64, fields, frame_stack={"obs": 2}, frame_capacity=48, max_priority="current",
              seed=0)  # fmt: skip
    rng = np.random.default_rng(5)

    def step(t):
        return {"obs": np.full(2, t % 250, np.uint8), "next_obs": np.full(2, (t + 1) % 250, np.uint8),
                "action": 0, "reward": 0.0, "terminated": t % 17 == 16, "truncated": False}  # fmt: skip

    for t in range(8):
        buf.add(step(t))
    buf.update_priorities(np.arange(8), np.full(8, 10.0))
    for t in range(8, 20):  # new transitions at the max held: 10
        buf.add(step(t))
    buf.update_priorities(np.arange(8), np.full(8, 0.5))  # 10 is still held, by 8..19
    assert buf.max_priority == pytest.approx(10.0 + 1e-6)
    _assert_max_tree_whole(buf)
    for t in range(20, 300):  # the ring and the frame ring wrap, slots go invalid
        buf.add(step(t))
        if t % 7 == 0:
            idx = rng.integers(0, len(buf), 5)
            valid = idx[buf.is_valid(idx)]
            buf.update_priorities(valid, 10.0 ** rng.uniform(-2, 1, valid.shape[0]))
        if t % 13 == 0:
            _assert_max_tree_whole(buf)


def test_current_max_tree_stays_kept_through_a_checkpoint(tmp_path):
    buf = fastper.PrioritizedReplayBuffer(40, FIELDS, max_priority="current", seed=0)
    buf.add(_data(30), priorities=np.linspace(0.1, 3.0, 30))
    buf.save(tmp_path / "b.fpk")
    for back in (fastper.load(tmp_path / "b.fpk"), buf):
        if back is buf:
            buf.load_state_dict(buf.state_dict())
        assert back._sampler.max_tree is back._current_max
        assert back.max_priority == 3.0
        back.update_priorities([29], [0.5], keys=back.keys([29]))  # the max falls
        assert back.max_priority == pytest.approx(np.linspace(0.1, 3.0, 30)[28])
        back.add(_data(5))
        _assert_max_tree_whole(back)


def test_last_max_is_the_largest_of_the_latest_update():
    buf = fastper.PrioritizedReplayBuffer(
        6, FIELDS, eps=1e-6, clip=50.0, max_priority="last", seed=0
    )
    assert buf.max_priority == 1.0  # before any update: the paper's starting value
    buf.add(_data(4), priorities=[0.5, 9.0, 0.25, 2.0])  # given priorities are no update
    assert buf.max_priority == 1.0
    assert buf.priorities(buf.add(_data(1))).tolist() == [1.0]
    buf.update_priorities([0, 1], [3.0, 0.2], keys=buf.keys([0, 1]))
    assert buf.max_priority == pytest.approx(3.0 + 1e-6)
    buf.update_priorities([0], [0.1], keys=buf.keys([0]))  # falls: 9.0 held, 3.0 ever
    assert buf.max_priority == pytest.approx(0.1 + 1e-6)
    assert buf.max_priority_ever == pytest.approx(9.0)
    assert buf.priorities(buf.add(_data(1))).tolist() == [pytest.approx(0.1 + 1e-6)]
    buf.update_priorities([1], [1e6], keys=buf.keys([1]))  # clipped like every priority
    assert buf.max_priority == pytest.approx(50.0 + 1e-6)
    stale = buf.keys([2])
    buf.add(_data(3))  # overwrites slots 0-2 (ring): the update below is dropped whole
    assert buf.update_priorities([2], [7.0], keys=stale) == 0
    assert buf.max_priority == pytest.approx(50.0 + 1e-6)  # a dropped update changes nothing
    buf.update_priorities([3, 3], [6.0, 0.5], keys=buf.keys([3, 3]))  # duplicates: last wins
    assert buf.priorities([3]).tolist() == [pytest.approx(0.5 + 1e-6)]
    assert buf.max_priority == pytest.approx(6.0 + 1e-6)  # ...but the batch's max counts


def test_last_max_survives_a_checkpoint_and_old_files_load(tmp_path):
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, max_priority="last", seed=0)
    buf.add(_data(8))
    buf.update_priorities([3], [0.25], keys=buf.keys([3]))
    buf.save(tmp_path / "b.fpk")
    back = fastper.load(tmp_path / "b.fpk")
    assert back.max_priority == buf.max_priority == pytest.approx(0.25 + 1e-6)
    other = fastper.PrioritizedReplayBuffer(8, FIELDS, seed=0)  # "ever": state as before 0.5.4
    assert "max_priority_last" not in other.state_dict()["buffer"]
    state = buf.state_dict()
    del state["buffer"]["max_priority_last"]  # a state without it loads with 1.0
    old = fastper.PrioritizedReplayBuffer(8, FIELDS, max_priority="last", seed=0)
    old.load_state_dict(state)
    assert old.max_priority == 1.0
    old.update_priorities([2], [0.5], keys=old.keys([2]))
    before = snapshot(old)
    state["buffer"]["max_priority_last"] = 5.0  # above max_priority_ever (1.0): refused
    with pytest.raises(ValueError, match="max_priority_last=5.0 is above max_priority_ever"):
        old.load_state_dict(state)
    assert_same_state(snapshot(old), before)  # the refused load changed nothing
    assert old.max_priority == pytest.approx(0.5 + 1e-6)


def test_max_priority_policy_is_checked():
    with pytest.raises(ValueError, match="`max_priority` must be 'ever', 'current', 'last'"):
        fastper.PrioritizedReplayBuffer(4, FIELDS, max_priority="largest")
    with pytest.raises(ValueError, match=r"`max_priority` must be <= clip \+ eps"):
        fastper.PrioritizedReplayBuffer(4, FIELDS, max_priority=2.0, clip=1.0)
    with pytest.raises(ValueError, match="`max_priority` must be > 0"):
        fastper.PrioritizedReplayBuffer(4, FIELDS, max_priority=0.0)


# ---------------------------------------------------------------------------
# alpha schedules at a documented granularity (item 9)
# ---------------------------------------------------------------------------


def test_alpha_schedule_made_every_sample_cost_o_n():
    # every sample re-weighed all N priorities; now only every `alpha_every` samples,
    # and what is reported is exact for the alpha in force
    sched = fastper.schedules.linear(0.2, 1.0, 100)
    buf = fastper.PrioritizedReplayBuffer(64, FIELDS, alpha=sched, alpha_every=10, seed=0)
    p = np.geomspace(0.01, 10.0, 64)
    buf.add(_data(64), priorities=p)
    calls = []
    sampler_cls = type(buf._sampler)
    orig = sampler_cls.set_alpha

    def counting(self, alpha, n):
        calls.append(alpha)
        return orig(self, alpha, n)

    sampler_cls.set_alpha = counting
    try:
        for step in range(35):
            s = buf.sample(8)
            want_alpha = sched(step - step % 10)
            assert buf.alpha == pytest.approx(want_alpha)
            np.testing.assert_allclose(
                s.probabilities, proportional_probs(p, buf.alpha)[s.indices], rtol=1e-12
            )
    finally:
        sampler_cls.set_alpha = orig
    assert len(calls) == 3  # at steps 10, 20, 30
    # the default granularity: ceil(capacity / 256)
    assert fastper.PrioritizedReplayBuffer(5000, FIELDS).alpha_every == 20
    assert fastper.PrioritizedReplayBuffer(64, FIELDS).alpha_every == 1


# ---------------------------------------------------------------------------
# switching rank <-> proportional, priority noise (item 8)
# ---------------------------------------------------------------------------


def _freq_pvalue(buf, law, draws=30_000):
    idx = np.concatenate([buf.sample(100).indices for _ in range(draws // 100)])
    counts = np.bincount(idx, minlength=law.shape[0])
    return stats.chisquare(counts, law * counts.sum()).pvalue


def test_switch_from_rank_to_proportional_at_a_step_and_through_a_checkpoint(tmp_path):
    p = np.random.default_rng(1).uniform(0.1, 5.0, 20)
    buf = fastper.RankBasedReplayBuffer(20, FIELDS, alpha=0.7, seed=3, stratified=False)
    buf.add(_data(20), priorities=p)
    buf.switch_scheme("proportional", at_step=300, alpha=0.6)
    assert buf.scheme == "rank"
    np.testing.assert_allclose(buf.probabilities(np.arange(20)), rank_probs(p, 0.7), rtol=1e-12)
    buf.save(tmp_path / "before.fpk")
    assert _freq_pvalue(buf, rank_probs(p, 0.7)) > P_MIN  # 300 samples: still rank
    s = buf.sample(4)  # step 300: switched
    assert buf.scheme == "proportional" and buf.alpha == 0.6
    np.testing.assert_allclose(s.probabilities, proportional_probs(p, 0.6)[s.indices], rtol=1e-12)
    assert _freq_pvalue(buf, proportional_probs(p, 0.6)) > P_MIN
    np.testing.assert_array_equal(buf.priorities(np.arange(20)), p)  # same priorities and data
    # the pending switch survived the checkpoint: the loaded buffer switches at step 300 too
    loaded = fastper.load(tmp_path / "before.fpk")
    assert loaded.scheme == "rank"
    for _ in range(300):
        loaded.sample(100)
    loaded.sample(4)
    assert loaded.scheme == "proportional"
    # a switched buffer saves and loads as it is now, and can switch back
    buf.save(tmp_path / "after.fpk")
    back = fastper.load(tmp_path / "after.fpk")
    assert back.scheme == "proportional"
    assert back.sample(16).indices.tolist() == buf.sample(16).indices.tolist()
    back.switch_scheme("rank", segments=True)
    assert back.scheme == "rank" and back.sample(4).indices.size == 4


def test_switch_scheme_is_checked_and_refusals_change_nothing():
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, seed=0)
    buf.add(_data(8))
    before = snapshot(buf)
    with pytest.raises(ValueError, match="`scheme` must be one of"):
        buf.switch_scheme("uniform")
    with pytest.raises(ValueError, match="`sort_every` must be >= 1"):
        buf.switch_scheme("rank", sort_every=0)
    assert_same_state(before, snapshot(buf))
    with pytest.raises(ValueError, match="needs a prioritized buffer"):
        fastper.ReplayBuffer(4, FIELDS).switch_scheme("rank")


def test_priority_noise_multiplies_td_by_a_lognormal_factor():
    sigma = 0.5
    buf = fastper.PrioritizedReplayBuffer(4096, FIELDS, priority_noise=sigma, eps=0.0, seed=0)
    buf.add(_data(4096))
    td = np.full(4096, 2.0)
    buf.update_priorities(np.arange(4096), td)
    z = np.log(buf.priorities(np.arange(4096)) / 2.0) / sigma
    assert stats.kstest(z, "norm").pvalue > P_MIN
    # a refused update leaves the generator (and everything else) as it was
    before = snapshot(buf)
    with pytest.raises(ValueError):
        buf.update_priorities([0, 1], [1.0, np.nan])
    assert_same_state(before, snapshot(buf))
    # a schedule: no noise before step 10
    quiet = fastper.PrioritizedReplayBuffer(
        8, FIELDS, priority_noise=fastper.schedules.step([10], [0.0, 1.0]), eps=0.0, seed=0
    )
    quiet.add(_data(8))
    quiet.update_priorities(np.arange(8), np.full(8, 3.0))
    assert quiet.priorities(np.arange(8)).tolist() == [3.0] * 8


# ---------------------------------------------------------------------------
# storage protocol and states
# ---------------------------------------------------------------------------


class CountingStorage(Storage):
    """A storage that counts its gathers: plugs in through ``storage=``."""

    def __init__(self, fields, capacity):
        super().__init__(fields, capacity)
        self.gathered = 0

    def gather(self, indices):
        self.gathered += indices.shape[0]
        return super().gather(indices)


def test_a_storage_plugs_in_through_the_protocol():
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, storage=CountingStorage, seed=0)
    assert isinstance(buf.storage, CountingStorage)
    buf.add(_data(5))
    s = buf.sample(6)
    assert buf.storage.gathered == 6 and s.data["x"].shape == (6,)
    with pytest.raises(ValueError, match="`storage` must have capacity=8"):
        fastper.PrioritizedReplayBuffer(8, FIELDS, storage=Storage(FIELDS, 9))
    with pytest.raises(TypeError, match="`storage` must be a ReplayStorage"):
        fastper.PrioritizedReplayBuffer(8, FIELDS, storage=lambda f, c: object())


@pytest.mark.parametrize(
    "cls", [fastper.ReplayBuffer, fastper.PrioritizedReplayBuffer, fastper.RankBasedReplayBuffer]
)
def test_state_dict_round_trip_and_a_refused_state_changes_nothing(cls):
    buf = cls(16, FIELDS, seed=5)
    buf.add(_data(20 - 4))
    buf.add(_data(6, 100))  # wraps
    s = buf.sample(8)
    buf.update_priorities(s.indices, np.linspace(0.1, 2, 8), keys=s.keys)
    state = buf.state_dict()
    twin = fastper.from_state_dict(state)
    assert twin.sample(8).indices.tolist() == buf.sample(8).indices.tolist()
    other = cls(16, FIELDS, seed=1)
    other.add(_data(3))
    before = snapshot(other)
    bad = dict(state, writer=dict(state["writer"], cursor=3))  # inconsistent ring
    with pytest.raises(ValueError, match="inconsistent ring state"):
        other.load_state_dict(bad)
    assert_same_state(before, snapshot(other))
    with pytest.raises(ValueError, match="settings"):
        cls(32, FIELDS).load_state_dict(state)
    other.load_state_dict(buf.state_dict())
    assert other.sample(8).indices.tolist() == buf.sample(8).indices.tolist()
    assert math.isclose(other.priorities([0])[0], buf.priorities([0])[0])


@pytest.mark.parametrize("path", ["new", "v1_nstep.fpk"])
def test_inspect_prints_both_format_versions(tmp_path, capsys, path):
    from pathlib import Path

    from fastper.cli import main

    if path != "new":  # a frozen format-1 file (its array table keeps the old names)
        path = str(Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints" / path)
    else:
        buf = fastper.RankBasedReplayBuffer(8, FIELDS, seed=0)
        buf.add(_data(5))
        path = str(tmp_path / "i.fpk")
        buf.save(path)
    assert main(["inspect", path, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "checksum:     ok" in out and ("storage/columns/x" in out or "data/obs" in out)
    assert ("v2" in out and "5 stored" in out) or ("v1" in out and "16 stored" in out)


def test_refused_stream_information_leaves_the_buffer_unchanged():
    fields = {"obs": np.float32, "reward": np.float32, "next_obs": np.float32,
              "terminated": np.bool_, "truncated": np.bool_}  # fmt: skip
    rows = {"obs": np.zeros(3), "reward": np.ones(3), "next_obs": np.ones(3),
            "terminated": np.zeros(3, bool), "truncated": np.zeros(3, bool)}  # fmt: skip
    nstep = fastper.PrioritizedReplayBuffer(8, fields, n_step=3, seed=0)
    nstep.add(rows, env_ids=[0, 1, 0])
    plain = fastper.PrioritizedReplayBuffer(8, fields, seed=0)
    plain.add(rows)
    for buf, call, match in (
        (nstep, lambda b: b.add(rows), "needs stream information"),
        (plain, lambda b: b.add(rows, env_ids=[0, 1]), "`env_ids` must hold one integer per row"),
        (plain, lambda b: b.add(rows, env_ids=[0.5, 1.0, 2.0]), "`env_ids` must hold one integer"),
    ):
        before = snapshot(buf)
        with pytest.raises(ValueError, match=match):
            call(buf)
        assert_same_state(before, snapshot(buf))
    with pytest.raises(ValueError, match="`n_envs` must be <= 65536"):
        fastper.PrioritizedReplayBuffer(8, fields, n_step=3, n_envs=70_000)
