"""n-step returns written by any buffer, checked against a naive Python oracle."""

from __future__ import annotations

import numpy as np
import pytest

from fastper import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer
from tests.oracles import assert_same_state, snapshot

ALL = [ReplayBuffer, PrioritizedReplayBuffer, RankBasedReplayBuffer]
all_buffers = pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)

FIELDS = {
    "obs": ((3,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((3,), np.float32),
    "terminated": ((), np.bool_),
    "truncated": ((), np.bool_),
}


def make_stream(
    length: int, seed: int, p_term: float = 0.08, p_trunc: float = 0.06
) -> dict[str, np.ndarray]:
    """A chronological stream of random episodes; obs[t] = t, next_obs[t] = t + 0.5."""
    rng = np.random.default_rng(seed)
    t = np.arange(length, dtype=np.float32)
    u = rng.random(length)
    return {
        "obs": np.repeat(t[:, None], 3, axis=1),
        "action": rng.integers(0, 4, size=length).astype(np.int64),
        "reward": rng.normal(size=length).astype(np.float32),
        "next_obs": np.repeat(t[:, None] + 0.5, 3, axis=1),
        "terminated": u < p_term,
        "truncated": (u >= p_term) & (u < p_term + p_trunc),
    }


def naive_nstep(
    stream: dict[str, np.ndarray],
    n: int,
    gamma: float,
    term: str | None = "terminated",
    trunc: str | None = "truncated",
) -> tuple[list[dict], int]:
    """Transitions an n-step writer must have emitted after `stream`, and how many wait."""
    length = len(stream["reward"])

    def flag(key: str | None, i: int) -> bool:
        return key is not None and bool(stream[key][i])

    out: list[dict] = []
    for t in range(length):
        ret, m, ended = 0.0, 0, False
        for j in range(n):
            if t + j >= length:
                break
            ret += gamma**j * float(stream["reward"][t + j])
            m = j + 1
            if flag(term, t + j) or flag(trunc, t + j):
                ended = True
                break
        if not (m == n or ended):
            break  # window still open: this and all later transitions wait
        last = t + m - 1
        row = {k: np.asarray(v[t]) for k, v in stream.items()}
        row["reward"] = ret
        row["next_obs"] = stream["next_obs"][last]
        for key in (term, trunc):
            if key is not None:
                row[key] = stream[key][last]
        row["discount"] = 0.0 if flag(term, last) else gamma**m
        row["_m"] = m
        out.append(row)
    return out, length - len(out)


def stored_rows(buf, count: int) -> dict[str, np.ndarray]:
    """Columns of the last `count` written transitions, in insertion order."""
    total = buf.total_added
    slots = np.arange(total - count, total) % buf.capacity
    return {k: col[slots] for k, col in buf._storage.columns.items()}


def assert_matches_oracle(buf, expected: list[dict]) -> None:
    count = min(len(expected), buf.capacity)
    assert len(buf) == count
    got = stored_rows(buf, count)
    want = expected[len(expected) - count :]
    for name in got:
        col = np.array([row[name] for row in want])
        if got[name].dtype.kind == "f":
            np.testing.assert_allclose(got[name], col, rtol=1e-6, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], col.astype(got[name].dtype), err_msg=name)


def assert_same_batch_data(a, b) -> None:
    np.testing.assert_array_equal(a.indices, b.indices)
    for k in a.data:
        np.testing.assert_array_equal(a.data[k], b.data[k])


def single(stream: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    return {k: v[i] for k, v in stream.items()}


def chunk(stream: dict[str, np.ndarray], a: int, b: int) -> dict[str, np.ndarray]:
    return {k: v[a:b] for k, v in stream.items()}


# --------------------------------------------------------------------------- oracle comparisons


@all_buffers
@pytest.mark.parametrize(("n", "gamma"), [(2, 0.9), (3, 0.99), (5, 0.5), (4, 1.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_episodes_match_oracle(cls, n, gamma, seed) -> None:
    stream = make_stream(300, seed)
    expected, waiting = naive_nstep(stream, n, gamma)
    assert any(r["_m"] < n for r in expected) and any(r["_m"] == n for r in expected)
    buf = cls(512, FIELDS, n_step=n, gamma=gamma, seed=0)
    for i in range(300):
        buf.add(single(stream, i))
    assert buf.n_pending == waiting
    assert buf.total_added == len(expected)
    assert_matches_oracle(buf, expected)
    assert buf.fields["discount"].dtype == np.float32


@all_buffers
@pytest.mark.parametrize("n", [2, 3, 6])
def test_one_at_a_time_equals_one_batch_equals_chunks(cls, n) -> None:
    stream = make_stream(120, seed=3)
    one, batch, chunks = (cls(128, FIELDS, n_step=n, gamma=0.95, seed=1) for _ in range(3))
    slots_one = [one.add(single(stream, i)) for i in range(120)]
    slots_batch = batch.add(stream)
    rng = np.random.default_rng(9)
    cuts = np.sort(rng.choice(np.arange(1, 120), size=15, replace=False))
    bounds = zip([0, *cuts], [*cuts, 120], strict=True)
    slots_chunks = [chunks.add(chunk(stream, a, b)) for a, b in bounds]
    np.testing.assert_array_equal(np.concatenate(slots_one), slots_batch)
    np.testing.assert_array_equal(np.concatenate(slots_chunks), slots_batch)
    assert_same_state(snapshot(one), snapshot(batch))
    assert_same_state(snapshot(one), snapshot(chunks))
    expected, waiting = naive_nstep(stream, n, 0.95)
    assert one.n_pending == waiting
    assert_matches_oracle(one, expected)
    assert_same_batch_data(one.sample(16), batch.sample(16))


@all_buffers
def test_one_at_a_time_equals_chunks_when_ring_wraps(cls) -> None:
    stream = make_stream(150, seed=4)
    one = cls(16, FIELDS, n_step=3, gamma=0.9, seed=2)
    chunks = cls(16, FIELDS, n_step=3, gamma=0.9, seed=2)
    for i in range(150):
        one.add(single(stream, i))
    for a in range(0, 150, 10):
        chunks.add(chunk(stream, a, a + 10))
    assert_same_state(snapshot(one), snapshot(chunks))
    expected, _ = naive_nstep(stream, 3, 0.9)
    assert_matches_oracle(chunks, expected)


@all_buffers
def test_ring_wraps_with_nstep(cls) -> None:
    stream = make_stream(200, seed=5)
    buf = cls(16, FIELDS, n_step=4, gamma=0.8, seed=0)
    for i in range(200):
        buf.add(single(stream, i))
    expected, _ = naive_nstep(stream, 4, 0.8)
    assert len(expected) > 16
    assert_matches_oracle(buf, expected)


# --------------------------------------------------------------------------- hand-made episodes


def _episode(rewards, terminated_at=None, truncated_at=None, start=0):
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
        "action": np.zeros(k, dtype=np.int64),
        "reward": np.asarray(rewards, dtype=np.float32),
        "next_obs": np.repeat(t[:, None] + 0.5, 3, axis=1),
        "terminated": term,
        "truncated": trunc,
    }


@all_buffers
def test_nothing_written_until_window_completes(cls) -> None:
    buf = cls(16, FIELDS, n_step=3, gamma=0.5, seed=0)
    ep = _episode([1.0, 2.0, 4.0, 8.0])
    for i in range(2):
        slots = buf.add(single(ep, i))
        assert slots.shape == (0,) and slots.dtype == np.int64
        assert len(buf) == 0
        assert buf.n_pending == i + 1
    np.testing.assert_array_equal(buf.add(single(ep, 2)), [0])
    assert len(buf) == 1 and buf.n_pending == 2
    rows = stored_rows(buf, 1)
    assert rows["reward"][0] == pytest.approx(1 + 0.5 * 2 + 0.25 * 4)
    np.testing.assert_array_equal(rows["obs"][0], [0, 0, 0])
    np.testing.assert_array_equal(rows["next_obs"][0], [2.5, 2.5, 2.5])
    assert rows["discount"][0] == pytest.approx(0.125)
    np.testing.assert_array_equal(buf.add(single(ep, 3)), [1])
    assert stored_rows(buf, 1)["reward"][0] == pytest.approx(2 + 0.5 * 4 + 0.25 * 8)


@all_buffers
def test_terminated_episode_flushes_partial_windows_without_bootstrap(cls) -> None:
    buf = cls(16, FIELDS, n_step=3, gamma=0.5, seed=0)
    ep = _episode([1.0, 2.0], terminated_at=1)
    buf.add(single(ep, 0))
    assert len(buf) == 0 and buf.n_pending == 1
    np.testing.assert_array_equal(buf.add(single(ep, 1)), [0, 1])
    assert buf.n_pending == 0
    rows = stored_rows(buf, 2)
    np.testing.assert_allclose(rows["reward"], [1 + 0.5 * 2, 2])
    np.testing.assert_array_equal(rows["discount"], [0.0, 0.0])
    np.testing.assert_array_equal(rows["next_obs"][:, 0], [1.5, 1.5])
    np.testing.assert_array_equal(rows["terminated"], [True, True])
    np.testing.assert_array_equal(rows["truncated"], [False, False])
    # the next episode does not see the previous one's rewards
    nxt = _episode([10.0, 20.0, 30.0], start=2)
    buf.add(nxt)
    rows = stored_rows(buf, 1)
    assert rows["reward"][0] == pytest.approx(10 + 0.5 * 20 + 0.25 * 30)
    assert rows["discount"][0] == pytest.approx(0.125)


@all_buffers
def test_truncated_episode_bootstraps(cls) -> None:
    buf = cls(16, FIELDS, n_step=4, gamma=0.9, seed=0)
    ep = _episode([1.0, 1.0, 1.0], truncated_at=2)
    np.testing.assert_array_equal(buf.add(ep), [0, 1, 2])
    rows = stored_rows(buf, 3)
    np.testing.assert_allclose(rows["reward"], [1 + 0.9 + 0.81, 1 + 0.9, 1], rtol=1e-6)
    np.testing.assert_allclose(rows["discount"], [0.9**3, 0.9**2, 0.9], rtol=1e-6)
    np.testing.assert_array_equal(rows["next_obs"][:, 0], [2.5, 2.5, 2.5])
    np.testing.assert_array_equal(rows["truncated"], [True, True, True])
    np.testing.assert_array_equal(rows["terminated"], [False, False, False])
    assert buf.n_pending == 0


@all_buffers
def test_terminated_and_truncated_together_is_terminal(cls) -> None:
    buf = cls(16, FIELDS, n_step=2, gamma=0.9, seed=0)
    ep = _episode([1.0, 2.0], terminated_at=1, truncated_at=1)
    buf.add(ep)
    np.testing.assert_array_equal(stored_rows(buf, 2)["discount"], [0.0, 0.0])


@all_buffers
def test_done_field_counts_as_termination(cls, fields) -> None:
    buf = cls(16, fields, n_step=3, gamma=0.5, seed=0)
    k = 5
    t = np.arange(k, dtype=np.float32)
    stream = {
        "obs": np.repeat(t[:, None], 4, axis=1),
        "action": np.zeros(k, dtype=np.int64),
        "reward": np.array([1, 2, 3, 4, 5], dtype=np.float32),
        "next_obs": np.repeat(t[:, None] + 1, 4, axis=1),
        "done": np.array([0, 1, 0, 0, 0], dtype=np.float32),
    }
    np.testing.assert_array_equal(buf.add(stream), [0, 1, 2])
    assert buf.n_pending == 2
    rows = stored_rows(buf, 3)
    np.testing.assert_allclose(rows["reward"], [1 + 0.5 * 2, 2, 3 + 0.5 * 4 + 0.25 * 5])
    np.testing.assert_allclose(rows["discount"], [0.0, 0.0, 0.125])
    np.testing.assert_array_equal(rows["done"], [1, 1, 0])
    np.testing.assert_array_equal(rows["next_obs"][:, 0], [2, 2, 5])
    expected, waiting = naive_nstep(stream, 3, 0.5, term="done", trunc=None)
    assert waiting == 2
    assert_matches_oracle(buf, expected)


def test_explicit_nstep_keys() -> None:
    fields = {
        "o": ((2,), np.float32),
        "r": ((), np.float64),
        "o2": ((2,), np.float32),
        "end": ((), np.bool_),
    }
    keys = {"reward_key": "r", "next_obs_key": "o2", "terminated_key": "end"}
    buf = ReplayBuffer(8, fields, n_step=2, gamma=0.5, nstep_keys=keys, seed=0)
    buf.add(
        {
            "o": np.zeros((3, 2)),
            "r": np.array([1.0, 2.0, 4.0]),
            "o2": np.array([[1, 1], [2, 2], [3, 3]]),
            "end": np.array([False, False, True]),
        }
    )
    assert len(buf) == 3 and buf.n_pending == 0
    rows = stored_rows(buf, 3)
    np.testing.assert_allclose(rows["r"], [2.0, 4.0, 4.0])
    np.testing.assert_allclose(rows["discount"], [0.25, 0.0, 0.0])
    np.testing.assert_array_equal(rows["o2"][:, 0], [2, 3, 3])


# --------------------------------------------------------------------------- errors


@all_buffers
def test_failed_nstep_add_keeps_pending_window(cls) -> None:
    stream = make_stream(40, seed=6, p_term=0.0, p_trunc=0.0)
    buf = cls(8, FIELDS, n_step=3, gamma=0.9, seed=0)
    twin = cls(8, FIELDS, n_step=3, gamma=0.9, seed=0)
    for b in (buf, twin):
        b.add(chunk(stream, 0, 5))
    assert buf.n_pending == 2
    before = snapshot(buf)
    with pytest.raises(ValueError, match="must not complete more than capacity=8"):
        buf.add(chunk(stream, 5, 20))  # would complete 15 transitions
    with pytest.raises(ValueError, match="cannot be given to add"):
        buf.add(chunk(stream, 5, 6), priorities=[1.0])
    with pytest.raises(ValueError, match="missing fields"):
        buf.add({k: v for k, v in single(stream, 5).items() if k != "reward"})
    with pytest.raises(ValueError, match="must not be empty"):
        buf.add(chunk(stream, 5, 5))
    with pytest.raises(TypeError, match="non-integral"):
        buf.add({**single(stream, 5), "action": 0.5})
    assert_same_state(before, snapshot(buf))
    for b in (buf, twin):
        b.add(chunk(stream, 5, 9))
    assert_same_state(snapshot(twin), snapshot(buf))
    assert_same_batch_data(buf.sample(5), twin.sample(5))


@all_buffers
def test_clear_drops_pending(cls) -> None:
    buf = cls(8, FIELDS, n_step=3, gamma=0.9, seed=0)
    buf.add(chunk(make_stream(4, seed=0, p_term=0.0, p_trunc=0.0), 0, 4))
    assert len(buf) == 2 and buf.n_pending == 2
    buf.clear()
    assert len(buf) == 0 and buf.n_pending == 0


@pytest.mark.parametrize(
    ("fields", "kwargs", "exc", "match"),
    [
        ({k: v for k, v in FIELDS.items() if k != "reward"}, {}, ValueError, "reward field"),
        ({k: v for k, v in FIELDS.items() if k != "next_obs"}, {}, ValueError, "next observation"),
        ({**FIELDS, "reward": ((), np.int64)}, {}, ValueError, "floating reward field"),
        ({**FIELDS, "discount": ((), np.float32)}, {}, ValueError, "reserved"),
        (FIELDS, {"n_step": 0}, ValueError, "`n_step` must be >= 1"),
        (FIELDS, {"n_step": 2.0}, TypeError, "`n_step` must be an integer"),
        (FIELDS, {"gamma": 1.01}, ValueError, "`gamma` must be <= 1"),
        (FIELDS, {"gamma": -0.1}, ValueError, "`gamma` must be >= 0"),
        (
            FIELDS,
            {"nstep_keys": {"terminated_key": "nope"}},
            ValueError,
            "`nope` is not among the fields",
        ),
    ],
)
@all_buffers
def test_bad_nstep_config(cls, fields, kwargs, exc, match) -> None:
    kw = {"n_step": 3, "gamma": 0.9, **kwargs}
    with pytest.raises(exc, match=match):
        cls(8, fields, **kw)


@all_buffers
def test_n_step_one_stores_plain_transitions(cls) -> None:
    buf = cls(8, FIELDS, n_step=1, seed=0)
    assert "discount" not in buf.fields
    stream = make_stream(5, seed=0)
    np.testing.assert_array_equal(buf.add(stream), np.arange(5))
    assert buf.n_pending == 0
    np.testing.assert_array_equal(stored_rows(buf, 5)["reward"], stream["reward"])
