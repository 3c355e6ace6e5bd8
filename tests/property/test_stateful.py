"""Stateful property tests: each buffer kind driven against a pure-Python model.

The model is a list of slots ``[key, payload, raw priority]`` filled as a FIFO
ring (the k-th add since the last clear goes to slot ``k % capacity``), a key
counter that keeps counting across ``clear``, ``max_priority`` (starts at 1.0,
never decreases), the stale-update counter and alpha. Every rule checks the
buffer's answer against the model and every step checks the whole state.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import fastper
from fastper import (
    EmptyBufferError,
    InvalidIndexError,
    PrioritizedReplayBuffer,
    RankBasedReplayBuffer,
    ReplayBuffer,
    SampleBatch,
    ZeroPriorityError,
)
from tests.oracles import assert_same_state, proportional_probs, rank_probs, snapshot

FIELDS = {"tag": ((), np.int64), "obs": ((2,), np.float32)}
EPS = 1e-3
CLIP = 5.0
ALPHA0 = 0.6
BETA0 = 0.5
MAX_BATCH = 12

PRIORITY = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.5]),
    st.floats(min_value=1e-6, max_value=20.0, allow_nan=False, allow_infinity=False),
)
TD = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -3.0, 5.0, -12.0]),
    st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False),
)

STATEFUL_SETTINGS = settings(max_examples=100, stateful_step_count=35, deadline=None)


def payload(key: int) -> int:
    """The payload stored with the transition of key ``key`` (distinct from the key)."""
    return 3 * key + 1


def transitions(keys: list[int], single: bool) -> dict[str, np.ndarray]:
    tag = np.array([payload(k) for k in keys], dtype=np.int64)
    obs = np.array([[k, -k] for k in keys], dtype=np.float32).reshape(len(keys), 2)
    if single:
        return {"tag": tag[0], "obs": obs[0]}
    return {"tag": tag, "obs": obs}


class BufferMachine(RuleBasedStateMachine):
    """Drives one buffer (``buffer_cls``) against the model."""

    buffer_cls: ClassVar[type] = ReplayBuffer
    batches = Bundle("batches")

    def __init__(self) -> None:
        super().__init__()
        self.buf: Any = None

    # -- model helpers -----------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.buffer_cls.kind

    def model_keys(self) -> np.ndarray:
        return np.array([s[0] for s in self.slots], dtype=np.int64)

    def model_payloads(self) -> np.ndarray:
        return np.array([s[1] for s in self.slots], dtype=np.int64)

    def model_raw(self) -> np.ndarray:
        return np.array([s[2] for s in self.slots], dtype=np.float64)

    def model_probs(self) -> np.ndarray:
        """P(i) of every stored slot (a zero priority is never drawn, even with alpha 0)."""
        raw = self.model_raw()
        n = raw.shape[0]
        if self.kind == "uniform":
            return np.full(n, 1.0 / n)
        if self.kind == "rank":
            return rank_probs(raw, self.alpha)
        probs = np.zeros(n)
        pos = raw > 0
        probs[pos] = proportional_probs(raw[pos], self.alpha)
        return probs

    def model_sampleable(self) -> bool:
        if self.buf is None or not self.slots:
            return False
        return self.kind != "proportional" or any(s[2] > 0 for s in self.slots)

    def expected_error(self) -> type[Exception]:
        return ZeroPriorityError if self.slots else EmptyBufferError

    def model_add(self, k: int, prios: list[float] | None) -> np.ndarray:
        slots = []
        for j in range(k):
            s = (self.since_clear + j) % self.capacity
            key = self.next_key + j
            # new items get the largest priority ever recorded, within clip (+ eps)
            new_p = min(self.max_p, CLIP + EPS)
            entry = [key, payload(key), new_p if prios is None else float(prios[j])]
            if s == len(self.slots):
                self.slots.append(entry)
            else:
                self.slots[s] = entry
            slots.append(s)
        if prios is not None:
            self.max_p = max(self.max_p, max(float(p) for p in prios))
        self.since_clear += k
        self.next_key += k
        return np.array(slots, dtype=np.int64)

    def check_batch(self, batch: SampleBatch, b: int, beta: float | None) -> None:
        n = len(self.slots)
        idx = batch.indices
        assert idx.dtype == np.int64 and idx.shape == (b,)
        assert len(batch) == b
        assert ((idx >= 0) & (idx < n)).all(), (idx, n)
        np.testing.assert_array_equal(batch.keys, self.model_keys()[idx])
        np.testing.assert_array_equal(batch.data["tag"], self.model_payloads()[idx])
        keys = self.model_keys()[idx].astype(np.float32)
        np.testing.assert_array_equal(batch.data["obs"], np.stack([keys, -keys], axis=1))
        probs = self.model_probs()
        assert (probs[idx] > 0).all(), "drew a slot with zero probability"
        np.testing.assert_allclose(batch.probabilities, probs[idx], rtol=1e-9, atol=0)
        eff_beta = BETA0 if beta is None else beta
        base = np.power(n * probs[probs > 0], -eff_beta)
        expected = np.power(n * probs[idx], -eff_beta) / base.max()
        np.testing.assert_allclose(batch.weights, expected, rtol=1e-9, atol=0)
        if self.kind == "uniform":
            assert (batch.weights == 1.0).all()
        # the per-slot query agrees with the model too
        np.testing.assert_allclose(self.buf.probabilities(np.arange(n)), probs, rtol=1e-9, atol=0)

    # -- rules -------------------------------------------------------------------
    @initialize(
        capacity=st.integers(min_value=1, max_value=9),
        stratified=st.booleans(),
        seed=st.integers(min_value=0, max_value=2**32 - 1),
    )
    def setup(self, capacity: int, stratified: bool, seed: int) -> None:
        alpha = {} if self.buffer_cls is fastper.ReplayBuffer else {"alpha": ALPHA0}
        self.buf = self.buffer_cls(
            capacity,
            FIELDS,
            **alpha,
            beta=BETA0,
            eps=EPS,
            clip=CLIP,
            stratified=stratified,
            seed=seed,
        )
        self.capacity = capacity
        self.slots: list[list[Any]] = []
        self.since_clear = 0
        self.next_key = 0
        self.max_p = 1.0
        self.stale = 0
        self.alpha = self.buf.alpha  # uniform replay keeps alpha 1 (it refuses one given)

    @rule(prio=st.one_of(st.none(), PRIORITY), scalar=st.booleans())
    def add_one(self, prio: float | None, scalar: bool) -> None:
        trans = transitions([self.next_key], single=True)
        arg = None if prio is None else (prio if scalar else [prio])
        got = self.buf.add(trans, priorities=arg)
        expected = self.model_add(1, None if prio is None else [prio])
        np.testing.assert_array_equal(got, expected)

    @rule(
        size=st.integers(min_value=1, max_value=9),
        prios=st.one_of(
            st.none(),
            st.lists(PRIORITY, min_size=9, max_size=9),
            st.just([0.0] * 9),  # all-zero: the proportional buffer may refuse to sample
        ),
    )
    def add_batch(self, size: int, prios: list[float] | None) -> None:
        k = 1 + (size - 1) % self.capacity
        trans = transitions(list(range(self.next_key, self.next_key + k)), single=False)
        p = None if prios is None else prios[:k]
        got = self.buf.add(trans, priorities=None if p is None else np.array(p))
        expected = self.model_add(k, p)
        np.testing.assert_array_equal(got, expected)

    @precondition(lambda self: self.model_sampleable())
    @rule(
        target=batches,
        b=st.integers(min_value=1, max_value=MAX_BATCH),
        beta=st.sampled_from([None, 0.0, 0.4, 1.0]),
    )
    def sample(self, b: int, beta: float | None) -> SampleBatch:
        batch = self.buf.sample(b, beta=beta)
        self.check_batch(batch, b, beta)
        return batch

    @precondition(lambda self: self.buf is not None and not self.model_sampleable())
    @rule(b=st.integers(min_value=1, max_value=MAX_BATCH), round_trip=st.booleans())
    def sample_refused(self, b: int, round_trip: bool) -> None:
        """Empty (or, proportional, all-zero) buffer: sample raises and changes nothing."""
        before = snapshot(self.buf)
        with pytest.raises(self.expected_error()):
            self.buf.sample(b)
        assert_same_state(before, snapshot(self.buf))
        if round_trip:
            loaded = self.round_trip()
            with pytest.raises(self.expected_error()):
                loaded.sample(b)
            self.buf = loaded

    @rule(
        batch=batches,
        tds=st.lists(TD, min_size=MAX_BATCH, max_size=MAX_BATCH),
        use_keys=st.booleans(),
    )
    def update(self, batch: SampleBatch, tds: list[float], use_keys: bool) -> None:
        idx = batch.indices
        td = np.array(tds[: len(batch)], dtype=np.float64)
        keys = batch.keys if use_keys else None
        n = len(self.slots)
        if (idx >= n).any():  # slots emptied by a clear since the batch was drawn
            before = snapshot(self.buf)
            with pytest.raises(InvalidIndexError):
                self.buf.update_priorities(idx, td, keys=keys)
            assert_same_state(before, snapshot(self.buf))
            return
        current = self.model_keys()
        kept = stale = 0
        pmax = 0.0
        new: dict[int, float] = {}
        for j in range(len(batch)):
            i = int(idx[j])
            if keys is not None and int(keys[j]) != int(current[i]):
                stale += 1
                continue
            p = min(abs(float(td[j])), CLIP) + EPS
            new[i] = p  # last duplicate wins
            kept += 1
            pmax = max(pmax, p)
        got = self.buf.update_priorities(idx, td, keys=keys)
        assert got == kept
        for i, p in new.items():
            self.slots[i][2] = p
        self.stale += stale
        if kept:
            self.max_p = max(self.max_p, pmax)
        assert self.buf.stale_updates == self.stale

    @rule(alpha=st.sampled_from([0.0, 0.5, 1.0]))
    def set_alpha(self, alpha: float) -> None:
        self.buf.set_alpha(alpha)
        self.alpha = alpha
        assert self.buf.alpha == alpha

    def round_trip(self) -> Any:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "buffer.fpk")
            self.buf.save(path)
            loaded = fastper.load(path)
        assert type(loaded) is type(self.buf)
        return loaded

    @precondition(lambda self: self.model_sampleable())
    @rule(target=batches, b=st.integers(min_value=1, max_value=MAX_BATCH))
    def save_load(self, b: int) -> SampleBatch:
        loaded = self.round_trip()
        want = self.buf.sample(b)
        got = loaded.sample(b)
        assert got.indices.tobytes() == want.indices.tobytes()
        assert got.keys.tobytes() == want.keys.tobytes()
        assert got.probabilities.tobytes() == want.probabilities.tobytes()
        assert got.weights.tobytes() == want.weights.tobytes()
        for name in FIELDS:
            assert got.data[name].tobytes() == want.data[name].tobytes()
        self.buf = loaded
        self.check_batch(got, b, None)
        return got

    @rule()
    def clear(self) -> None:
        self.buf.clear()
        self.slots = []
        self.since_clear = 0

    @rule(
        bad=st.sampled_from(["nan", "inf", "negative", "beyond", "unwritten", "add"]),
        pos=st.integers(min_value=0, max_value=4),
        use_keys=st.booleans(),
    )
    def invalid_call(self, bad: str, pos: int, use_keys: bool) -> None:
        n = len(self.slots)
        if bad in ("nan", "inf") and n == 0:
            bad = "beyond"
        if bad == "unwritten" and n == self.capacity:
            bad = "negative"
        before = snapshot(self.buf)
        before_p = self.buf.priorities(np.arange(n))
        before_k = self.buf.keys(np.arange(n))
        if bad == "add":
            trans = transitions([self.next_key], single=False)
            with pytest.raises(ValueError):
                self.buf.add(trans, priorities=[-1.0 if pos % 2 else math.nan])
        else:
            idx = [j % n for j in range(pos)] if n else []
            td = [1.5] * len(idx)
            bad_i = {"beyond": self.capacity + pos, "negative": -1 - pos, "unwritten": n}
            idx.insert(pos // 2 if idx else 0, bad_i.get(bad, 0))
            td.insert(pos // 2 if td else 0, math.nan if bad == "nan" else 1.5)
            if bad == "inf":
                td[pos // 2 if len(td) > 1 else 0] = -math.inf
            keys = None
            if use_keys:
                cur = self.model_keys()
                keys = [int(cur[i]) if 0 <= i < n else 0 for i in idx]
            err = ValueError if bad in ("nan", "inf") else InvalidIndexError
            with pytest.raises(err):
                self.buf.update_priorities(np.array(idx, dtype=np.int64), td, keys=keys)
            if err is InvalidIndexError:
                bad_idx = [bad_i[bad]]
                for query in (self.buf.priorities, self.buf.keys, self.buf.probabilities):
                    with pytest.raises(InvalidIndexError):
                        query(bad_idx)
        assert_same_state(before, snapshot(self.buf))
        assert len(self.buf) == n
        assert self.buf.priorities(np.arange(n)).tobytes() == before_p.tobytes()
        assert self.buf.keys(np.arange(n)).tobytes() == before_k.tobytes()

    # -- invariants ----------------------------------------------------------------
    @precondition(lambda self: self.buf is not None)
    @invariant()
    def matches_model(self) -> None:
        n = len(self.slots)
        assert len(self.buf) == n
        assert self.buf.capacity == self.capacity
        raw = self.model_raw()
        assert self.buf.priorities(np.arange(n)).tobytes() == raw.tobytes()
        np.testing.assert_array_equal(self.buf.keys(np.arange(n)), self.model_keys())
        assert self.buf.max_priority_ever == self.max_p
        assert self.buf.max_priority == min(self.max_p, CLIP + EPS)
        assert self.buf.total_added == self.next_key
        assert self.buf.stale_updates == self.stale
        assert self.buf.alpha == self.alpha
        if self.kind == "proportional":
            expected = math.fsum(float(p) ** self.alpha for p in raw if p > 0)
            total = self.buf._sampler.total
            assert math.isclose(total, expected, rel_tol=1e-9, abs_tol=0.0), (total, expected)


class UniformMachine(BufferMachine):
    buffer_cls = ReplayBuffer


class ProportionalMachine(BufferMachine):
    buffer_cls = PrioritizedReplayBuffer


class RankMachine(BufferMachine):
    buffer_cls = RankBasedReplayBuffer


TestUniformStateful = UniformMachine.TestCase
TestUniformStateful.settings = STATEFUL_SETTINGS
TestProportionalStateful = ProportionalMachine.TestCase
TestProportionalStateful.settings = STATEFUL_SETTINGS
TestRankStateful = RankMachine.TestCase
TestRankStateful.settings = STATEFUL_SETTINGS
