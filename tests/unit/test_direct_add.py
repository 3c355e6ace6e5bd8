"""The no-cast path of ``add`` (one env step, most adds) against the general path.

An add whose values need no checked cast (numpy arrays of the fields' dtypes,
or of dtypes that convert exactly; the Python numbers an env loop has) skips
the general path's copies, and the new slots' shared priority reaches the
index with the next locked call. Both are invisible: a buffer fed that way
must be, at every observation, the buffer fed the same rows through the
general path; and every value the general path
casts with a check or refuses must still get that treatment.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from fastper import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer, Storage
from fastper.errors import FieldTypeError

FIELDS = {
    "obs": ((3,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "done": ((), np.float32),
    "flag": ((), np.bool_),
}
KINDS = (ReplayBuffer, PrioritizedReplayBuffer, RankBasedReplayBuffer)


def _same_state(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same_state(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
        assert a.dtype == b.dtype, where
    else:
        assert a == b, where


def _row(rng: np.random.Generator, style: str) -> dict[str, Any]:
    obs = rng.standard_normal(3).astype(np.float32)
    a, r, d = int(rng.integers(0, 5)), float(rng.standard_normal()), bool(rng.random() < 0.1)
    if style == "python":
        return {"obs": obs, "action": a, "reward": r, "done": d, "flag": d}
    if style == "numpy":
        return {"obs": obs, "action": np.int64(a), "reward": np.float32(r),
                "done": np.float32(d), "flag": np.bool_(d)}  # fmt: skip
    if style == "batch1":  # one env of a vector env: a leading dimension of 1
        return {"obs": obs[None], "action": np.array([a]), "reward": np.array([r], np.float32),
                "done": np.array([d]), "flag": np.array([d])}  # fmt: skip
    k = 4  # a 4-env vector step, int32 actions and bool dones (exact conversions)
    return {"obs": rng.standard_normal((k, 3)).astype(np.float32),
            "action": rng.integers(0, 5, k).astype(np.int32),
            "reward": rng.standard_normal(k).astype(np.float32),
            "done": rng.random(k) < 0.1, "flag": rng.random(k) < 0.5}  # fmt: skip


def _general(buf: Any) -> Any:
    """``buf`` with its no-cast path switched off (every add takes the general path)."""
    storage, rows, _ = buf._direct_cache()
    buf._direct = (storage, rows, None)  # no one-call store: no no-cast add of rows
    return buf


@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("max_priority", ["ever", "current", "last", 2.5])
def test_direct_adds_leave_the_buffer_the_general_path_leaves(cls: Any, max_priority: Any) -> None:
    rng = np.random.default_rng(7)
    kw: dict[str, Any] = {"seed": 3, "clip": 4.0}
    if cls is not ReplayBuffer:
        kw["max_priority"] = max_priority
    elif max_priority != "ever":
        pytest.skip("uniform replay has no priorities")
    fast, slow = cls(37, FIELDS, **kw), _general(cls(37, FIELDS, **kw))
    styles = ("python", "numpy", "batch1", "vector")
    for step in range(400):
        row = _row(rng, styles[int(rng.integers(0, 4))])
        np.testing.assert_array_equal(fast.add(row), slow.add(row))
        op = int(rng.integers(0, 12))
        if op == 0 and len(fast) >= 4:
            a, b = fast.sample(8), slow.sample(8)
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a.weights, b.weights)
            _same_state(a.data, b.data)
            td = rng.standard_normal(8) * 3
            fast.update_priorities(a.indices, td, keys=a.keys)
            slow.update_priorities(b.indices, td, keys=b.keys)
        elif op == 1:
            idx = np.arange(len(fast))
            np.testing.assert_array_equal(fast.priorities(idx), slow.priorities(idx))
            np.testing.assert_array_equal(fast.probabilities(idx), slow.probabilities(idx))
        elif op == 2 and cls is not ReplayBuffer:
            fast.step = slow.step = step  # schedules re-weigh from the raw priorities
        elif op == 3 and len(fast) > 2:
            np.testing.assert_array_equal(fast.invalidate([1]), slow.invalidate([1]))
        elif op == 4:
            _same_state(fast.state_dict(), slow.state_dict(), f"step {step}")
    _same_state(fast.state_dict(), slow.state_dict(), "end")


def test_a_single_add_is_seen_at_once_by_every_reader() -> None:
    buf = PrioritizedReplayBuffer(16, FIELDS, seed=0)
    for i in range(3):
        buf.add({"obs": np.zeros(3, np.float32), "action": i, "reward": 1.0, "done": 0.0,
                 "flag": False})  # fmt: skip
    np.testing.assert_array_equal(buf.priorities([0, 1, 2]), [1.0, 1.0, 1.0])
    np.testing.assert_allclose(buf.probabilities([0, 1, 2]), [1 / 3] * 3)
    assert set(buf.sample(64).indices.tolist()) == {0, 1, 2}
    # the state saved and the state loaded back hold the three
    twin = PrioritizedReplayBuffer(16, FIELDS, seed=0)
    twin.load_state_dict(buf.state_dict())
    np.testing.assert_array_equal(twin.priorities([0, 1, 2]), [1.0, 1.0, 1.0])


def test_a_new_priority_follows_updates_made_between_single_adds() -> None:
    buf = PrioritizedReplayBuffer(16, FIELDS, seed=0)  # max_priority="ever"
    row = {"obs": np.zeros(3, np.float32), "action": 0, "reward": 1.0, "done": 0.0, "flag": False}
    buf.add(row)
    buf.add(row)
    buf.update_priorities([0], [5.0])  # raises the largest priority ever seen
    buf.add(row)
    buf.add(row)
    eps = 1e-6
    np.testing.assert_allclose(buf.priorities(np.arange(4)), [5 + eps, 1, 5 + eps, 5 + eps])


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"reward": float("nan")}, ValueError),  # a NaN reward: refused by default
        ({"reward": np.float32("inf")}, ValueError),
        ({"reward": 1e300}, FieldTypeError),  # overflows float32
        ({"action": 2**63}, FieldTypeError),  # overflows int64
        ({"action": 1.5}, FieldTypeError),  # truncated
        ({"flag": 2}, FieldTypeError),  # not 0 / 1
        ({"flag": 0.5}, FieldTypeError),
        ({"obs": np.zeros(4, np.float32)}, ValueError),  # wrong shape
        ({"obs": np.zeros((2, 3), np.float32), "action": 1}, ValueError),  # rows disagree
        ({"extra": 1}, ValueError),
    ],
)
def test_values_the_general_path_refuses_are_refused_and_change_nothing(
    value: dict[str, Any], error: type[Exception]
) -> None:
    buf = PrioritizedReplayBuffer(8, FIELDS, seed=0)
    row = {"obs": np.zeros(3, np.float32), "action": 1, "reward": 0.5, "done": 0.0, "flag": True}
    buf.add(row)
    before = buf.state_dict()
    with pytest.raises(error):
        buf.add(row | value)
    _same_state(buf.state_dict(), before)
    with pytest.raises(ValueError, match="missing"):
        buf.add({k: v for k, v in row.items() if k != "done"})
    _same_state(buf.state_dict(), before)


def test_python_numbers_are_stored_as_the_general_path_casts_them() -> None:
    fields = {"x32": ((), np.float32), "x64": ((), np.float64), "i8": ((), np.int8),
              "b": ((), np.bool_), "f16": ((), np.float16)}  # fmt: skip
    fast = PrioritizedReplayBuffer(8, fields, seed=0)
    slow = _general(PrioritizedReplayBuffer(8, fields, seed=0))
    rows = [
        {"x32": 0.1, "x64": 2**53 + 1, "i8": -128, "b": 1, "f16": 3},
        {"x32": 3.4e38, "x64": True, "i8": True, "b": False, "f16": 0.1},
        {"x32": float("nan"), "x64": -(2**53), "i8": 127, "b": True, "f16": 65504.0},
        {"x32": -7, "x64": 1e308, "i8": 0, "b": 0, "f16": np.float16(2.5)},
    ]
    for row in rows:
        fast.add(row)
        slow.add(row)
    _same_state(fast.state_dict(), slow.state_dict())
    for bad in ({"i8": 128}, {"x32": 3.5e38}, {"f16": 70000.0}):
        for buf in (fast, slow):
            with pytest.raises(FieldTypeError):
                buf.add(rows[0] | bad)


def test_single_adds_from_threads_while_another_samples() -> None:
    buf = PrioritizedReplayBuffer(4096, FIELDS, seed=0)
    row = {"obs": np.zeros(3, np.float32), "action": 0, "reward": 1.0, "done": 0.0, "flag": False}
    buf.add(row)
    errors: list[BaseException] = []

    def adder() -> None:
        try:
            for _ in range(1500):
                buf.add(row)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=adder) for _ in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        b = buf.sample(32)
        assert (b.indices < len(buf)).all()
        buf.update_priorities(b.indices, np.ones(32), keys=b.keys)
    for t in threads:
        t.join()
    assert not errors
    assert len(buf) == 3001
    # every slot has mass: the priorities of all runs reached the index
    assert (buf.priorities(np.arange(3001)) > 0).all()
    assert buf.total_added == 3001


def test_the_sb3_drop_in_stores_an_env_step_without_the_general_path() -> None:
    pytest.importorskip("stable_baselines3")
    gym = pytest.importorskip("gymnasium")
    from fastper.compat.sb3 import PrioritizedReplayBuffer as DropIn

    def refuse(*args: Any) -> None:
        raise AssertionError("the row took the general path")

    for n_envs in (1, 4):
        buf = DropIn(64, gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(3),
                     device="cpu", n_envs=n_envs, seed=0)  # fmt: skip
        core = buf._buffer
        add_general = core._add
        core._add = refuse  # type: ignore[method-assign]
        obs = np.arange(3 * n_envs, dtype=np.float32).reshape(n_envs, 3)
        done = np.zeros(n_envs, dtype=bool)
        done[0] = True
        infos = [{"TimeLimit.truncated": True}] + [{}] * (n_envs - 1)
        buf.add(obs, obs + 1, np.ones((n_envs, 1), np.int64), np.ones(n_envs, np.float32),
                done, infos)  # fmt: skip
        # stored as SB3 stores them: float32 flags, the time limit marked
        assert buf.dones.dtype == buf.timeouts.dtype == np.float32
        np.testing.assert_array_equal(buf.dones[0], done.astype(np.float32))
        np.testing.assert_array_equal(buf.timeouts[0], [1.0] + [0.0] * (n_envs - 1))
        np.testing.assert_array_equal(buf.observations[0], obs)
        if n_envs == 1:
            continue
        # the flags read to the last env (no flag, then one in the last env's infos)
        done[:] = [False, False, True, True]
        for step, infos in ((1, [{"TimeLimit.truncated": False}] * 4),
                            (2, [{}, {}, {"TimeLimit.truncated": False}, {"TimeLimit.truncated": True}])):  # fmt: skip
            buf.add(obs, obs, np.ones((4, 1), np.int64), np.ones(4, np.float32), done, infos)
            np.testing.assert_array_equal(buf.timeouts[step], [0, 0, 0, step == 2])
            np.testing.assert_array_equal(buf.dones[step], [0, 0, 1, 1])
        # a reward that is not finite, in any env, is refused and changes nothing
        core._add = add_general  # type: ignore[method-assign]
        before = core.state_dict()
        for bad in (np.nan, np.inf, -np.inf):
            rewards = np.array([0.5, -1.0, 2.0, bad], np.float32)
            with pytest.raises(ValueError, match="finite"):
                buf.add(obs, obs, np.ones((4, 1), np.int64), rewards, done, infos)
        _same_state(core.state_dict(), before)
        core._add = refuse  # type: ignore[method-assign]


def _draw_and_update_alike(fast: Any, slow: Any, b: int) -> None:
    """One draw of ``b`` from each buffer (the same slots and rows), then the same update."""
    x, y = fast.sample(b), slow.sample(b)
    np.testing.assert_array_equal(x.indices, y.indices)
    _same_state(x.data, y.data)
    td = np.arange(float(b))
    fast.update_priorities(x.indices, td, keys=x.keys)
    slow.update_priorities(y.indices, td, keys=y.keys)


def test_n_step_adds_of_plain_values_match_the_general_path() -> None:
    from fastper.storage import coerce_batch

    fields = {"obs": ((2,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
              "next_obs": ((2,), np.float32), "terminated": ((), np.bool_),
              "truncated": ((), np.bool_)}  # fmt: skip
    fast = PrioritizedReplayBuffer(23, fields, n_step=3, gamma=0.9, n_envs=2, seed=1)
    slow = PrioritizedReplayBuffer(23, fields, n_step=3, gamma=0.9, n_envs=2, seed=1)
    slow._window_batch = lambda t: coerce_batch(slow._nstep.fields, t, None)  # type: ignore[method-assign]
    slow._add_window_row = lambda t, e, *more: None  # type: ignore[method-assign]
    rng = np.random.default_rng(4)
    for t in range(120):
        ends = rng.random(2) < 0.15
        row = {"obs": rng.standard_normal((2, 2)).astype(np.float32),
               "action": rng.integers(0, 3, 2).astype(np.int32),  # an exact conversion
               "reward": rng.standard_normal(2).astype(np.float32),
               "next_obs": rng.standard_normal((2, 2)).astype(np.float32),
               "terminated": ends, "truncated": np.zeros(2, bool)}  # fmt: skip
        np.testing.assert_array_equal(fast.add(row), slow.add(row))
        if t % 10 == 9:
            _draw_and_update_alike(fast, slow, 6)
    _same_state(fast.state_dict(), slow.state_dict())
    # one stream of Python numbers, one transition at a time
    one_fast = PrioritizedReplayBuffer(9, fields, n_step=2, seed=0)
    one_slow = PrioritizedReplayBuffer(9, fields, n_step=2, seed=0)
    one_slow._window_batch = lambda t: coerce_batch(one_slow._nstep.fields, t, None)  # type: ignore[method-assign]
    one_slow._add_window_row = lambda t, e, *more: None  # type: ignore[method-assign]
    for t in range(30):
        row = {"obs": np.full(2, t, np.float32), "action": t % 3, "reward": 0.5 * t,
               "next_obs": np.full(2, t + 1, np.float32), "terminated": t % 7 == 6,
               "truncated": False}  # fmt: skip
        np.testing.assert_array_equal(one_fast.add(row), one_slow.add(row))
    _same_state(one_fast.state_dict(), one_slow.state_dict())


def _window_row(rng: np.random.Generator, t: int, style: str, reward: Any, end_p: float) -> dict:
    obs = rng.standard_normal(2).astype(np.float32)
    term, trunc = bool(rng.random() < end_p), bool(rng.random() < end_p / 2)
    if style == "python":
        return {"obs": obs, "action": int(t % 3), "reward": reward, "next_obs": obs + 1,
                "terminated": term, "truncated": trunc}  # fmt: skip
    return {"obs": obs, "action": np.int64(t % 3), "reward": np.float32(reward),
            "next_obs": obs + 1, "terminated": np.bool_(term), "truncated": np.array(trunc)}  # fmt: skip


def _count_steps(writer: Any) -> list[int]:
    """Count the adds the writer's one-call step (``NStepWriter.step_function``)
    takes, through every remake of it (new streams and a load make it again)."""
    took = [0]
    make = writer.step_function

    def make_counted(matcher: Any, rows: Any) -> Any:
        step = make(matcher, rows)
        if step is None:
            return None

        def counted(*args: Any) -> Any:
            out = step(*args)
            took[0] += out != 0
            return out

        writer._step = (rows, counted)
        return counted

    writer.step_function = make_counted
    writer._step = None  # made again, counted
    return took


@pytest.mark.parametrize(
    ("n", "autoreset", "reward_dtype", "n_envs", "row_views", "streams"),
    [(3, None, np.float32, None, 4096, 3), (2, "next_step", np.float64, None, 4096, 3),
     (5, None, np.float64, 1, 4096, 1), (1, "next_step", np.float32, None, 4096, 3),
     (12, None, np.float64, None, 4096, 3), (40, None, np.float32, None, 4096, 3),
     (3, None, np.float32, None, 0, 3), (12, None, np.float64, None, 0, 3),
     (3, None, np.float32, None, 16, 40)],
)  # fmt: skip
def test_single_n_step_rows_leave_the_buffer_the_general_path_leaves(
    n: int, autoreset: Any, reward_dtype: Any, n_envs: Any, row_views: int, streams: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """One row at a time, from several streams (int ``env_ids``) or one, in Python
    numbers or numpy scalars, with episode ends, non-finite rewards (refused),
    signed zeros and a ring that wraps: the row path leaves what the general path
    leaves, bit for bit; complete windows take the specialised row step.
    ``row_views=0``: the step indexes its windows instead of reading and writing
    them through row views made ahead (as for rings of more than 4096 rows).
    ``row_views=16`` with more streams: the streams' arrays grow past it while
    windows complete, from views of every kind, to streams' rows by views and
    window rows by index, to both by index."""
    import fastper.nstep

    monkeypatch.setattr(fastper.nstep, "_ROW_VIEWS", row_views)
    fields = {"obs": ((2,), np.float32), "action": ((), np.int64), "reward": ((), reward_dtype),
              "next_obs": ((2,), np.float32), "terminated": ((), np.bool_),
              "truncated": ((), np.bool_)}  # fmt: skip
    kw: dict[str, Any] = {"n_step": n, "gamma": 0.9, "autoreset": autoreset, "seed": 2}
    if n_envs is not None:
        kw["n_envs"] = n_envs
    fast, slow = PrioritizedReplayBuffer(29, fields, **kw), PrioritizedReplayBuffer(29, fields, **kw)
    slow._add_window_row = lambda t, e, *more: None  # type: ignore[method-assign]
    slow._nstep._prepare_one = lambda batch, r: None  # type: ignore[method-assign]  # the kernel's
    general = [0]  # adds that took the general path
    general_path = fast._add

    def counted(*args: Any) -> Any:
        general[0] += 1
        return general_path(*args)

    fast._add = counted  # type: ignore[method-assign]
    adds = 0
    if fast._nstep._row_part is not None and row_views != 16:  # row views, or the fallback
        constants = fast._nstep._row_part[2]
        assert ("ROWS0" in constants) == (row_views > 0)
        # the streams' meta rows and reward rings through views too, or indexed
        assert ("MROWS" in constants) == (row_views > 0)
        assert ("RROWS" in constants) == (row_views > 0 and n <= 9)
    kinds = set()  # the views the row step was made with, through the streams' growth
    make_steps = fast._nstep._make_steps

    def seen() -> None:
        make_steps()
        part = fast._nstep._row_part
        if part is not None:
            kinds.add(("ROWS0" in part[2], "MROWS" in part[2]))

    fast._nstep._make_steps = seen  # type: ignore[method-assign]
    stepped = _count_steps(fast._nstep)
    rng = np.random.default_rng(n)
    for t in range(600):
        sid = int(rng.integers(0, streams))
        env_ids = None if streams == 1 else sid
        reward = float(rng.choice([0.0, -0.0, 1.0, rng.standard_normal()]))
        if rng.random() < 0.02:
            reward = float("nan")
        end_p = 0.08 if n <= 5 else 0.015  # (longer windows: fewer ends, so they fill)
        row = _window_row(rng, t, "python" if rng.random() < 0.5 else "numpy", reward, end_p)
        if reward != reward:
            for buf in (fast, slow):
                with pytest.raises(ValueError, match="finite"):
                    buf.add(row, env_ids=env_ids)
        else:
            np.testing.assert_array_equal(fast.add(row, env_ids=env_ids), slow.add(row, env_ids=env_ids))
            adds += 1
        if t % 50 == 49:
            _draw_and_update_alike(fast, slow, 5)
            _same_bits(fast.state_dict(), slow.state_dict(), f"step {t}")
        if t == 300:  # the row path reads its windows through views: rebuilt by a load
            fast.load_state_dict(fast.state_dict())
    _same_bits(fast.state_dict(), slow.state_dict(), "end")
    assert adds - general[0] > 150, "the row path must be taken"
    if n > 1:
        assert stepped[0] > 50, f"complete windows must take the specialised step: {stepped[0]}"
    if row_views == 16:
        assert {(True, True), (False, True), (False, False)} <= kinds, kinds


def _same_bits(a: dict, b: dict, where: str) -> None:
    """As _same_state, float arrays compared bit for bit (-0.0 is not 0.0)."""
    assert a.keys() == b.keys(), where
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            _same_bits(x, y, f"{where}/{k}")
        elif isinstance(x, np.ndarray) and x.dtype.kind == "f":
            assert x.dtype == y.dtype and x.shape == y.shape, f"{where}/{k}"
            # (views of record storage are strided: compared as contiguous copies)
            xb, yb = (np.ascontiguousarray(v).view(np.uint8) for v in (x, y))
            np.testing.assert_array_equal(xb, yb, err_msg=f"{where}/{k}")
        else:
            _same_state(x, y, f"{where}/{k}")


@pytest.mark.parametrize(
    ("n", "n_envs", "reward_dtype", "flags", "view_rows"),
    [(3, 4, np.float32, ("terminated", "truncated"), 64), (2, 2, np.float64, ("terminated",), 64),
     (40, 3, np.float32, ("terminated", "truncated"), 64), (5, 8, np.float32, ("done",), 64),
     (3, 4, np.float32, ("terminated", "truncated"), 0), (40, 3, np.float64, ("done",), 0)],
)  # fmt: skip
def test_vector_n_step_steps_leave_the_buffer_the_general_path_leaves(
    n: int, n_envs: int, reward_dtype: Any, flags: tuple[str, ...], view_rows: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Vector steps in lockstep (the specialised steady-state step) and out of it
    (episode ends in some envs, non-finite rewards refused, a ring that wraps and
    grows): the buffer, bit for bit, is the one the general path leaves; returns
    of signed zeros included. ``view_rows=0``: the step slices its windows
    instead of writing through views made ahead (as for rings longer than 64)."""
    import fastper.nstep

    monkeypatch.setattr(fastper.nstep, "_VIEW_ROWS", view_rows)
    fields: dict[str, Any] = {"obs": ((2,), np.float32), "action": ((), np.int64),
                              "reward": ((), reward_dtype), "next_obs": ((2,), np.float32)}  # fmt: skip
    fields.update({f: ((), np.bool_) for f in flags})
    kw: dict[str, Any] = {"n_step": n, "gamma": 0.9, "n_envs": n_envs, "seed": 2}
    if "truncated" not in flags:
        kw["nstep_keys"] = {"truncated": None}
    fast, slow = PrioritizedReplayBuffer(61, fields, **kw), PrioritizedReplayBuffer(61, fields, **kw)
    slow._add_window_row = lambda t, e, *more: None  # type: ignore[method-assign]
    took = _count_steps(fast._nstep)
    rng = np.random.default_rng(n + n_envs)
    for t in range(400):
        end_p = 0.0 if (t // 50) % 2 == 0 else 0.1  # long runs in lockstep, then ends
        rew = rng.choice([0.0, -0.0, 1.5, -2.25], size=n_envs).astype(reward_dtype)
        if rng.random() < 0.02:
            rew[int(rng.integers(0, n_envs))] = np.inf
        row = {"obs": rng.standard_normal((n_envs, 2)).astype(np.float32),
               "action": rng.integers(0, 3, n_envs).astype(np.int32),
               "reward": rew, "next_obs": rng.standard_normal((n_envs, 2)).astype(np.float32)}  # fmt: skip
        for f in flags:
            row[f] = rng.random(n_envs) < end_p
        if not np.isfinite(rew).all():
            for buf in (fast, slow):
                with pytest.raises(ValueError, match="finite"):
                    buf.add(row)
            continue
        np.testing.assert_array_equal(fast.add(row), slow.add(row))
        if t % 40 == 39:
            _draw_and_update_alike(fast, slow, 5)
            _same_bits(fast.state_dict(), slow.state_dict(), f"step {t}")
        if t == 200:  # the windows' views are rebuilt by a load
            fast.load_state_dict(fast.state_dict())
    _same_bits(fast.state_dict(), slow.state_dict(), "end")
    assert took[0] > 40, "the lockstep plan must be taken"


def test_huge_finite_rewards_are_stored_without_a_warning() -> None:
    import warnings

    buf = PrioritizedReplayBuffer(8, FIELDS, seed=0)
    row = {"obs": np.zeros((2, 3), np.float32), "action": np.zeros(2, np.int64),
           "reward": np.array([3e38, -3e38], np.float32), "done": np.zeros(2, np.float32),
           "flag": np.zeros(2, bool)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sum of squares overflows: no RuntimeWarning
        buf.add(row)
    np.testing.assert_array_equal(buf.get([0, 1])["reward"], row["reward"])
    before = buf.state_dict()
    with pytest.raises(ValueError, match="finite"):
        buf.add(row | {"reward": np.array([3e38, np.inf], np.float32)})
    _same_state(buf.state_dict(), before)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ">f8"])
@pytest.mark.parametrize("layout", ["flat", "2-d", "strided", "read-only"])
@pytest.mark.parametrize("copies", [1, 5])
def test_the_reward_check_finds_every_non_finite_value(dtype: Any, layout: str, copies: int) -> None:
    """The finite-reward test of a batch (Python floats for a few values, a compiled
    pass for more float32 / float64, numpy otherwise): every NaN or inf at every
    position is found, in every layout; huge finite values pass (no overflow of a
    sum of squares)."""
    from fastper._validation import rewards_finite

    big = float(np.finfo(np.dtype(dtype)).max)

    def shaped(x: np.ndarray) -> np.ndarray:
        if layout == "2-d":
            return x.reshape(2, -1)
        if layout == "strided":
            wide = np.zeros(2 * x.shape[0], dtype=x.dtype)
            wide[::2] = x
            return wide[::2]
        if layout == "read-only":
            x.flags.writeable = False
        return x

    from fastper.storage import Storage

    # the no-cast adds' own test (DirectRows.exact_putter: a vector step's rewards as
    # Python floats), on the same values: the same answer, and nothing stored on a no
    column = Storage({"reward": ((), dtype)}, 64)
    put = column.direct_rows().exact_putter("reward")

    def both(x: np.ndarray) -> bool:
        a = rewards_finite(shaped(x))
        if layout == "flat":
            column.columns["reward"][:] = 7
            assert put(0, [x], x.shape[0]) is a, x
            stored = column.columns["reward"][: x.shape[0]]
            np.testing.assert_array_equal(stored, x if a else np.full(x.shape[0], 7, dtype=dtype))
        return a

    base = np.tile(np.array([0.5, -big, big, 1.0, -0.0, 3.0], dtype=dtype), copies)
    assert both(base.copy())
    # huge values of one sign: each is finite (for float64 their sum overflows, which
    # must send the test to each value, not refuse the batch)
    assert both(np.full(base.shape[0], big, dtype=dtype))
    assert both(np.array([-big, -big], dtype=dtype))
    for bad in (np.nan, np.inf, -np.inf):
        for i in range(base.shape[0]):
            x = base.copy()
            x[i] = bad
            assert not both(x), (bad, i)
        x = np.full(base.shape[0], big, dtype=dtype)  # with an overflowing sum beside it
        x[-1] = bad
        assert not both(x), bad


def test_the_specialised_matcher_stores_what_the_general_cast_stores_and_no_more() -> None:
    """``DirectRows.match`` / ``write`` are written out per layout. Over random
    layouts (every numeric dtype; scalar, vector and matrix fields) and random
    values (arrays of every dtype and of right and wrong shapes, Python and numpy
    scalars, values at and past each dtype's range, NaN and inf), a value it
    accepts is one the general path accepts and stores with the same bits, and
    one the general path refuses it never accepts. ``DirectRows.putter``'s one-call
    store takes exactly the values ``match`` takes, stores the same bits, and stores
    nothing where the rows do not fit or its reward field holds a NaN or an inf."""
    from fastper.storage import DirectRows, Storage

    rng = np.random.default_rng(11)
    codes = "?bhilqBHILQefd"
    shapes = [(), (), (3,), (2, 2)]
    specials = [0, 1, -1, 2, 0.5, -0.0, 1e300, -1e300, 2**53 + 1, 2**63, -(2**63) - 1,
                float("nan"), float("inf"), 65504.0, 70000.0, 255, 256, -129, True, False]  # fmt: skip

    def value(shape: tuple[int, ...], rows: int, own: np.dtype[Any]) -> Any:
        kind = int(rng.integers(0, 4))
        if kind == 0 and shape == ():  # a Python or numpy scalar
            v = specials[int(rng.integers(0, len(specials)))]
            if rng.random() < 0.3 and not isinstance(v, bool) and abs(v) < 2**53:
                code = codes[int(rng.integers(0, len(codes)))]
                with np.errstate(all="ignore"):
                    return np.array(v).astype(code)[()]  # a numpy scalar
            return v
        lead = () if rows == -1 else (rows,)
        if kind == 1 and rng.random() < 0.5:  # a shape that may be wrong
            lead = (int(rng.integers(1, 3)),)
        # the field's own dtype half the time (a vector step of them: the store's first test)
        code = own.char if rng.random() < 0.5 else codes[int(rng.integers(0, len(codes)))]
        full = (*lead, *shape)
        with np.errstate(all="ignore"):
            raw = rng.choice(np.array(specials[:10], dtype=np.float64), size=full)
            return raw.astype(code)

    accepted = refused = nonfinite = vectors = 0
    for trial in range(600):
        n = int(rng.integers(1, 4))
        fields = {f"f{i}": (shapes[int(rng.integers(0, 4))], np.dtype(codes[int(rng.integers(0, len(codes)))]))
                  for i in range(n)}  # fmt: skip
        general, direct, putting = Storage(fields, 8), Storage(fields, 8), Storage(fields, 8)
        rows = DirectRows(direct.fields, 8, direct.columns)
        floats = [name for name, (_, dt) in fields.items() if dt.kind == "f"]
        reward = floats[int(rng.integers(0, len(floats)))] if floats and rng.random() < 0.8 else None
        put = putting.direct_rows().putter(reward)
        want = [-1, 1, 3][int(rng.integers(0, 3))]
        transition = {name: value(shape, want, dt) for name, (shape, dt) in fields.items()}
        vector = want == 3 and all(
            type(v) is np.ndarray and v.dtype is fields[name][1] and v.shape == (3, *fields[name][0])
            for name, v in transition.items()
        )
        if reward is not None and rng.random() < 0.15:  # a NaN or inf reward among finite ones
            shape, dtype = fields[reward]
            bad = np.zeros((*(() if want == -1 else (want,)), *shape), dtype)
            bad.flat[int(rng.integers(0, bad.size))] = [np.nan, np.inf, -np.inf][int(rng.integers(0, 3))]
            transition[reward] = bad if rng.random() < 0.7 or bad.ndim else float(bad)
        matched = rows.match(transition)
        try:
            prepared, k = general.prepare(transition)
        except (ValueError, TypeError):  # FieldTypeError is a TypeError
            assert matched is None, (trial, fields, transition)
            refused += 1
            continue
        if matched is None:
            assert put(transition, 2) == 0 and _untouched(putting), trial
            continue
        accepted += 1
        values, count = matched
        assert (1 if count == -1 else count) == k, trial
        general.write(2, prepared, k)
        rows.write(2, values, count)
        for name in fields:
            a, b = general.columns[name], direct.columns[name]
            assert a.tobytes() == b.tobytes(), (trial, name, transition[name])
        # the one-call store: the same rows where they fit and the rewards are finite
        assert put(transition, 8 - k + 1) == 0 and _untouched(putting), trial  # no room
        finite = reward is None or bool(np.isfinite(prepared[reward]).all())
        stored = put(transition, 2)
        assert stored == (k if finite else 0), (trial, reward, transition)
        if not finite:
            assert _untouched(putting), trial
            nonfinite += 1
            continue
        for name in fields:
            a, b = general.columns[name], putting.columns[name]
            assert a.tobytes() == b.tobytes(), (trial, name, transition[name])
        vectors += vector
    # both outcomes are exercised, refused rewards, and vector steps of the fields' dtypes
    assert accepted > 50 and refused > 50 and nonfinite > 5, (accepted, refused, nonfinite)
    assert vectors > 20, vectors


def _untouched(storage: Any) -> bool:
    return not any(any(column.tobytes()) for column in storage.columns.values())


_SHAPE_CASES: dict[tuple[int, ...], dict[tuple[int, ...], int | None]] = {
    (): {(): -1, (1,): 1, (5,): 5, (16,): 16, (17,): None, (0,): None, (5, 1): None,
         (1, 1): None, (2, 2): None},
    (4,): {(4,): -1, (1, 4): 1, (5, 4): 5, (16, 4): 16, (17, 4): None, (0, 4): None,
           (5, 5): None, (5, 4, 1): None, (1, 1, 4): None, (20,): None, (3,): None, (8,): None,
           (2, 2): None, (10, 2): None, (2, 10): None, (5, 2, 2): None},
    (2, 2): {(2, 2): -1, (1, 2, 2): 1, (5, 2, 2): 5, (16, 2, 2): 16, (17, 2, 2): None,
             (0, 2, 2): None, (5, 4): None, (4,): None, (5, 2, 2, 1): None, (1, 1, 2, 2): None,
             (2, 5, 2): None},
}  # fmt: skip


@pytest.mark.parametrize("field_shape", list(_SHAPE_CASES))
def test_the_matcher_counts_rows_by_the_shape_alone(field_shape: tuple[int, ...]) -> None:
    """An array of a field's shape is one transition (-1), one with a leading dimension
    a batch of that many; anything else is refused. Scalar and vector fields are
    told apart by ``ndim``, ``len`` and ``size``: the shapes below agree with the
    field on some of them and not all, and each is tried as the first field of the
    storage and as a later one, beside a field whose count agrees."""
    from fastper.storage import Field, Storage

    a_field, x_field = Field((), np.float32), Field(field_shape, np.float32)
    # the storage's field order decides which field is checked first (not the dict's)
    x_later = Storage({"a": a_field, "x": x_field}, 16).direct_rows()
    x_first = Storage({"x": x_field, "a": a_field}, 16).direct_rows()
    assert x_later is not None and x_first is not None
    assert x_later.names == ("a", "x") and x_first.names == ("x", "a")
    for rows in (x_later, x_first):
        for shape, want in _SHAPE_CASES[field_shape].items():
            x = np.zeros(shape, np.float32)
            a = np.zeros(shape[:1] if len(shape) > len(field_shape) else (), np.float32)
            got = rows.match({"a": a, "x": x})
            assert (got is None) if want is None else (got is not None and got[1] == want), (
                rows.names, shape, got,
            )  # fmt: skip
        # every field must agree on the count
        batch = np.zeros((4, *field_shape), np.float32)
        assert rows.match({"a": np.zeros(3, np.float32), "x": batch}) is None
        assert rows.match({"a": np.float32(0.5), "x": batch[:1]}) is None


def test_dropped_direct_rows_free_their_columns_at_once_and_refuse_copies() -> None:
    """The specialised functions hold the columns they write: dropping the storage
    and its no-cast path frees the columns with no cycle left for the collector,
    and a copy (which would write into the original's columns) is refused."""
    import copy
    import gc
    import pickle
    import weakref

    from fastper.storage import Storage

    storage = Storage({"obs": ((3,), np.float32), "r": ((), np.float32)}, 16)
    rows = storage.direct_rows()
    rows.write(0, [np.ones(3, np.float32), 1.0], -1)
    with pytest.raises(TypeError, match="not copied"):
        copy.deepcopy(rows)
    with pytest.raises(TypeError, match="not copied"):
        pickle.dumps(rows)
    column = weakref.ref(storage.columns["obs"])
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del storage, rows
        assert column() is None  # freed by reference counting alone
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.skipif(
    np.finfo(np.longdouble).max <= np.finfo(np.float64).max, reason="longdouble is a double here"
)
@pytest.mark.parametrize("size", [1, 4, 20])
def test_a_longdouble_reward_beyond_a_double_is_finite(size: int) -> None:
    from fastper._validation import rewards_finite

    x = np.full(size, np.longdouble("1e4000"))
    assert rewards_finite(x)
    x[-1] = np.inf
    assert not rewards_finite(x)


@pytest.mark.parametrize("field_dtype", [np.float16, np.float32])
def test_half_precision_rewards_in_n_step_windows(field_dtype: Any) -> None:
    """float16 rewards, in a float16 reward field or given to a float32 one (an
    exact conversion), one row at a time and in vector steps: stored as the
    general path stores them (the compiled sums have no float16: it is widened
    exactly), returns summed in float64 then cast to the field."""
    fields = {"obs": ((2,), np.float32), "reward": ((), field_dtype),
              "next_obs": ((2,), np.float32), "terminated": ((), np.bool_),
              "truncated": ((), np.bool_)}  # fmt: skip
    for n_envs in (None, 2):
        kw: dict[str, Any] = {"n_step": 3, "gamma": 0.5, "seed": 0}
        if n_envs is not None:
            kw["n_envs"] = n_envs
        fast, slow = PrioritizedReplayBuffer(64, fields, **kw), PrioritizedReplayBuffer(64, fields, **kw)
        slow._add_window_row = lambda t, e, *more: None  # type: ignore[method-assign]
        slow._nstep._prepare_one = lambda batch, r: None  # type: ignore[method-assign]
        shape = () if n_envs is None else (n_envs,)
        for t in range(12):
            row = {"obs": np.full((*shape, 2), t, np.float32), "reward": np.full(shape, 0.25 * t, np.float16),
                   "next_obs": np.full((*shape, 2), t + 1, np.float32),
                   "terminated": np.full(shape, t == 8), "truncated": np.zeros(shape, bool)}  # fmt: skip
            np.testing.assert_array_equal(fast.add(row), slow.add(row))
        _same_bits(fast.state_dict(), slow.state_dict(), f"n_envs={n_envs}")
        got = fast.storage.gather(np.arange(len(fast)))
        # the first transition: rewards 0, 0.25, 0.5 -> 0 + 0.5 * 0.25 + 0.25 * 0.5
        assert got["reward"].dtype == field_dtype and float(got["reward"][0]) == 0.25


WINDOW_FIELDS = {"obs": ((2,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
                 "next_obs": ((2,), np.float32), "terminated": ((), np.bool_),
                 "truncated": ((), np.bool_)}  # fmt: skip


@pytest.mark.parametrize("flag_dtype", [np.float16, np.float32, np.float64, np.int8, np.bool_])
def test_vector_steps_take_episode_end_flags_of_every_exact_dtype(flag_dtype: Any) -> None:
    """Flags given in another dtype that converts exactly into the flag field
    (float16 included, which the compiled step has no kernel for) are stored as
    the general path stores them, in and out of lockstep."""
    fields = {"obs": ((2,), np.float32), "reward": ((), np.float32),
              "next_obs": ((2,), np.float32), "done": ((), np.float32)}  # fmt: skip
    kw: dict[str, Any] = {"n_step": 2, "n_envs": 2, "seed": 0,
                          "nstep_keys": {"terminated": "done", "truncated": None}}  # fmt: skip
    fast, slow = PrioritizedReplayBuffer(16, fields, **kw), PrioritizedReplayBuffer(16, fields, **kw)
    slow._add_window_row = lambda t, e, *more: None  # type: ignore[method-assign]
    for t in range(12):
        row = {"obs": np.full((2, 2), t, np.float32), "reward": np.full(2, 0.5 * t, np.float32),
               "next_obs": np.full((2, 2), t + 1, np.float32),
               "done": np.array([t == 7, False]).astype(flag_dtype)}  # fmt: skip
        np.testing.assert_array_equal(fast.add(row), slow.add(row))
    _same_bits(fast.state_dict(), slow.state_dict(), str(flag_dtype))
    assert len(fast) >= 16


@pytest.mark.parametrize(
    "kw",
    [{"autoreset": "next_step"}, {"n_step": 3}, {"n_step": 3, "n_envs": 2},
     {"n_envs": 2, "autoreset": "next_step"}, {}],
    ids=["autoreset", "n3", "n3-vector", "vector-autoreset", "plain"],
)  # fmt: skip
def test_a_storage_with_the_fields_in_another_order_stores_each_value_by_name(kw: dict) -> None:
    """A storage of the buffer's fields listed in another order: every add path
    stores each value in its own column (none by position)."""
    from fastper.storage import Storage

    stored = dict(PrioritizedReplayBuffer(8, WINDOW_FIELDS, **kw).storage.fields)
    order = dict(reversed(list(stored.items())))
    fast = PrioritizedReplayBuffer(8, WINDOW_FIELDS, storage=lambda f, c: Storage(order, c), seed=0, **kw)
    plain = PrioritizedReplayBuffer(8, WINDOW_FIELDS, seed=0, **kw)
    assert tuple(fast.storage.fields) != tuple(plain.storage.fields)
    k = kw.get("n_envs")
    for t in range(10):
        shape = () if k is None else (k,)
        row = {"obs": np.full((*shape, 2), t, np.float32), "action": np.full(shape, t),
               "reward": np.full(shape, 0.5 * t, np.float32),
               "next_obs": np.full((*shape, 2), 10 + t, np.float32),
               "terminated": np.full(shape, t == 4), "truncated": np.zeros(shape, bool)}  # fmt: skip
        if k is None:  # one env's step as an env loop has it: Python numbers
            row.update(action=t, reward=0.5 * t, terminated=t == 4, truncated=False)
        np.testing.assert_array_equal(fast.add(row), plain.add(row))
    for name in stored:
        np.testing.assert_array_equal(fast.storage.columns[name][: len(fast)],
                                      plain.storage.columns[name][: len(plain)], err_msg=name)  # fmt: skip


def test_the_n_step_step_is_made_only_for_rows_in_the_windows_order() -> None:
    from fastper.storage import DirectRows, Storage

    buf = PrioritizedReplayBuffer(8, WINDOW_FIELDS, n_step=3, seed=0)
    writer = buf._nstep
    matcher = DirectRows(writer.fields, 8)
    fields = dict(writer.output_fields)
    assert writer.step_function(matcher, Storage(fields, 8).direct_rows()) is not None
    other = Storage(dict(reversed(list(fields.items()))), 8).direct_rows()
    assert writer.step_function(matcher, other) is None


class _RecordingGuard:
    """A save in progress, as the buffer sees one: told of every slot about to be
    written over."""

    def __init__(self) -> None:
        self.told: list[int] = []

    def before_write(self, slots: Any) -> None:
        self.told += np.asarray(slots).tolist()


@pytest.mark.parametrize(
    "kw", [{}, {"n_step": 3}, {"n_step": 3, "n_envs": 2}, {"autoreset": "next_step"}],
    ids=["plain", "n3", "n3-vector", "autoreset"],
)  # fmt: skip
def test_a_save_in_progress_sees_every_row_written_over(kw: dict) -> None:
    """While a save streams the rows, every add (the no-cast ones too) tells it of
    the slots it is about to write over."""
    buf = PrioritizedReplayBuffer(8, WINDOW_FIELDS, seed=0, **kw)
    k = kw.get("n_envs")
    written: list[int] = []
    guard = _RecordingGuard()
    for t in range(30):
        shape = () if k is None else (k,)
        row = {"obs": np.full((*shape, 2), t, np.float32), "action": np.full(shape, t),
               "reward": np.full(shape, 0.5, np.float32), "next_obs": np.zeros((*shape, 2), np.float32),
               "terminated": np.zeros(shape, bool), "truncated": np.zeros(shape, bool)}  # fmt: skip
        if k is None:
            row.update(action=t, reward=0.5, terminated=False, truncated=False)
        if t == 10:
            buf._guards.append(guard)  # type: ignore[arg-type]
        slots = buf.add(row)
        if t >= 10:
            written += slots.tolist()
    buf._guards.remove(guard)  # type: ignore[arg-type]
    assert len(written) >= 19 and guard.told == written


def test_adds_into_invalid_slots_and_after_a_load_that_swaps_the_storage() -> None:
    """n-step adds while some slots are invalid, and plain one-row adds after a
    load replaced the storage: the buffer the general path leaves."""
    for kw in ({"n_step": 3}, {}):
        fast = PrioritizedReplayBuffer(16, WINDOW_FIELDS, seed=1, **kw)
        slow = PrioritizedReplayBuffer(16, WINDOW_FIELDS, seed=1, **kw)
        slow._add_window_row = lambda t, e, *more: None  # type: ignore[method-assign]
        if not kw:
            _general(slow)
        other = PrioritizedReplayBuffer(16, WINDOW_FIELDS, seed=5, **kw)
        for t in range(50):
            row = {"obs": np.full(2, t, np.float32), "action": t, "reward": 0.25 * t,
                   "next_obs": np.full(2, t + 1, np.float32), "terminated": t % 9 == 8,
                   "truncated": False}  # fmt: skip
            np.testing.assert_array_equal(fast.add(row), slow.add(row))
            other.add(row)
            if t == 12:
                np.testing.assert_array_equal(fast.invalidate([0, 3]), slow.invalidate([0, 3]))
            if t == 30:
                before = fast._storage
                for buf in (fast, slow):
                    buf.load_state_dict(other.state_dict())
                assert fast._storage is not before or not kw
        _same_bits(fast.state_dict(), slow.state_dict(), str(kw))


def test_env_ids_with_n_envs_are_refused_on_every_path() -> None:
    buf = PrioritizedReplayBuffer(16, WINDOW_FIELDS, n_step=2, n_envs=2, seed=0)
    row = {"obs": np.zeros((2, 2), np.float32), "action": np.zeros(2, np.int64),
           "reward": np.ones(2, np.float32), "next_obs": np.zeros((2, 2), np.float32),
           "terminated": np.zeros(2, bool), "truncated": np.zeros(2, bool)}  # fmt: skip
    for _ in range(4):
        buf.add(row)  # in lockstep: the one-call step is taken
    before = buf.state_dict()
    with pytest.raises(ValueError, match="env_ids"):
        buf.add(row, env_ids=np.array([0, 1]))
    _same_bits(buf.state_dict(), before, "refused")


def test_rows_a_front_end_built_are_stored_only_where_they_fit_before_the_ring_end() -> None:
    """``_add_exact`` (the SB3 drop-in's add) stores rows that fit before the
    ring's end and declines the rest, changing nothing: the general path wraps."""
    fields = {"obs": ((3,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
              "done": ((), np.float32)}  # fmt: skip
    buf = PrioritizedReplayBuffer(10, fields, seed=0)
    names = tuple(fields)
    for t in range(3):
        values = [np.full((3, 3), t, np.float32), np.full(3, t), np.full(3, 0.5, np.float32),
                  np.zeros(3, bool)]  # fmt: skip
        assert buf._add_exact(values, 3, names)
    before = buf.state_dict()
    assert not buf._add_exact(values, 3, names)  # slots 9, 0, 1: it would wrap
    _same_state(buf.state_dict(), before)
    assert buf._add_exact([values[0][0], 1, 0.5, True], -1, names)  # one row fits
    assert not buf._add_exact([values[0][0], 1, float("nan"), True], -1, names)
    before = buf.state_dict()  # a vector step with an inf reward: refused whole
    inf_step = [values[0], values[1], np.array([0.5, 0.5, -np.inf], np.float32), values[3]]
    assert not buf._add_exact(inf_step, 3, names)
    _same_state(buf.state_dict(), before)
    assert not buf._add_exact(values, 3, names[::-1])  # another field order
    assert len(buf) == 10 and buf.storage.columns["done"][9] == 1.0


def test_a_save_in_progress_sees_every_row_the_sb3_drop_in_writes_over() -> None:
    pytest.importorskip("stable_baselines3")
    gym = pytest.importorskip("gymnasium")
    from fastper.compat.sb3 import PrioritizedReplayBuffer as DropIn

    buf = DropIn(8, gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(3),
                 device="cpu", n_envs=2, seed=0)  # fmt: skip
    core = buf._buffer
    guard = _RecordingGuard()
    obs = np.zeros((2, 3), np.float32)
    expected: list[int] = []
    for t in range(10):
        if t == 3:
            core._guards.append(guard)  # type: ignore[arg-type]
        start = core._writer.cursor
        buf.add(obs, obs, np.zeros((2, 1), np.int64), np.ones(2, np.float32), np.zeros(2, bool), [{}, {}])
        if t >= 3:
            expected += [(start + i) % core.capacity for i in range(2)]
    core._guards.remove(guard)  # type: ignore[arg-type]
    assert guard.told == expected


@pytest.mark.parametrize(
    ("reward_dtype", "flag_dtype", "values"),
    [(np.float16, np.bool_, np.int8), (np.float16, np.bool_, np.bool_),
     (np.float32, np.longdouble, np.float32), (np.float32, ">f4", np.float32),
     (">f4", np.bool_, ">f4"), (">f8", np.bool_, np.float32), (np.longdouble, np.bool_, np.float64)],
)  # fmt: skip
def test_vector_steps_of_fields_the_compiled_step_cannot_take(
    reward_dtype: Any, flag_dtype: Any, values: Any
) -> None:
    """Reward fields the compiled vector step does not store into (float16,
    longdouble, another byte order) and flag fields it does not read (longdouble,
    another byte order): every add is stored, as the general path stores it."""
    flag = np.dtype(flag_dtype)
    fields = {"obs": ((2,), np.float32), "reward": ((), reward_dtype),
              "next_obs": ((2,), np.float32), "done": ((), flag)}  # fmt: skip
    for n_envs in (None, 4):
        kw: dict[str, Any] = {"n_step": 3, "gamma": 0.9, "seed": 0,
                              "nstep_keys": {"terminated": "done", "truncated": None}}  # fmt: skip
        if n_envs is not None:
            kw["n_envs"] = n_envs
        fast, slow = PrioritizedReplayBuffer(32, fields, **kw), PrioritizedReplayBuffer(32, fields, **kw)
        slow._add_window_row = lambda t, e, *more: None  # type: ignore[method-assign]
        shape = () if n_envs is None else (n_envs,)
        for t in range(12):
            row = {"obs": np.full((*shape, 2), t, np.float32),
                   "reward": np.array(np.full(shape, t % 5), dtype=values),
                   "next_obs": np.full((*shape, 2), t + 1, np.float32),
                   "done": np.full(shape, t == 7).astype(flag)}  # fmt: skip
            np.testing.assert_array_equal(fast.add(row), slow.add(row))
        assert len(fast) >= 8
        for name in fields:  # (values compared: a longdouble's padding bytes are arbitrary)
            np.testing.assert_array_equal(fast.storage.columns[name][: len(fast)],
                                          slow.storage.columns[name][: len(slow)], err_msg=name)  # fmt: skip
        _same_state(fast.state_dict()["nstep"], slow.state_dict()["nstep"])


def test_an_n_step_window_longer_than_an_int64_in_vector_steps() -> None:
    """An n beyond 2^63 (windows that never complete): vector steps wait in their
    windows, as the general path has them wait."""
    for n in (2**63, 2**70):
        buf = PrioritizedReplayBuffer(16, WINDOW_FIELDS, n_step=n, n_envs=2, seed=0)
        row = {"obs": np.zeros((2, 2), np.float32), "action": np.zeros(2, np.int64),
               "reward": np.ones(2, np.float32), "next_obs": np.zeros((2, 2), np.float32),
               "terminated": np.zeros(2, bool), "truncated": np.zeros(2, bool)}  # fmt: skip
        for _ in range(5):
            assert len(buf.add(row)) == 0
        assert buf.n_pending == 10 and len(buf) == 0


def test_store_lines_take_one_expression_per_column() -> None:
    from fastper.storage import Storage

    rows = Storage(WINDOW_FIELDS, 8).direct_rows()
    with pytest.raises(ValueError, match="one expression per column"):
        rows.store_lines(["v0"], 4)
    lines = rows.store_lines(["v0", None, "v2", None, "v4", "v5"], 4)
    assert not any("COL1" in line or "COL3" in line for line in lines)
    assert sum("COL" in line for line in lines) == 4


@pytest.mark.parametrize("layout", ["records", "columns"])
def test_vector_steps_stored_by_blocks_are_the_rows_stored_by_slices(layout: str) -> None:
    """The no-cast stores made for vector steps of ``block`` rows (one integer index
    per field into the columns viewed as blocks, where the step starts at a multiple
    of ``block``) store the bits the slice stores do, at every start, aligned or
    not, and for other row counts beside them; a refused reward stores nothing."""
    from fastper.storage import Storage

    fields = {"obs": ((3,), np.float32), "img": ((2, 2), np.uint8), "action": ((), np.int64),
              "reward": ((), np.float32), "done": ((), np.bool_)}  # fmt: skip
    rng = np.random.default_rng(5)

    def step(rows: int) -> dict[str, np.ndarray]:
        return {name: (rng.standard_normal((rows, *shape)) * 50).astype(dtype)
                for name, (shape, dtype) in fields.items()}  # fmt: skip

    cap = 12
    for block in (2, 3, 4):
        made = {kind: Storage(fields, cap, layout=layout) for kind in ("put", "exact", "slices")}
        assert made["put"].direct_rows().block_columns(block)  # the views exist
        put = made["put"].direct_rows().putter("reward", block)
        exact = made["exact"].direct_rows().exact_putter("reward", block)
        plain = made["slices"].direct_rows().putter("reward")
        names = tuple(fields)
        for rows in (block, block + 1, 2):
            for start in range(cap - rows + 1):
                t = step(rows)
                assert put(t, start) == rows == plain(t, start), (block, rows, start)
                assert exact(start, [t[n] for n in names], rows), (block, rows, start)
                for name in fields:
                    want = made["slices"].columns[name].tobytes()
                    assert made["put"].columns[name].tobytes() == want, (block, rows, start, name)
                    assert made["exact"].columns[name].tobytes() == want, (block, rows, start, name)
        bad = step(block)
        bad["reward"][-1] = np.nan
        before = {n: c.copy() for n, c in made["put"].columns.items()}
        assert put(bad, 0) == 0 and not exact(0, [bad[n] for n in names], block)
        for name in fields:
            assert made["put"].columns[name].tobytes() == before[name].tobytes(), name
            assert made["exact"].columns[name].tobytes() == made["slices"].columns[name].tobytes()
    # a block that does not divide the capacity: no views, the slices
    assert Storage(fields, cap, layout=layout).direct_rows().block_columns(5) == {}


def test_a_buffer_learns_the_size_of_its_vector_steps_and_stores_the_same_rows() -> None:
    """A buffer's first vector step of at most BLOCK_ROWS_MAX rows sets the size its
    no-cast stores take by blocks; a buffer that never learns it (the slices)
    holds the same state after the same adds (vector steps, single rows that
    shift the ring off the blocks' alignment, wraps, a refused reward)."""
    from fastper.buffer_rows import BLOCK_ROWS_MAX

    fields = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
              "done": ((), np.float32)}  # fmt: skip
    learns = PrioritizedReplayBuffer(16, fields, seed=0)
    slices = PrioritizedReplayBuffer(16, fields, seed=0)
    slices._learn_block = lambda rows: None  # type: ignore[method-assign]
    rng = np.random.default_rng(8)
    big = {n: np.zeros((BLOCK_ROWS_MAX + 1, *s), d) for n, (s, d) in fields.items()}
    with pytest.raises(ValueError):  # more rows than the capacity: refused, nothing learnt
        learns.add(big)
    assert learns._block_rows is None
    wide = PrioritizedReplayBuffer(4 * BLOCK_ROWS_MAX, fields, seed=0)
    wide.add(big)  # a batch larger than a vector step: stored, and decides nothing
    assert wide._block_rows is None
    wide.add({n: v[:3] for n, v in big.items()})
    assert wide._block_rows == 3
    for t in range(40):
        rows = 4 if t % 7 else 1
        step = {n: rng.standard_normal((rows, *s)).astype(d) for n, (s, d) in fields.items()}
        if t == 20:
            step["reward"][2] = np.inf
            for buf in (learns, slices):
                with pytest.raises(ValueError, match="finite"):
                    buf.add(step)
            continue
        np.testing.assert_array_equal(learns.add(step), slices.add(step))
    assert learns._block_rows == 4 and slices._block_rows is None
    _same_state(learns.state_dict(), slices.state_dict())


@pytest.mark.parametrize("layout", ["records", "columns"])
def test_vector_steps_store_fields_of_no_bytes_by_blocks_too(layout: str) -> None:
    """A field of size 0 (shape (0,)) has a block view like any other: vector steps
    after the first are stored, by plain and n-step buffers alike."""
    fields = {"z": ((0,), np.float32), "a": ((), np.int64), "reward": ((), np.float32)}
    buf = PrioritizedReplayBuffer(8, fields, storage=lambda f, c: Storage(f, c, layout=layout))
    for t in range(5):
        step = {"z": np.zeros((4, 0), np.float32), "a": np.arange(4) + 4 * t,
                "reward": np.ones(4, np.float32)}  # fmt: skip
        np.testing.assert_array_equal(buf.add(step), np.arange(4) + 4 * (t % 2))
    assert buf._block_rows == 4
    np.testing.assert_array_equal(buf.storage.columns["a"], [16, 17, 18, 19, 12, 13, 14, 15])
    flags = {"terminated": ((), np.bool_), "truncated": ((), np.bool_)}
    nstep = PrioritizedReplayBuffer(
        8, {**fields, "next_obs": ((0,), np.float32), **flags}, n_step=2, gamma=0.9, n_envs=4,
        storage=lambda f, c: Storage(f, c, layout=layout),
    )  # fmt: skip
    for t in range(5):
        nstep.add({"z": np.zeros((4, 0), np.float32), "next_obs": np.zeros((4, 0), np.float32),
                   "a": np.arange(4) + 4 * t, "reward": np.ones(4, np.float32),
                   "terminated": np.zeros(4, bool), "truncated": np.zeros(4, bool)})  # fmt: skip
    assert len(nstep) == 8
    np.testing.assert_array_equal(nstep.storage.columns["a"], np.arange(8, 16))  # steps 2, 3


def test_the_stores_made_again_for_blocks_are_made_before_an_add_stores_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first vector step is committed, then the next add makes the stores with
    blocks before it stores anything: where making them fails (out of memory), the
    buffer is as it was, and an add after it stores the step."""
    from fastper.storage import DirectRows

    made = DirectRows.putter

    def interrupted(self: Any, reward: Any, block: int = 0) -> Any:
        if block:
            raise MemoryError
        return made(self, reward, block)

    monkeypatch.setattr(DirectRows, "putter", interrupted)
    fields = {"obs": ((2,), np.float32), "reward": ((), np.float32)}
    buf = PrioritizedReplayBuffer(4, fields, seed=0)
    step = {"obs": np.ones((4, 2), np.float32), "reward": np.ones(4, np.float32)}
    np.testing.assert_array_equal(buf.add(step), [0, 1, 2, 3])  # full: the next overwrites
    assert buf._block_rows == 4
    before = buf.state_dict()
    with pytest.raises(MemoryError):
        buf.add({"obs": np.full((4, 2), 7, np.float32), "reward": np.ones(4, np.float32)})
    _same_state(buf.state_dict(), before)
    monkeypatch.setattr(DirectRows, "putter", made)
    np.testing.assert_array_equal(buf.add(step), [0, 1, 2, 3])
