"""The n-step writer on its own: hand-made episodes, keys, autoreset, n = 1,
state round trips, and its errors. Interleaved streams against the per-stream
oracle: test_nstep_streams.py."""

from __future__ import annotations

import enum
import inspect
import json
from typing import Any

import numpy as np
import pytest

import fastper
from fastper.nstep import NStepPlan, NStepWriter, autoreset_mode
from fastper.storage import DirectRows, Storage, coerce_batch, make_fields
from tests.oracles import naive_nstep_streams

FIELDS = make_fields(
    {
        "obs": ((3,), np.float32),
        "action": ((), np.int64),
        "reward": ((), np.float32),
        "next_obs": ((3,), np.float32),
        "terminated": ((), np.bool_),
        "truncated": ((), np.bool_),
    }
)


def episode(rewards, terminated_at=None, truncated_at=None, start=0) -> dict[str, np.ndarray]:
    """One stream's rows; obs[t] = t, next_obs[t] = t + 0.5."""
    k = len(rewards)
    t = np.arange(start, start + k, dtype=np.float32)
    term = np.zeros(k, dtype=bool)
    trunc = np.zeros(k, dtype=bool)
    if terminated_at is not None:
        term[terminated_at] = True
    if truncated_at is not None:
        trunc[truncated_at] = True
    return {
        "obs": np.repeat(t[:, None], 3, axis=1),
        "action": np.arange(start, start + k, dtype=np.int64),
        "reward": np.asarray(rewards, dtype=np.float32),
        "next_obs": np.repeat(t[:, None] + 0.5, 3, axis=1),
        "terminated": term,
        "truncated": trunc,
    }


def row(rows: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    return {k: v[i] for k, v in rows.items()}


def add(writer: NStepWriter, transition: dict, env_ids: Any = None) -> NStepPlan:
    batch, k = coerce_batch(writer.fields, transition, None)
    plan = writer.prepare(batch, k, env_ids)
    writer.commit(plan)
    return plan


def add_stream(writer: NStepWriter, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add one stream's rows as one batch (env_ids all 0)."""
    k = len(rows["reward"])
    return add(writer, rows, np.zeros(k, dtype=np.int64)).out


def state_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- one stream, by hand


def test_nothing_comes_out_until_the_window_completes() -> None:
    writer = NStepWriter(FIELDS, 3, 0.5)
    ep = episode([1.0, 2.0, 4.0, 8.0])
    for i in range(2):
        plan = add(writer, row(ep, i))
        assert plan.count == 0 and plan.dropped == 0
        assert {k: v.shape[0] for k, v in plan.out.items()} == dict.fromkeys(plan.out, 0)
        assert writer.n_pending == i + 1
    out = add(writer, row(ep, 2)).out
    assert list(out) == list(writer.output_fields)
    assert out["reward"][0] == 1 + 0.5 * 2 + 0.25 * 4 and out["reward"].dtype == np.float32
    np.testing.assert_array_equal(out["obs"][0], [0, 0, 0])
    np.testing.assert_array_equal(out["action"], [0])
    np.testing.assert_array_equal(out["next_obs"][0], [2.5, 2.5, 2.5])
    assert out["discount"].dtype == np.float32 and out["discount"][0] == np.float32(0.125)
    assert writer.n_pending == 2
    out = add(writer, row(ep, 3)).out
    assert out["reward"][0] == 2 + 0.5 * 4 + 0.25 * 8
    np.testing.assert_array_equal(out["action"], [1])


def test_terminated_episode_flushes_partial_windows_without_bootstrap() -> None:
    writer = NStepWriter(FIELDS, 3, 0.5)
    ep = episode([1.0, 2.0], terminated_at=1)
    assert add(writer, row(ep, 0)).count == 0
    out = add(writer, row(ep, 1)).out
    assert writer.n_pending == 0
    np.testing.assert_array_equal(out["reward"], [1 + 0.5 * 2, 2])
    np.testing.assert_array_equal(out["discount"], [0.0, 0.0])
    np.testing.assert_array_equal(out["next_obs"][:, 0], [1.5, 1.5])
    np.testing.assert_array_equal(out["obs"][:, 0], [0, 1])  # oldest first
    np.testing.assert_array_equal(out["terminated"], [True, True])
    np.testing.assert_array_equal(out["truncated"], [False, False])
    # the next episode does not see the previous one's rewards
    out = add_stream(writer, episode([10.0, 20.0, 30.0], start=2))
    np.testing.assert_array_equal(out["reward"], [10 + 0.5 * 20 + 0.25 * 30])
    np.testing.assert_array_equal(out["discount"], [0.125])


def test_truncated_episode_bootstraps() -> None:
    writer = NStepWriter(FIELDS, 4, 0.9)
    out = add_stream(writer, episode([1.0, 1.0, 1.0], truncated_at=2))
    np.testing.assert_allclose(out["reward"], [1 + 0.9 + 0.81, 1 + 0.9, 1], rtol=1e-7)
    np.testing.assert_array_equal(out["discount"], np.float32([0.9**3, 0.9**2, 0.9]))
    np.testing.assert_array_equal(out["next_obs"][:, 0], [2.5, 2.5, 2.5])
    np.testing.assert_array_equal(out["truncated"], [True, True, True])
    assert writer.n_pending == 0


def test_terminated_and_truncated_together_is_terminal() -> None:
    writer = NStepWriter(FIELDS, 2, 0.9)
    out = add_stream(writer, episode([1.0, 2.0], terminated_at=1, truncated_at=1))
    np.testing.assert_array_equal(out["discount"], [0.0, 0.0])


def test_batch_of_one_stream_equals_rows_one_by_one() -> None:
    rng = np.random.default_rng(0)
    k = 200
    u = rng.random(k)
    ep = episode(rng.normal(size=k), start=0)
    ep["terminated"], ep["truncated"] = u < 0.05, (u >= 0.05) & (u < 0.1)
    one, chunks = NStepWriter(FIELDS, 4, 0.97), NStepWriter(FIELDS, 4, 0.97)
    want = [add(one, row(ep, i)).out for i in range(k)]
    cuts = [0, *np.sort(rng.choice(np.arange(1, k), 20, replace=False)), k]
    got = [
        add_stream(chunks, {f: v[a:b] for f, v in ep.items()})
        for a, b in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    for name in one.output_fields:
        np.testing.assert_array_equal(
            np.concatenate([o[name] for o in got]), np.concatenate([o[name] for o in want])
        )
    assert state_equal(one.state_dict(), chunks.state_dict())


def test_float64_rewards_are_summed_in_order_in_float64() -> None:
    fields = make_fields({**FIELDS, "reward": ((), np.float64)})
    writer = NStepWriter(fields, 5, 0.99)
    rewards = [0.1, 1e16, -1e16, 0.3, 1 / 3]
    out = add_stream(writer, {**episode(rewards), "reward": np.array(rewards)})
    acc = 0.0
    for j, r in enumerate(rewards):
        acc += 0.99**j * r
    assert out["reward"].dtype == np.float64 and out["reward"][0] == acc


def test_vector_reward_field_sums_each_entry() -> None:
    fields = make_fields({**FIELDS, "reward": ((2,), np.float32)})
    writer = NStepWriter(fields, 2, 0.5)
    ep = {**episode([0, 0, 0], terminated_at=2), "reward": np.float32([[1, 10], [2, 20], [4, 40]])}
    out = add_stream(writer, ep)
    np.testing.assert_array_equal(out["reward"], [[2, 20], [4, 40], [4, 40]])
    np.testing.assert_array_equal(out["discount"], np.float32([0.25, 0.0, 0.0]))


def test_multi_dim_flags_end_when_any_entry_is_set() -> None:
    fields = make_fields({**FIELDS, "terminated": ((2,), np.bool_)})
    writer = NStepWriter(fields, 3, 0.5)
    ep = {**episode([1, 2, 3]), "terminated": np.array([[0, 0], [0, 1], [0, 0]], dtype=bool)}
    out = add_stream(writer, ep)
    assert out["reward"].shape == (2,) and writer.n_pending == 1
    np.testing.assert_array_equal(out["discount"], [0.0, 0.0])


def test_done_field_counts_as_termination() -> None:
    fields = make_fields({**{k: v for k, v in FIELDS.items() if k not in ("terminated", "truncated")},
                          "done": ((), np.float32)})  # fmt: skip
    writer = NStepWriter(fields, 3, 0.5, truncated_key=None)
    assert writer.terminated_key == "done" and writer.truncated_key is None
    ep = {k: v for k, v in episode([1, 2, 3, 4, 5]).items() if k in fields}
    ep["done"] = np.float32([0, 1, 0, 0, 0])
    out = add_stream(writer, ep)
    np.testing.assert_array_equal(out["reward"], [1 + 0.5 * 2, 2, 3 + 0.5 * 4 + 0.25 * 5])
    np.testing.assert_array_equal(out["discount"], [0.0, 0.0, 0.125])
    np.testing.assert_array_equal(out["done"], [1, 1, 0])
    assert writer.n_pending == 2


def test_explicit_keys() -> None:
    fields = make_fields(
        {"o": ((2,), np.float32), "r": ((), np.float64), "o2": ((2,), np.float32), "end": np.bool_}
    )
    writer = NStepWriter(
        fields, 2, 0.5, reward_key="r", next_obs_key="o2", terminated_key="end", truncated_key=None
    )
    out = add(
        writer,
        {
            "o": np.zeros((3, 2)),
            "r": [1.0, 2.0, 4.0],
            "o2": [[1, 1], [2, 2], [3, 3]],
            "end": [False, False, True],
        },  # fmt: skip
        [0, 0, 0],
    ).out
    np.testing.assert_array_equal(out["r"], [2.0, 4.0, 4.0])
    np.testing.assert_array_equal(out["discount"], [0.25, 0.0, 0.0])
    np.testing.assert_array_equal(out["o2"][:, 0], [2, 3, 3])


@pytest.mark.parametrize("n", [1000, 2**62, 10**30])
def test_huge_n_costs_only_what_is_pending(n) -> None:
    """A checkpoint can declare any n: the rings grow with the pending windows."""
    writer = NStepWriter(FIELDS, n, 0.5)
    assert add_stream(writer, episode(np.arange(1.0, 41.0)))["reward"].shape == (0,)
    assert writer.n_pending == 40
    out = add_stream(writer, episode([41.0, 42.0, 43.0], terminated_at=2))
    assert out["reward"].shape == (43,) and writer.n_pending == 0
    acc = 0.0
    for j, r in enumerate(range(1, 44)):
        acc += 0.5**j * r
    assert out["reward"][0] == np.float32(acc)
    assert writer._w <= 2 * 43  # ring rows per stream: about the longest window, not n


# --------------------------------------------------------------------------- autoreset, n = 1


def test_autoreset_next_step_drops_the_row_after_an_end() -> None:
    writer = NStepWriter(FIELDS, 2, 0.5, autoreset="next_step")
    ep = episode([1, 2, 99, 3, 4], terminated_at=1)  # row 2: the reset step, not a transition
    outs = [add(writer, row(ep, i)) for i in range(5)]
    assert [p.count for p in outs] == [0, 2, 0, 0, 1]
    assert [p.dropped for p in outs] == [0, 0, 1, 0, 0]
    assert writer.dropped == 1 and writer.n_pending == 1
    np.testing.assert_array_equal(outs[4].out["reward"], [3 + 0.5 * 4])
    np.testing.assert_array_equal(outs[4].out["obs"][:, 0], [3])
    # the same rows as one batch, and a truncation also ends the episode
    twin = NStepWriter(FIELDS, 2, 0.5, autoreset="next_step")
    out = add_stream(twin, ep)
    np.testing.assert_array_equal(out["reward"], [2, 2, 3 + 0.5 * 4])
    assert twin.dropped == 1
    ep = episode([1, 99, 2], truncated_at=0)
    assert add_stream(NStepWriter(FIELDS, 3, 0.5, autoreset="next_step"), ep)[
        "reward"
    ].tolist() == [1]


def test_autoreset_drops_per_stream_in_a_vector_step() -> None:
    writer = NStepWriter(FIELDS, 2, 0.5, n_envs=2, autoreset="next_step")
    a, b = episode([1, 99, 2, 3], terminated_at=0), episode([10, 20, 30, 40], start=100)
    plans = [add(writer, {k: np.stack([a[k][t], b[k][t]]) for k in a}) for t in range(4)]
    assert [p.dropped for p in plans] == [0, 1, 0, 0] and writer.dropped == 1
    np.testing.assert_array_equal(plans[1].out["reward"], [10 + 0.5 * 20])
    np.testing.assert_array_equal(plans[3].out["reward"], [2 + 0.5 * 3, 30 + 0.5 * 40])


def test_n_one_emits_every_row_at_once() -> None:
    ep = episode([1, 2, 3, 4], terminated_at=1)
    writer = NStepWriter(FIELDS, 1, 0.9)
    out = add(writer, ep).out  # no stream information needed: nothing is pending
    np.testing.assert_array_equal(out["reward"], [1, 2, 3, 4])
    np.testing.assert_array_equal(out["next_obs"], ep["next_obs"])
    np.testing.assert_array_equal(out["discount"], np.float32([0.9, 0, 0.9, 0.9]))
    assert writer.n_pending == 0 and writer.n_streams == 0
    plain = NStepWriter(FIELDS, 1, 0.9, discount_field=False)
    assert plain.output_fields == FIELDS and list(add(plain, ep).out) == list(FIELDS)


def test_n_one_with_autoreset_drops_rows() -> None:
    writer = NStepWriter(FIELDS, 1, 0.9, autoreset="next_step", discount_field=False)
    ep = episode([1, 2, 99, 4], truncated_at=1)
    assert [add(writer, row(ep, i), 7).count for i in range(4)] == [1, 1, 0, 1]
    assert writer.dropped == 1 and writer.n_pending == 0 and writer.n_streams == 1
    out = add(NStepWriter(FIELDS, 1, 0.9, autoreset="next_step"), ep, [7] * 4).out
    np.testing.assert_array_equal(out["reward"], [1, 2, 4])
    np.testing.assert_array_equal(out["discount"], np.float32([0.9, 0.9, 0.9]))


class _Mode(enum.Enum):  # the shape of gymnasium.vector.AutoresetMode
    NEXT_STEP = "NextStep"
    SAME_STEP = "SameStep"
    DISABLED = "Disabled"


class _Env:
    def __init__(self, metadata: Any) -> None:
        self.metadata = metadata


def test_autoreset_mode_reads_a_vector_env() -> None:
    assert autoreset_mode(_Env({"autoreset_mode": _Mode.NEXT_STEP})) == "next_step"
    assert autoreset_mode(_Env({"autoreset_mode": _Mode.DISABLED})) is None
    with pytest.raises(ValueError, match=r"SAME_STEP is not supported.*infos\['final_obs'\]"):
        autoreset_mode(_Env({"autoreset_mode": _Mode.SAME_STEP}))
    with pytest.raises(ValueError, match="no 'autoreset_mode'.*autoreset='next_step'"):
        autoreset_mode(_Env({}))
    with pytest.raises(ValueError, match="must be NEXT_STEP, SAME_STEP or DISABLED"):
        autoreset_mode(_Env({"autoreset_mode": "sometimes"}))


def test_autoreset_mode_of_a_gymnasium_vector_env() -> None:
    gym = pytest.importorskip("gymnasium")
    mode = getattr(gym.vector, "AutoresetMode", None)
    if mode is None:
        pytest.skip("gymnasium without AutoresetMode")
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    assert autoreset_mode(envs) == "next_step"
    envs.close()
    same = gym.make_vec(
        "CartPole-v1", num_envs=2, vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": mode.SAME_STEP},
    )  # fmt: skip
    with pytest.raises(ValueError, match="SAME_STEP is not supported"):
        autoreset_mode(same)
    same.close()


def test_same_step_autoreset_is_refused() -> None:
    for value in ("same_step", "SameStep", _Mode.SAME_STEP):
        with pytest.raises(ValueError, match="SAME_STEP is not supported.*autoreset=None"):
            NStepWriter(FIELDS, 3, 0.9, autoreset=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`autoreset` must be None or 'next_step'"):
        NStepWriter(FIELDS, 3, 0.9, autoreset="always")


# --------------------------------------------------------------------------- configuration


def test_nstep_requires_truncation_field_or_explicit_none() -> None:
    """Issue: without a truncation field a time-limit cut ran on into the next episode."""
    no_trunc = {k: v for k, v in FIELDS.items() if k != "truncated"}
    with pytest.raises(ValueError, match=r"no truncation field.*pass truncated_key=None if"):
        NStepWriter(no_trunc, 3, 0.9)
    # a buffer's message names its own argument, nstep_keys
    with pytest.raises(
        ValueError, match=r"no truncation field.*pass nstep_keys=\{'truncated': None\} if"
    ):
        fastper.PrioritizedReplayBuffer(8, no_trunc, n_step=3)
    with pytest.raises(ValueError, match="autoreset='next_step' must know where episodes end"):
        NStepWriter(no_trunc, 1, 0.9, autoreset="next_step")
    writer = NStepWriter(no_trunc, 3, 0.9, truncated_key=None)  # said explicitly: fine
    assert writer.truncated_key is None and writer.settings()["truncated_key"] is None
    no_term = {k: v for k, v in FIELDS.items() if k != "terminated"}
    with pytest.raises(ValueError, match=r"no termination field.*terminated_key=None"):
        NStepWriter(no_term, 3, 0.9)
    assert NStepWriter(no_term, 3, 0.9, terminated_key=None).terminated_key is None
    # a 1-step pass-through without discount needs neither
    bare = {k: v for k, v in no_term.items() if k != "truncated"}
    assert NStepWriter(bare, 1, 0.9, discount_field=False).terminated_key is None


@pytest.mark.parametrize(
    ("fields", "kwargs", "exc", "match"),
    [
        ({k: v for k, v in FIELDS.items() if k != "reward"}, {}, ValueError, "reward field"),
        ({k: v for k, v in FIELDS.items() if k != "next_obs"}, {}, ValueError, "next observation"),
        ({**FIELDS, "reward": ((), np.int64)}, {}, ValueError, "floating reward field"),
        ({**FIELDS, "discount": ((), np.float32)}, {}, ValueError, "reserved"),
        (FIELDS, {"n": 0}, ValueError, "`n_step` must be >= 1"),
        (FIELDS, {"n": 2.0}, TypeError, "`n_step` must be an integer"),
        (FIELDS, {"gamma": 1.01}, ValueError, "`gamma` must be <= 1"),
        (FIELDS, {"gamma": -0.1}, ValueError, "`gamma` must be >= 0"),
        (FIELDS, {"terminated_key": "nope"}, ValueError, "`terminated_key` must name one of the fields .* got .nope."),
        (FIELDS, {"truncated_key": 3}, TypeError, "`truncated_key` must be a field name or None"),
        (FIELDS, {"truncated_key": "terminated"}, ValueError, "fields must differ"),
        (FIELDS, {"n_envs": 0}, ValueError, "`n_envs` must be >= 1"),
        (FIELDS, {"discount_field": False}, ValueError, "`discount_field` must be True"),
        (FIELDS, {"discount_field": 1}, TypeError, "`discount_field` must be a bool"),
    ],
)
def test_bad_config(fields, kwargs, exc, match) -> None:
    kw = {"n": 3, "gamma": 0.9, **kwargs}
    with pytest.raises(exc, match=match):
        NStepWriter(make_fields(fields), **kw)


def test_settings_rebuild_the_writer() -> None:
    writer = NStepWriter(FIELDS, 3, 0.9, n_envs=2, autoreset="next_step")
    settings = writer.settings()
    assert json.loads(json.dumps(settings)) == settings
    twin = NStepWriter(FIELDS, **settings)
    assert twin.settings() == settings and twin.output_fields == writer.output_fields


# --------------------------------------------------------------------------- two phases


def test_prepare_changes_nothing_and_stale_plans_are_refused() -> None:
    writer = NStepWriter(FIELDS, 3, 0.5)
    ep = episode([1, 2, 3, 4, 5], terminated_at=4)
    add(writer, row(ep, 0), 5)
    add(writer, row(ep, 1), 5)
    before = writer.state_dict()
    batch, k = coerce_batch(FIELDS, {f: v[2:] for f, v in ep.items()}, None)
    for env_ids in ([5, 5, 5], [5, 6, 5], [1_000_017] * 3):  # known, new, growing streams
        p1 = writer.prepare(batch, k, env_ids)
        p2 = writer.prepare(batch, k, env_ids)
        assert state_equal(writer.state_dict(), before) and writer.n_streams == 1
        assert p1.count == p2.count and all(np.array_equal(p1.out[f], p2.out[f]) for f in p1.out)
    plan = writer.prepare(batch, k, [5, 5, 5])
    other = writer.prepare(batch, k, [5, 5, 5])
    writer.commit(plan)
    with pytest.raises(RuntimeError, match="stale"):
        writer.commit(other)
    assert writer.n_pending == 0 and plan.count == 5


@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_a_copied_writer_steps_its_own_windows(copy_of: str) -> None:
    """The one-row step is code specialised to a writer's arrays: a copy gets its own,
    so a step of the copy changes the copy only, as a step of the original would."""
    import copy
    import pickle

    writer = NStepWriter(FIELDS, 3, 0.5)
    ep = episode([1, 2, 3, 4, 5])
    for i in range(3):
        add(writer, row(ep, i))  # the window is complete from the third step on
    # a writer in use: its own step made (the copy must not take it)
    assert writer.step_function(DirectRows(writer.fields, 8), Storage(writer.output_fields, 8).direct_rows())
    twin = copy.deepcopy(writer) if copy_of == "deepcopy" else pickle.loads(pickle.dumps(writer))
    before = writer.state_dict()
    storage = Storage(writer.output_fields, 8)
    step = twin.step_function(DirectRows(twin.fields, 8), storage.direct_rows())
    assert step is not None
    assert step(twin, row(ep, 3), None, True, 5) == 1  # one transition, stored at slot 5
    assert state_equal(writer.state_dict(), before)  # the original is untouched
    plan = add(writer, row(ep, 3))  # the original, stepped by the general path
    assert state_equal(twin.state_dict(), writer.state_dict())
    assert len(plan.out) == 7 and plan.count == 1
    for f, column in storage.columns.items():
        assert np.array_equal(column[5], plan.out[f][0]), f
        assert not np.delete(column, 5, axis=0).any(), f  # nothing else written


def test_clear_drops_windows_but_keeps_streams_and_their_autoreset_state() -> None:
    writer = NStepWriter(FIELDS, 3, 0.5, autoreset="next_step")
    add(writer, episode([1, 2], terminated_at=1), [4, 4])  # stream 4 ended: next row is a reset
    add(writer, episode([1, 2]), [9, 9])
    assert writer.n_pending == 2
    writer.clear()
    assert writer.n_pending == 0 and writer.n_streams == 2
    assert add(writer, row(episode([7]), 0), 4).dropped == 1  # still the reset row
    assert add(writer, row(episode([7]), 0), 9).count == 0


# --------------------------------------------------------------------------- state


def mid_run_writer(**kwargs: Any) -> tuple[NStepWriter, list[tuple[dict, Any]]]:
    """A writer with several streams mid-episode, and the adds that follow."""
    rng = np.random.default_rng(3)
    writer = NStepWriter(FIELDS, 4, 0.9, **kwargs)
    n_envs = kwargs.get("n_envs")
    adds = []
    for t in range(40):
        k = n_envs or int(rng.integers(1, 6))
        u = rng.random(k)
        step = {**episode(rng.normal(size=k), start=t * 10), "terminated": u < 0.1,
                "truncated": (u >= 0.1) & (u < 0.2)}  # fmt: skip
        adds.append((step, None if n_envs else rng.integers(0, 3, size=k) * 1_000_003))
    for step, ids in adds[:20]:
        add(writer, step, ids)
    return writer, adds[20:]


@pytest.mark.parametrize("kwargs", [{}, {"n_envs": 3}, {"autoreset": "next_step"}])
def test_state_round_trip_mid_episode_gives_identical_output(kwargs) -> None:
    writer, rest = mid_run_writer(**kwargs)
    state = writer.state_dict()
    assert writer.n_pending > 0 and int(state["lengths"].sum()) == writer.n_pending
    json.dumps({k: v for k, v in state.items() if not isinstance(v, np.ndarray)})
    assert all(not isinstance(v, dict | list) for v in state.values())
    assert "pending/next_obs" not in state and state["pending/obs"].shape[0] == writer.n_pending
    twin = NStepWriter(FIELDS, **writer.settings())
    twin.load_state_dict(state)
    assert state_equal(twin.state_dict(), state)
    assert (twin.n_pending, twin.n_streams, twin.dropped) == (
        writer.n_pending, writer.n_streams, writer.dropped)  # fmt: skip
    for step, ids in rest:
        a, b = add(writer, step, ids), add(twin, step, ids)
        assert a.count == b.count
        for name in a.out:
            np.testing.assert_array_equal(a.out[name], b.out[name])
    assert state_equal(twin.state_dict(), writer.state_dict())


def _corrupt(state: dict[str, Any], change: str) -> dict[str, Any]:
    s = dict(state)
    if change == "unknown key":
        s["pending/nope"] = s["pending/obs"]
    elif change == "missing key":
        del s["pending/action"]
    elif change == "wrong dtype":
        s["pending/obs"] = s["pending/obs"].astype(np.float64)
    elif change == "wrong shape":
        s["pending/obs"] = s["pending/obs"][:, :2]
    elif change == "window longer than n - 1":
        s["lengths"] = s["lengths"].copy()
        s["lengths"][0] = 4
    elif change == "rows do not add up":
        s["pending/reward"] = s["pending/reward"][1:]
    elif change == "duplicate stream":
        s["stream_ids"] = np.zeros_like(s["stream_ids"])
    elif change == "negative stream":
        s["stream_ids"] = -1 - s["stream_ids"]
    elif change == "lengths not per stream":
        s["lengths"] = s["lengths"][:-1]
    elif change == "skip without autoreset":
        s["skip_next"] = np.ones_like(s["skip_next"])
    elif change == "bad format":
        s["format"] = 99
    elif change == "dropped negative":
        s["dropped"] = -1
    elif change == "not an array":
        s["lengths"] = s["lengths"].tolist()
    elif change == "float ids":
        s["stream_ids"] = s["stream_ids"].astype(float)
    return s


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("unknown key", r"unknown keys \['pending/nope'\]"),
        ("missing key", r"missing keys \['pending/action'\]"),
        ("wrong dtype", "`pending/obs` must have dtype float32"),
        ("wrong shape", r"`pending/obs` must have .* shape \(\d+, 3\)"),
        ("window longer than n - 1", r"`lengths` must lie in \[0, n - 1 = 3\]"),
        ("rows do not add up", "`pending/reward` must have dtype float32 and shape"),
        ("duplicate stream", "`stream_ids` must be distinct"),
        ("negative stream", "`stream_ids` must be distinct and >= 0"),
        ("lengths not per stream", "one entry per stream"),
        ("skip without autoreset", "`skip_next`.*needs autoreset"),
        ("bad format", "`format` must be 2"),
        ("dropped negative", "`dropped` must be >= 0"),
        ("not an array", "`lengths` must be a numpy array"),
        ("float ids", "`stream_ids` must be 1-D integers"),
    ],
)
def test_corrupt_state_raises_and_changes_nothing(change, match) -> None:
    writer, rest = mid_run_writer()
    before = writer.state_dict()
    with pytest.raises(ValueError, match=match):
        writer.load_state_dict(_corrupt(before, change))
    assert state_equal(writer.state_dict(), before)
    with pytest.raises(TypeError, match="must be a mapping"):
        writer.load_state_dict([("format", 2)])  # type: ignore[arg-type]
    add(writer, *rest[0])  # still works


def test_state_checks_streams_against_n_envs_and_flags() -> None:
    writer, _ = mid_run_writer(n_envs=3)
    state = writer.state_dict()
    bad = {**state, "stream_ids": state["stream_ids"] + 1}
    with pytest.raises(ValueError, match="streams unknown with n_envs=3"):
        NStepWriter(FIELDS, 4, 0.9, n_envs=3).load_state_dict(bad)
    legacy = {f"pending/{f}": episode([1.0])[f] for f in FIELDS}
    legacy["pending/truncated"] = np.array([True])
    with pytest.raises(ValueError, match="a pending step cannot end an episode"):
        NStepWriter(FIELDS, 4, 0.9).load_state_dict(legacy)


def test_legacy_single_window_loads_as_stream_zero() -> None:
    """fastper 0.1 checkpoints hold one window, {"pending/<field>": rows}, every field."""
    ep = episode([1.0, 2.0, 4.0, 8.0])
    legacy = {f"pending/{f}": v[:2] for f, v in ep.items()}
    writer = NStepWriter(FIELDS, 3, 0.5)
    writer.load_state_dict(legacy)
    assert writer.n_pending == 2 and writer.n_streams == 1
    np.testing.assert_array_equal(writer.state_dict()["stream_ids"], [0])
    out = add(writer, row(ep, 2)).out  # stream 0, as a single transition without env_ids
    assert out["reward"][0] == 1 + 0.5 * 2 + 0.25 * 4
    empty = NStepWriter(FIELDS, 3, 0.5)
    empty.load_state_dict({f"pending/{f}": v[:0] for f, v in ep.items()})
    assert empty.n_pending == 0 and empty.n_streams == 0
    with pytest.raises(ValueError, match="legacy n-step state: arrays must have one length"):
        empty.load_state_dict({**legacy, "pending/obs": ep["obs"][:1]})
    with pytest.raises(ValueError, match=r"`lengths` must lie in \[0, n - 1 = 2\]"):
        empty.load_state_dict({f"pending/{f}": v[:3] for f, v in ep.items()})


def test_oracle_agrees_on_one_hand_made_stream() -> None:
    ep = episode([1.0, 2.0, 4.0, 8.0], terminated_at=3)
    done, pending, dropped = naive_nstep_streams([(0, row(ep, i)) for i in range(4)], 3, 0.5)
    assert [len(d) for d in done] == [0, 0, 1, 3] and pending == {0: 0} and dropped == 0
    assert [r["reward"] for r in done[3]] == [2 + 0.5 * 4 + 0.25 * 8, 4 + 0.5 * 8, 8]
    assert [r["discount"] for r in done[2] + done[3]] == [0.125, 0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- through the buffer

WIRED = "env_ids" in inspect.signature(fastper.ReplayBuffer.add).parameters
wired = pytest.mark.skipif(not WIRED, reason="the buffer does not take env_ids yet")
ALL = [fastper.ReplayBuffer, fastper.PrioritizedReplayBuffer, fastper.RankBasedReplayBuffer]


@wired
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_buffer_keeps_vector_env_streams_apart(cls) -> None:
    buf = cls(16, FIELDS, n_step=3, gamma=0.5, n_envs=2, seed=0)
    step = {**episode([1.0, 100.0]), "obs": np.float32([[0] * 3, [1] * 3])}
    for _ in range(3):
        buf.add(step)
    assert len(buf) == 2 and buf.n_pending == 4
    np.testing.assert_array_equal(buf.sample(64).data["reward"].max(), 175.0)
    assert set(buf.sample(64).data["reward"].tolist()) == {1.75, 175.0}


@wired
def test_buffer_refuses_a_batch_without_stream_information() -> None:
    buf = fastper.ReplayBuffer(16, FIELDS, n_step=3, gamma=0.5, seed=0)
    with pytest.raises(ValueError, match="needs stream information"):
        buf.add(episode([1.0, 2.0]))
    assert len(buf) == 0 and buf.n_pending == 0
    buf.add(episode([1.0, 2.0, 3.0]), env_ids=[0, 0, 0])
    assert len(buf) == 1
