"""n-step windows per stream (vector envs, actors), checked against a per-stream oracle."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from fastper.nstep import NStepWriter
from fastper.storage import coerce_batch, make_fields
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


def make_envs(
    n_envs: int,
    length: int,
    rng: np.random.Generator,
    autoreset: str | None,
    p_term: float = 0.07,
    p_trunc: float = 0.05,
) -> list[list[dict[str, Any]]]:
    """Per-env chronological rows; obs = (env, t, 0) so any mixing shows.

    With autoreset the row after an episode end is the env's reset step: not a
    transition, filled with junk (random flags too) that must never come out.
    """
    envs = []
    for e in range(n_envs):
        rows = []
        after_end = False
        for t in range(length):
            u = rng.random()
            row = {
                "obs": np.array([e, t, 0], dtype=np.float32),
                "action": np.int64(rng.integers(0, 4)),
                "reward": np.float32(rng.normal()),
                "next_obs": np.array([e, t + 0.5, 1], dtype=np.float32),
                "terminated": np.bool_(u < p_term),
                "truncated": np.bool_(p_term <= u < p_term + p_trunc),
            }
            if autoreset and after_end:
                row["obs"] = np.array([e, t, -1], dtype=np.float32)
                row["reward"] = np.float32(1e6)
            after_end = bool(row["terminated"] or row["truncated"])
            rows.append(row)
        envs.append(rows)
    return envs


def stack(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}


def vector_schedule(envs: list[list[dict[str, Any]]]) -> list[tuple[dict, Any, list[int]]]:
    """Every add is one step of every env (n_envs mode): (transition, env_ids, streams)."""
    n_envs = len(envs)
    return [
        (stack([envs[e][t] for e in range(n_envs)]), None, list(range(n_envs)))
        for t in range(len(envs[0]))
    ]


def mixed_schedule(
    envs: list[list[dict[str, Any]]], rng: np.random.Generator, ids: list[int]
) -> list[tuple[dict, Any, list[int]]]:
    """Random adds: single transitions (env_ids scalar, [id] or None for id 0) and
    batches of random rows, several of one stream among them, in each env's order."""
    cursor = [0] * len(envs)
    schedule = []
    while True:
        live = [e for e in range(len(envs)) if cursor[e] < len(envs[e])]
        if not live:
            return schedule
        if rng.random() < 0.4:
            e = int(rng.choice(live))
            row = envs[e][cursor[e]]
            cursor[e] += 1
            how = rng.integers(0, 3)
            env_id: Any = ids[e] if how == 0 else np.int64(ids[e]) if how == 1 else [ids[e]]
            if ids[e] == 0 and rng.random() < 0.5:
                env_id = None
            schedule.append((dict(row), env_id, [ids[e]]))
            continue
        k = int(rng.integers(1, 13))
        picks = []
        for _ in range(k):
            live = [e for e in range(len(envs)) if cursor[e] < len(envs[e])]
            if not live:
                break
            e = int(rng.choice(live))
            picks.append((e, envs[e][cursor[e]]))
            cursor[e] += 1
        streams = [ids[e] for e, _ in picks]
        env_ids: Any = np.array(streams) if rng.random() < 0.7 else list(streams)
        schedule.append((stack([r for _, r in picks]), env_ids, streams))


def expected_rows(done: list[dict[str, Any]], writer: NStepWriter) -> dict[str, np.ndarray]:
    out = {}
    for name, f in writer.output_fields.items():
        vals = [np.asarray(r[name]) for r in done]
        out[name] = (
            np.stack(vals).astype(f.dtype) if vals else np.zeros((0, *f.shape), dtype=f.dtype)
        )
    return out


def add(writer: NStepWriter, transition: dict, env_ids: Any):
    batch, k = coerce_batch(writer.fields, transition, None)
    plan = writer.prepare(batch, k, env_ids)
    writer.commit(plan)
    return plan


def round_trip(writer: NStepWriter) -> NStepWriter:
    """A fresh writer with the same settings, loaded from ``writer``'s state."""
    state = writer.state_dict()
    json.dumps({k: v for k, v in state.items() if not isinstance(v, np.ndarray)})
    twin = NStepWriter(writer.fields, **writer.settings())
    twin.load_state_dict(state)
    return twin


@pytest.mark.parametrize("autoreset", [None, "next_step"])
@pytest.mark.parametrize(
    ("n_envs", "n", "gamma", "seed", "mode", "p_end", "length"),
    [
        (2, 3, 0.5, 0, "vector", 0.12, 60),
        (4, 2, 0.9, 1, "vector", 0.12, 60),
        (16, 5, 0.99, 2, "vector", 0.12, 60),
        (3, 1, 0.9, 3, "vector", 0.12, 60),
        (2, 3, 0.5, 4, "mixed", 0.12, 60),
        (5, 4, 0.9, 5, "mixed", 0.12, 60),
        (16, 3, 1.0, 6, "mixed", 0.12, 60),
        (7, 8, 0.7, 7, "mixed", 0.12, 60),
        (4, 1, 0.8, 8, "mixed", 0.12, 60),
        # long windows: the rings start at 16 rows and grow mid-run
        (3, 40, 0.99, 9, "vector", 0.02, 200),
        (4, 30, 0.95, 10, "mixed", 0.02, 200),
    ],
)
def test_interleaved_streams_match_oracle(
    n_envs, n, gamma, seed, mode, p_end, length, autoreset
) -> None:
    rng = np.random.default_rng(seed)
    envs = make_envs(n_envs, length, rng, autoreset, p_end * 0.6, p_end * 0.4)
    if mode == "vector":
        ids = list(range(n_envs))
        schedule = vector_schedule(envs)
        writer = NStepWriter(FIELDS, n, gamma, n_envs=n_envs, autoreset=autoreset)
    else:
        ids = [0] + [1_000_017 + 7919 * e for e in range(1, n_envs)]  # actor-like ids
        schedule = mixed_schedule(envs, rng, ids)
        writer = NStepWriter(FIELDS, n, gamma, autoreset=autoreset)
    arrivals = [
        (s, {k: v[i] for k, v in tr.items()} if np.ndim(tr["reward"]) else tr)
        for tr, _, streams in schedule
        for i, s in enumerate(streams)
    ]
    completed, pending, dropped = naive_nstep_streams(arrivals, n, gamma, autoreset=autoreset)
    assert sum(map(len, completed)) > 20
    if n > 1:  # the draw exercises windows cut by both kinds of episode end
        flat = [r for rows in completed for r in rows]
        assert any(r["_m"] < n and r["terminated"] for r in flat)
        assert any(r["_m"] < n and r["truncated"] and not r["terminated"] for r in flat)
    if autoreset:
        assert dropped > 0
    pos = 0
    for i, (transition, env_ids, streams) in enumerate(schedule):
        if i == len(schedule) // 2:
            writer = round_trip(writer)  # mid-episode: the twin must carry on identically
        plan = add(writer, transition, env_ids)
        want = expected_rows(
            [r for rows in completed[pos : pos + len(streams)] for r in rows], writer
        )
        pos += len(streams)
        assert plan.count == len(want["reward"])
        assert list(plan.out) == list(writer.output_fields)
        for name, arr in want.items():
            got = plan.out[name]
            assert got.dtype == arr.dtype, name
            np.testing.assert_array_equal(got, arr, err_msg=f"{name} at add {i}")
    assert writer.n_pending == sum(pending.values())
    assert writer.dropped == dropped
    assert writer.n_streams == (n_envs if n > 1 or autoreset else 0)


def test_vector_env_batch_keeps_streams_apart() -> None:
    """Issue: a (n_envs, ...) batch was read as consecutive steps of one env
    (2 envs, rewards 1 and 100, n=3, gamma=0.5: slot 0 got 51.25 and env 1's
    next_obs); each env's return must be 1.75 and 175."""
    writer = NStepWriter(FIELDS, 3, 0.5, n_envs=2)
    step = {
        "obs": np.array([[0, 0, 0], [1, 1, 1]], dtype=np.float32),
        "action": np.array([0, 1]),
        "reward": np.array([1.0, 100.0]),
        "next_obs": np.array([[0.5] * 3, [1.5] * 3], dtype=np.float32),
        "terminated": np.zeros(2, dtype=bool),
        "truncated": np.zeros(2, dtype=bool),
    }
    assert add(writer, step, None).count == 0
    assert add(writer, step, None).count == 0
    plan = add(writer, step, None)
    assert plan.count == 2
    np.testing.assert_array_equal(plan.out["reward"], [1.75, 175.0])
    np.testing.assert_array_equal(plan.out["next_obs"][:, 0], [0.5, 1.5])
    np.testing.assert_array_equal(plan.out["obs"][:, 0], [0, 1])
    np.testing.assert_array_equal(plan.out["discount"], [0.125, 0.125])
    assert writer.n_pending == 4 and writer.n_streams == 2


def test_two_actors_adding_in_turn_keep_streams_apart() -> None:
    """Issue: two actors calling add(one) in turn corrupted each other's windows."""
    writer = NStepWriter(FIELDS, 2, 0.5)
    out = []
    for t in range(3):
        for actor, reward in ((7, 1.0), (1_000_017, 100.0)):
            row = {
                "obs": np.full(3, actor, dtype=np.float32),
                "action": 0,
                "reward": reward,
                "next_obs": np.full(3, t, dtype=np.float32),
                "terminated": False,
                "truncated": False,
            }
            plan = add(writer, row, actor)
            out += [
                (float(r), float(o[0]))
                for r, o in zip(plan.out["reward"], plan.out["obs"], strict=True)
            ]
    # each actor's transitions: its own reward twice, its own obs
    assert out == [(1.5, 7.0), (150.0, 1_000_017.0), (1.5, 7.0), (150.0, 1_000_017.0)]
    assert writer.n_streams == 2 and writer.n_pending == 2


def test_several_rows_of_one_stream_are_consecutive_steps() -> None:
    rng = np.random.default_rng(0)
    envs = make_envs(1, 30, rng, None)
    chunked = NStepWriter(FIELDS, 4, 0.9)
    single = NStepWriter(FIELDS, 4, 0.9)
    got = [
        add(chunked, stack(envs[0][a : a + 6]), np.zeros(6, dtype=np.int64))
        for a in range(0, 30, 6)
    ]
    want = [add(single, row, None) for row in envs[0]]
    for name in chunked.output_fields:
        np.testing.assert_array_equal(
            np.concatenate([p.out[name] for p in got]), np.concatenate([p.out[name] for p in want])
        )
    assert chunked.state_dict().keys() == single.state_dict().keys()


def test_nstep_batch_without_stream_info_is_refused() -> None:
    writer = NStepWriter(FIELDS, 3, 0.9)
    batch = stack(make_envs(1, 4, np.random.default_rng(0), None)[0])
    b, k = coerce_batch(FIELDS, batch, None)
    with pytest.raises(
        ValueError,
        match=r"a batch of 4 transitions needs stream information.*pass `env_ids`.*`n_envs`",
    ):
        writer.prepare(b, k, None)
    assert writer.n_pending == 0 and writer.n_streams == 0
    one = NStepWriter(FIELDS, 1, 0.9, autoreset="next_step")
    with pytest.raises(ValueError, match="needs stream information when autoreset='next_step'"):
        one.prepare(b, k, None)
    plain = NStepWriter(FIELDS, 1, 0.9)  # 1-step without autoreset: streams do not matter
    assert plain.prepare(b, k, None).count == 4


@pytest.mark.parametrize(
    ("kwargs", "k", "env_ids", "exc", "match"),
    [
        ({"n_envs": 4}, 3, None, ValueError, r"with n_envs=4 every add must be .* exactly 4 rows"),
        ({"n_envs": 4}, 1, None, ValueError, "a single transition is refused"),
        ({"n_envs": 2}, 2, [0, 1], ValueError, "`env_ids` must be None when n_envs=2"),
        ({}, 3, [0, 1], ValueError, r"`env_ids` must have one id per row \(3\), got 2"),
        ({}, 2, [0, -1], ValueError, "`env_ids` must be >= 0"),
        ({}, 2, [0.0, 1.0], TypeError, "`env_ids` must hold integers"),
        ({}, 2, [[0, 1]], ValueError, "`env_ids` must be 1-D"),
        ({}, 2, 3, ValueError, "`env_ids` must be 1-D"),
        ({}, 2, np.array([0, 2**64 - 1], dtype=np.uint64), ValueError, "must be < 2\\*\\*63"),
        ({}, 1, True, TypeError, "`env_ids` must hold integers"),
    ],
)
def test_bad_stream_information_changes_nothing(kwargs, k, env_ids, exc, match) -> None:
    writer = NStepWriter(FIELDS, 3, 0.9, **kwargs)
    envs = make_envs(4, 3, np.random.default_rng(1), None)
    n_envs = kwargs.get("n_envs")
    add(
        writer,
        stack([envs[e][0] for e in range(n_envs)]) if n_envs else envs[0][0],
        None if n_envs else 5,
    )
    before = writer.state_dict()
    b, kk = coerce_batch(FIELDS, stack([envs[0][1]] * k) if k > 1 else envs[0][1], None)
    with pytest.raises(exc, match=match):
        writer.prepare(b, kk, env_ids)
    after = writer.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])


def test_torch_env_ids_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    writer = NStepWriter(FIELDS, 2, 0.5)
    envs = make_envs(2, 2, np.random.default_rng(2), None)
    envs = [[{**r, "terminated": np.False_, "truncated": np.False_} for r in rows] for rows in envs]
    plan = add(
        writer, stack([envs[0][0], envs[1][0], envs[0][1], envs[1][1]]), torch.tensor([3, 9, 3, 9])
    )
    np.testing.assert_array_equal(plan.out["obs"][:, 0], [0, 1])
    assert writer.n_streams == 2


def test_many_new_streams_grow_the_windows() -> None:
    writer = NStepWriter(FIELDS, 3, 0.5)
    envs = make_envs(1, 3, np.random.default_rng(3), None)
    envs[0] = [{**r, "terminated": np.False_, "truncated": np.False_} for r in envs[0]]
    ids = np.arange(100, dtype=np.int64) * 1_000_003
    for t in range(3):
        plan = add(writer, stack([envs[0][t]] * 100), ids)
    assert writer.n_streams == 100 and plan.count == 100 and writer.n_pending == 200
    state = writer.state_dict()
    np.testing.assert_array_equal(state["stream_ids"], ids)
    assert state["pending/obs"].shape == (200, 3)
