"""Dopamine's stacked, n-step prioritized replay against a reference of Dopamine's own code.

Dopamine's ``OutOfGraphPrioritizedReplayBuffer`` imports TensorFlow (and gin),
so it cannot be installed here; :class:`RefReplay` and :class:`RefSumTree`
restate, statement by statement, what Dopamine's NumPy code does
(``circular_replay_buffer.py``, ``prioritized_replay_buffer.py`` and
``sum_tree.py``): zero slots at each episode start, the cursor's invalid
range, terminals in a stack's history, episodes cut short in the n-step
window, n-step returns cut at a terminal, stacks read by slot, the draws of
``random`` in stratified sampling and the redraws of invalid indices. It is
slow (a Python loop per transition) and simple; fastper's buffer is compared
with it on random episodes that wrap the ring several times.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from scipy import stats

from fastper.compat.dopamine import (
    DopamineTypeError,
    OutOfGraphPrioritizedReplayBuffer,
    ReplayElement,
    SumTree,
)
from fastper.errors import InvalidIndexError

FRAME = (3, 2)


# ---------------------------------------------------------------------------
# the reference: Dopamine's NumPy code, restated
# ---------------------------------------------------------------------------


class RefSumTree:
    """Dopamine's NumPy sum tree: binary levels, delta updates, draws from ``source``."""

    def __init__(self, capacity: int, source: Any) -> None:
        depth = int(math.ceil(np.log2(capacity)))
        self.nodes = [np.zeros(2**d) for d in range(depth + 1)]
        self.source = source

    def set(self, index: int, value: float) -> None:
        delta = value - self.nodes[-1][index]
        for level in reversed(self.nodes):
            level[index] += delta
            index //= 2

    def get(self, index: int) -> float:
        return float(self.nodes[-1][index])

    def sample(self, query_value: float | None = None) -> int:
        assert self.nodes[0][0] != 0.0
        q = self.source.random() if query_value is None else query_value
        q *= self.nodes[0][0]
        node = 0
        for level in self.nodes[1:]:
            left = node * 2
            if q < level[left]:
                node = left
            else:
                node = left + 1
                q -= level[left]
        return node

    def stratified_sample(self, batch_size: int) -> list[int]:
        bounds = np.linspace(0.0, 1.0, batch_size + 1)
        queries = [self.source.uniform(bounds[i], bounds[i + 1]) for i in range(batch_size)]
        return [self.sample(query_value=q) for q in queries]


class RefReplay:
    """Dopamine's prioritized out-of-graph buffer (observation, action, reward, terminal)."""

    def __init__(self, stack: int, capacity: int, horizon: int, gamma: float, source: Any) -> None:
        self.k, self.cap, self.n, self.gamma = stack, capacity, horizon, gamma
        self.store = {
            "observation": np.zeros((capacity, *FRAME), np.uint8),
            "action": np.zeros(capacity, np.int32),
            "reward": np.zeros(capacity, np.float32),
            "terminal": np.zeros(capacity, np.uint8),
        }
        self.tree = RefSumTree(capacity, source)
        self.add_count = 0
        self.invalid_range = np.zeros(stack)
        self.discounts = np.array([math.pow(gamma, j) for j in range(horizon)], np.float32)
        self.episode_start = True
        self.episode_end_indices: set[int] = set()
        self.max_attempts = 1000

    def cursor(self) -> int:
        return self.add_count % self.cap

    def is_full(self) -> bool:
        return self.add_count >= self.cap

    def _write(self, obs: Any, action: Any, reward: Any, terminal: Any, priority: float) -> None:
        self.tree.set(self.cursor(), priority)
        c = self.cursor()
        self.store["observation"][c] = obs
        self.store["action"][c] = action
        self.store["reward"][c] = reward
        self.store["terminal"][c] = terminal
        self.add_count += 1
        self.invalid_range = np.array(
            [(self.cursor() - self.n + i) % self.cap for i in range(self.k + self.n)]
        )

    def add(self, obs: Any, action: Any, reward: Any, terminal: Any, priority: float,
            episode_end: bool = False) -> None:  # fmt: skip
        if self.episode_start:
            for _ in range(self.k - 1):
                self.episode_end_indices.discard(self.cursor())
                self._write(np.zeros(FRAME, np.uint8), 0, 0.0, 0, 0.0)
            self.episode_start = False
        if episode_end or terminal:
            self.episode_end_indices.add(self.cursor())
            self.episode_start = True
        else:
            self.episode_end_indices.discard(self.cursor())
        self._write(obs, action, reward, terminal, priority)

    def get_range(self, array: np.ndarray, start: int, end: int) -> np.ndarray:
        if not self.is_full():
            assert end <= self.cursor()
        if start % self.cap < end % self.cap:
            return array[start:end]
        return array[[(start + i) % self.cap for i in range(end - start)]]

    def get_observation_stack(self, index: int) -> np.ndarray:
        frames = self.get_range(self.store["observation"], index - self.k + 1, index + 1)
        return np.moveaxis(frames, 0, -1)

    def is_valid_transition(self, index: int) -> bool:
        if index < 0 or index >= self.cap:
            return False
        if not self.is_full():
            if index >= self.cursor() - self.n:
                return False
            if index < self.k - 1:
                return False
        if index in set(self.invalid_range):
            return False
        terminals = self.get_range(self.store["terminal"], index - self.k + 1, index + 1)
        if terminals[:-1].any():
            return False
        for j in range(self.n):
            i = (index + j) % self.cap
            if i in self.episode_end_indices and not self.store["terminal"][i]:
                return False
        return True

    def sample_index_batch(self, batch_size: int) -> list[int]:
        indices = self.tree.stratified_sample(batch_size)
        allowed = self.max_attempts
        for i in range(len(indices)):
            if not self.is_valid_transition(indices[i]):
                if allowed == 0:
                    raise RuntimeError("Max sample attempts")
                index = indices[i]
                while not self.is_valid_transition(index) and allowed > 0:
                    index = self.tree.sample()
                    allowed -= 1
                indices[i] = index
        return indices

    def sample_transition_batch(self, indices: list[int]) -> dict[str, np.ndarray]:
        out: dict[str, list[Any]] = {k: [] for k in
               ("state", "action", "reward", "next_state", "next_action", "next_reward",
                "terminal", "indices", "sampling_probabilities")}  # fmt: skip
        for index in indices:
            window = [(index + j) % self.cap for j in range(self.n)]
            terminals = self.store["terminal"][window]
            is_terminal = terminals.any()
            length = int(np.argmax(terminals.astype(bool), 0)) + 1 if is_terminal else self.n
            nxt = index + length
            rewards = self.get_range(self.store["reward"], index, nxt)
            out["state"].append(self.get_observation_stack(index))
            out["action"].append(self.store["action"][index])
            out["reward"].append(np.sum(self.discounts[:length] * rewards, axis=0))
            out["next_state"].append(self.get_observation_stack(nxt % self.cap))
            out["next_action"].append(self.store["action"][nxt % self.cap])
            out["next_reward"].append(self.store["reward"][nxt % self.cap])
            out["terminal"].append(is_terminal)
            out["indices"].append(index)
            out["sampling_probabilities"].append(self.tree.get(index))
        dtypes = {"state": np.uint8, "next_state": np.uint8, "action": np.int32,
                  "next_action": np.int32, "reward": np.float32, "next_reward": np.float32,
                  "terminal": np.uint8, "indices": np.int32,
                  "sampling_probabilities": np.float32}  # fmt: skip
        return {k: np.array(v, dtype=dtypes[k]).reshape(len(indices), *np.shape(v)[1:])
                for k, v in out.items()}  # fmt: skip


NAMES = ["state", "action", "reward", "next_state", "next_action", "next_reward", "terminal",
         "indices", "sampling_probabilities"]  # fmt: skip


def random_steps(rng: np.random.Generator, n: int, max_len: int) -> list[dict[str, Any]]:
    """``n`` adds: episodes of random lengths that end by a terminal, a timeout, or not at all."""
    steps: list[dict[str, Any]] = []
    left = int(rng.integers(1, max_len + 1))
    for _ in range(n):
        left -= 1
        end = left == 0
        kind = rng.integers(3) if end else -1  # 0: terminal, 1: timeout, 2: runs on
        steps.append({
            "obs": rng.integers(0, 256, FRAME, dtype=np.uint8),
            "action": int(rng.integers(0, 6)),
            "reward": np.float32(rng.normal()),
            "terminal": kind == 0,
            "episode_end": kind == 1,
            # some zero priorities; new transitions often get the maximum, as agents do
            "priority": float(rng.choice([0.0, rng.uniform(0.1, 3.0), 3.0])),
        })  # fmt: skip
        if end:
            left = int(rng.integers(1, max_len + 1))
    return steps


def pair(stack: int, capacity: int, horizon: int, gamma: float = 0.9):
    ours = OutOfGraphPrioritizedReplayBuffer(
        FRAME, stack, capacity, 8, update_horizon=horizon, gamma=gamma, rng=random
    )
    ref = RefReplay(stack, capacity, horizon, gamma, random)
    return ours, ref


def add_both(ours: OutOfGraphPrioritizedReplayBuffer, ref: RefReplay, step: dict[str, Any]) -> None:
    ours.add(step["obs"], step["action"], step["reward"], step["terminal"],
             priority=step["priority"], episode_end=step["episode_end"])  # fmt: skip
    ref.add(step["obs"], step["action"], step["reward"], step["terminal"], step["priority"],
            episode_end=step["episode_end"])  # fmt: skip


def assert_same_state(ours: OutOfGraphPrioritizedReplayBuffer, ref: RefReplay) -> None:
    cap = ref.cap
    assert ours.add_count == ref.add_count and ours.cursor() == ref.cursor()
    assert ours.is_full() == ref.is_full()
    assert set(ours.invalid_range.tolist()) == set(ref.invalid_range.tolist())
    assert ours.episode_end_indices == ref.episode_end_indices
    valid = [ours.is_valid_transition(i) for i in range(-1, cap + 1)]
    assert valid == [ref.is_valid_transition(i) for i in range(-1, cap + 1)]
    slots = np.arange(cap, dtype=np.int32)
    np.testing.assert_array_equal(
        ours.get_priority(slots), np.array([ref.tree.get(i) for i in slots], np.float32)
    )
    written = cap if ref.is_full() else ref.cursor()
    for i in range(ref.k - 1, written):
        np.testing.assert_array_equal(ours.get_observation_stack(i), ref.get_observation_stack(i))
    idx = [i for i in range(cap) if ref.is_valid_transition(i)]
    if not idx:
        return
    got = ours.sample_transition_batch(indices=np.array(idx))
    want = ref.sample_transition_batch(idx)
    assert len(got) == len(NAMES)
    for name, array in zip(NAMES, got, strict=True):
        assert array.dtype == want[name].dtype, name
        np.testing.assert_array_equal(array, want[name], err_msg=name)


# ---------------------------------------------------------------------------
# the buffer against the reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stack", "capacity", "horizon", "max_len"),
    [(4, 23, 1, 9), (4, 17, 3, 6), (1, 10, 1, 5), (2, 13, 5, 4), (3, 9, 2, 3), (4, 40, 3, 30)],
)
def test_matches_dopamine_on_random_episodes(stack: int, capacity: int, horizon: int,
                                             max_len: int) -> None:  # fmt: skip
    rng = np.random.default_rng(1000 * stack + capacity + horizon)
    ours, ref = pair(stack, capacity, horizon)
    steps = random_steps(rng, 4 * capacity, max_len)  # with padding: the ring wraps > 4 times
    for t, step in enumerate(steps):
        add_both(ours, ref, step)
        if t % 3 == 0 or t >= len(steps) - 3:
            assert_same_state(ours, ref)
    assert ours.add_count >= 4 * capacity and ours.is_full()


@pytest.mark.parametrize(("stack", "horizon"), [(4, 1), (4, 3), (1, 1), (2, 4)])
def test_seeded_random_gives_dopamines_indices(stack: int, horizon: int) -> None:
    """With ``rng=random``, ``random.seed(s)`` gives the indices Dopamine draws, redraws included."""
    capacity = 31
    rng = np.random.default_rng(7 + stack + horizon)
    ours, ref = pair(stack, capacity, horizon)
    redraws = 0
    for t, step in enumerate(random_steps(rng, 3 * capacity, 7)):
        add_both(ours, ref, step)
        if ref.add_count <= stack + horizon or ref.tree.nodes[0][0] == 0.0:
            continue
        if ours.sum_tree.root == 0.0 or (not ref.is_full() and ref.cursor() - horizon <= stack - 1):
            continue
        for seed in (t, t + 10_000):
            random.seed(seed)
            try:
                want: list[int] | None = ref.sample_index_batch(16)
            except RuntimeError:
                want = None
            after = random.getstate()
            random.seed(seed)
            if want is None:
                with pytest.raises(RuntimeError):
                    ours.sample_index_batch(16)
                continue
            got = ours.sample_index_batch(16)
            assert got.dtype == np.int32
            assert got.tolist() == want
            assert random.getstate() == after  # the same number of draws, no more
            random.seed(seed)
            first = ref.tree.stratified_sample(16)
            redraws += sum(a != b for a, b in zip(first, want, strict=True))
    assert redraws > 0  # the redraw path was compared too


def test_sum_tree_draws_match_dopamine_with_seeded_random() -> None:
    capacity = 50
    rng = np.random.default_rng(3)
    values = rng.uniform(0.0, 4.0, capacity)
    values[rng.integers(0, capacity, 10)] = 0.0
    for source in (random, random.Random(11)):
        tree = SumTree(capacity, rng=source)
        ref = RefSumTree(capacity, source)
        for i, v in enumerate(values):
            tree.set(i, float(v))
            ref.set(i, float(v))
        for seed in range(20):
            source.seed(seed)
            want = ref.stratified_sample(32) + [ref.sample() for _ in range(5)]
            after = source.getstate()
            source.seed(seed)
            got = tree.stratified_sample(32) + [tree.sample() for _ in range(5)]
            assert got == want
            assert source.getstate() == after


def test_a_failed_sample_leaves_random_alone() -> None:
    buf = OutOfGraphPrioritizedReplayBuffer(FRAME, 4, 12, 4, max_sample_attempts=3, rng=random)
    frame = np.zeros(FRAME, np.uint8)
    for _ in range(6):
        buf.add(frame, 0, 0.0, False, priority=0.0)
    newest = np.array([buf.cursor() - 1], dtype=np.int32)
    buf.set_priority(newest, np.array([1.0]))  # mass only on an invalid slot
    random.seed(5)
    before = random.getstate()
    with pytest.raises(RuntimeError, match="Max sample attempts"):
        buf.sample_index_batch(4)
    assert random.getstate() == before


# ---------------------------------------------------------------------------
# memory, shapes and dtypes
# ---------------------------------------------------------------------------


def test_one_frame_stored_per_slot_whatever_the_stack() -> None:
    def nbytes(stack: int) -> int:
        return OutOfGraphPrioritizedReplayBuffer((84, 84), stack, 1000, 32).nbytes()

    assert nbytes(4) == nbytes(1)
    # an 84x84 frame, int32 action, float32 reward, uint8 terminal, episode-end flag
    assert nbytes(4) == 1000 * (84 * 84 + 4 + 4 + 1 + 1)


def test_atari_shapes_and_dtypes() -> None:
    buf = OutOfGraphPrioritizedReplayBuffer((84, 84), 4, 200, 32, update_horizon=3, rng=0)
    elements = {e.name: e for e in buf.get_transition_elements()}
    assert elements["state"].shape == (32, 84, 84, 4)
    rng = np.random.default_rng(0)
    for t in range(60):
        frame = rng.integers(0, 256, (84, 84), dtype=np.uint8)
        buf.add(frame, t % 6, 1.0, t % 25 == 24, priority=buf.sum_tree.max_recorded_priority)
    batch = buf.sample_transition_batch()
    for element, array in zip(buf.get_transition_elements(), batch, strict=True):
        assert array.shape == element.shape and array.dtype == np.dtype(element.type)
        assert array.flags.c_contiguous
    assert buf.add_count == 60 + 3 * 3  # three episode starts, 3 zero slots each


def test_a_stacked_observation_is_refused_with_the_reason() -> None:
    buf = OutOfGraphPrioritizedReplayBuffer((8, 8), 4, 50, 4, rng=0)
    with pytest.raises(ValueError, match=r"must have shape \(8, 8\) \(one frame.*stack_size=4"):
        buf.add(np.zeros((8, 8, 4), np.uint8), 0, 0.0, False, priority=1.0)
    assert buf.add_count == 0 and buf.sum_tree.root == 0.0


def test_indices_must_be_int32_as_in_dopamine() -> None:
    buf = OutOfGraphPrioritizedReplayBuffer((2,), 1, 10, 4, observation_dtype=np.float32, rng=0)
    for i in range(5):
        buf.add(np.full(2, i, np.float32), 0, 0.0, False, priority=1.0)
    root = buf.sum_tree.root
    for bad in (np.array([1, 2]), np.array([1, 2], np.int64), np.array([1, 2], np.uint32), [1, 2]):
        with pytest.raises(
            DopamineTypeError, match=r"int32 array.*dtype (int64|uint32).*np\.asarray"
        ):
            buf.set_priority(bad, np.array([5.0, 5.0]))
        with pytest.raises(AssertionError):  # what Dopamine raises
            buf.get_priority(bad)
    assert buf.sum_tree.root == root
    assert buf.get_priority(np.array([1, 2], np.int32)).tolist() == [1.0, 1.0]
    sampled = buf.sample_transition_batch(batch_size=3)[7]
    assert sampled.dtype == np.int32
    buf.set_priority(sampled, np.full(3, 2.0))  # the batch's own indices work as they are
    assert buf.get_priority(sampled).tolist() == [2.0] * 3


def test_stacks_and_windows_of_a_short_run_by_hand() -> None:
    """Two episodes with stack_size=2, update_horizon=2, read off by hand."""
    buf = OutOfGraphPrioritizedReplayBuffer((1,), 2, 20, 4, update_horizon=2, gamma=0.5,
                                            observation_dtype=np.float32, rng=0)  # fmt: skip
    for t, term in enumerate([False, False, True, False, False, False]):
        buf.add(np.array([t + 1.0], np.float32), t, float(t + 1), term, priority=1.0)
    # slots: 0 pad, 1..3 episode one (3 terminal), 4 pad, 5..7 episode two
    assert buf.add_count == 8
    assert buf.get_observation_stack(1).tolist() == [[0.0, 1.0]]
    assert buf.get_observation_stack(5).tolist() == [[0.0, 4.0]]
    valid = [i for i in range(20) if buf.is_valid_transition(i)]
    # 0: no full stack; 4: its history holds the terminal; 6, 7: within update_horizon of the cursor
    assert valid == [1, 2, 3, 5]
    state, action, reward, nxt, _, _, terminal, *_ = buf.sample_transition_batch(
        indices=np.array(valid)
    )
    np.testing.assert_array_equal(reward, [1 + 0.5 * 2, 2 + 0.5 * 3, 3, 4 + 0.5 * 5])
    np.testing.assert_array_equal(terminal, [0, 1, 1, 0])
    # after a terminal, next_state is what the ring holds there (here the terminal's frame
    # and the next episode's zero slot): Dopamine's agents mask it with `terminal`
    np.testing.assert_array_equal(nxt[:, 0, :], [[2, 3], [3, 0], [3, 0], [5, 6]])
    with pytest.raises(InvalidIndexError, match="valid transitions"):
        buf.sample_transition_batch(indices=[4])
    with pytest.raises(InvalidIndexError):
        buf.get_observation_stack(8)  # never written


def test_signatures_as_in_dopamine() -> None:
    buf = OutOfGraphPrioritizedReplayBuffer(
        (84, 84), 4, 100, 32, extra_storage_types=[ReplayElement("logp", (), np.float32)]
    )
    names = [(e.name, tuple(e.shape), np.dtype(e.type)) for e in buf.get_add_args_signature()]
    assert names == [("observation", (84, 84), np.uint8), ("action", (), np.int32),
                     ("reward", (), np.float32), ("terminal", (), np.uint8),
                     ("logp", (), np.float32), ("priority", (), np.float32)]  # fmt: skip
    assert buf.get_storage_signature() == buf.get_add_args_signature()[:-1]


def test_extras_with_stacks() -> None:
    buf = OutOfGraphPrioritizedReplayBuffer(
        (2, 2), 3, 30, 2, extra_storage_types=[ReplayElement("logp", (), np.float32)], rng=0
    )
    for t in range(8):
        buf.add(np.full((2, 2), t, np.uint8), t, 0.0, False, np.float32(-t), priority=1.0)
    batch = buf.sample_transition_batch(indices=np.array([4, 5]))  # slots 0, 1 pad
    np.testing.assert_array_equal(batch[8], [-2.0, -3.0])
    np.testing.assert_array_equal(batch[0][:, 0, 0, :], [[0, 1, 2], [1, 2, 3]])


def test_stacked_sampling_frequencies_follow_priorities() -> None:
    """Valid slots are drawn in proportion to their priorities (chi-square, fixed seed)."""
    capacity = 40
    buf = OutOfGraphPrioritizedReplayBuffer(FRAME, 4, capacity, 64, update_horizon=3, rng=2024)
    rng = np.random.default_rng(2024)
    for step in random_steps(rng, 70, 9):  # full and wrapped, several episodes
        buf.add(step["obs"], step["action"], step["reward"], step["terminal"],
                priority=float(rng.uniform(0.2, 3.0)), episode_end=step["episode_end"])  # fmt: skip
    assert buf.is_full()
    slots = np.arange(capacity, dtype=np.int32)
    valid = np.array([buf.is_valid_transition(i) for i in slots])
    priority = buf.get_priority(slots).astype(np.float64)
    draws = np.concatenate([buf.sample_index_batch(64) for _ in range(150)])
    counts = np.bincount(draws, minlength=capacity)
    assert counts[~valid].sum() == 0
    keep = valid & (priority > 0)
    # Dopamine's redraws of invalid slots come from the whole tree, so the valid
    # slots keep their relative priorities: P(i) = p_i / sum over valid p_j
    expected = priority[keep] / priority[keep].sum() * counts[keep].sum()
    assert stats.chisquare(counts[keep], expected).pvalue > 1e-4
