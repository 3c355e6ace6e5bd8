"""Rate limiter: Reverb's arithmetic by hand, a deterministic simulation, threads with a time bound."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import fastper
from fastper.limiter import RateLimitedBuffer, RateLimiter, RateLimiterCancelled, RateLimitTimeout

FIELDS = {"obs": ((3,), np.float32), "reward": ((), np.float32)}


def rows(k: int, start: int = 0) -> dict[str, np.ndarray]:
    v = np.arange(start, start + k, dtype=np.float32)
    return {"obs": np.repeat(v[:, None], 3, axis=1), "reward": v}


def test_predicates_follow_reverbs_definition_by_hand() -> None:
    lim = RateLimiter(samples_per_insert=2.0, min_size_to_sample=3, error_buffer=4.0)
    assert (lim.min_diff, lim.max_diff) == (2.0, 10.0)  # 3 * 2 -/+ 4
    # stage 1: inserts free up to the minimum size, samples wait
    assert lim.can_insert(3, size=0) and not lim.can_sample(1, size=2)
    lim.record_insert(3)
    assert lim.diff == 6.0
    assert lim.can_sample(4, size=3)  # 6 - 4 = 2 >= min_diff
    assert not lim.can_sample(5, size=3)  # 6 - 5 = 1 < 2
    assert lim.can_insert(2, size=3)  # (3 + 2) * 2 - 0 = 10 <= 10
    assert not lim.can_insert(3, size=3)  # 12 > 10
    lim.record_sample(4)
    assert lim.diff == 2.0 and not lim.can_sample(1, size=3)
    assert lim.blocked_side(size=3) == "sample"
    lim.record_insert(4)  # diff 10
    assert lim.blocked_side(size=7) == "insert"


def test_min_size_limiter_only_gates_on_size() -> None:
    lim = RateLimiter.min_size(5)
    assert not lim.can_sample(1, size=4) and lim.can_sample(10**9, size=5)
    lim.record_insert(10**6)
    assert lim.can_insert(10**6, size=10**6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"samples_per_insert": 0.0}, "samples_per_insert"),
        ({"samples_per_insert": float("inf")}, "samples_per_insert"),
        ({"min_size_to_sample": 0}, "min_size_to_sample"),
        ({"samples_per_insert": 4.0, "error_buffer": 3.0}, "span at least"),
        ({"error_buffer": (5.0, 10.0), "min_size_to_sample": 2}, "lies above"),
        ({"error_buffer": (1.0, 2.0, 3.0)}, "pair"),
        ({"error_buffer": -1.0}, "error_buffer"),
    ],
)
def test_bad_settings_are_refused_with_their_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RateLimiter(**kwargs)


def test_a_range_below_the_offset_warns_of_blocked_inserts() -> None:
    with pytest.warns(UserWarning, match="inserts will wait"):
        RateLimiter(1.0, 100, error_buffer=(-10.0, 10.0))


@pytest.mark.parametrize("seed", range(6))
def test_simulated_actor_and_learner_hold_the_ratio_and_never_deadlock(seed: int) -> None:
    rng = np.random.default_rng(seed)
    spi = float(rng.choice([0.25, 1.0, 4.0, 8.0]))
    min_size = int(rng.integers(1, 200))
    batch = int(rng.choice([1, 16, 64]))
    error = float(batch + 2 * spi + rng.integers(0, 100))
    capacity = int(rng.integers(min_size, 4 * min_size + 300))
    lim = RateLimiter(spi, min_size, error)
    size = 0
    for _ in range(20_000):
        k = int(rng.integers(1, 5))  # an actor's step: 1-4 rows
        ins, smp = lim.can_insert(k, size), lim.can_sample(batch, size)
        ins1 = lim.can_insert(1, size)
        assert ins1 or smp, f"deadlock: {lim}"  # one side can always go on
        # a random scheduler: each side asks when it is its turn
        if rng.random() < 0.5:
            if ins:
                lim.record_insert(k)
                size = min(capacity, size + k)
        elif smp:
            lim.record_sample(batch)
        if size >= min_size:
            assert lim.min_diff <= lim.diff <= lim.max_diff
        else:
            assert lim.samples == 0
    # what the ratio means: samples = spi * (inserts after stage 1), within the error
    assert lim.samples > 0
    assert abs(lim.samples - spi * (lim.inserts - min_size)) <= error + spi * 4


def test_single_thread_loop_holds_samples_per_insert() -> None:
    buf = fastper.PrioritizedReplayBuffer(1000, FIELDS, seed=0)
    rb = RateLimitedBuffer(buf, RateLimiter(4.0, 50, error_buffer=40.0), timeout=0)
    for step in range(500):
        rb.add(rows(1, step))
        while rb.can_sample(8):
            batch = rb.sample(8)
            rb.update_priorities(batch.indices, np.ones(8), keys=batch.keys)
    assert rb.limiter.inserts == 500 and len(rb) == 500
    # 4 samples per insert after the first 50, to within the error buffer
    assert abs(rb.limiter.samples - 4.0 * 450) <= 40.0 + 8
    assert rb.stats["sample_waits"] == 0  # the loop asked first: nothing waited


def test_timeout_changes_nothing_not_even_the_generator() -> None:
    buf = fastper.PrioritizedReplayBuffer(100, FIELDS, seed=3)
    rb = RateLimitedBuffer(buf, RateLimiter(1.0, 10, error_buffer=5.0), timeout=0.05)
    rb.add(rows(5))
    twin = fastper.from_state_dict(buf.state_dict())
    t0 = time.monotonic()
    with pytest.raises(RateLimitTimeout, match="the actors must insert first"):
        rb.sample(2)
    assert time.monotonic() - t0 < 5.0
    assert (rb.limiter.inserts, rb.limiter.samples) == (5, 0) and buf.step == 0
    # the generator did not move: the next draws equal those of a copy made before
    np.testing.assert_array_equal(buf.sample(4).indices, twin.sample(4).indices)
    rb.add(rows(5, 5))  # ten in: the diff is 10, at most 15 - 10 = 5 more may come
    rb.add(rows(5, 10))
    with pytest.raises(RateLimitTimeout, match="the learner must sample first"):
        rb.add(rows(1, 15), timeout=0)
    assert len(buf) == 15 and rb.limiter.inserts == 15


def test_a_batch_the_range_can_never_admit_is_refused_at_once() -> None:
    rb = RateLimitedBuffer(
        fastper.ReplayBuffer(100, FIELDS), RateLimiter(1.0, 1, error_buffer=4.0), timeout=None
    )
    rb.add(rows(4))
    with pytest.raises(ValueError, match="never pass this rate limiter"):
        rb.sample(32)  # waiting would be for ever


def test_nstep_adds_count_the_windows_they_complete() -> None:
    fields = {**FIELDS, "next_obs": ((3,), np.float32), "terminated": ((), np.bool_),
              "truncated": ((), np.bool_)}  # fmt: skip
    buf = fastper.PrioritizedReplayBuffer(100, fields, n_step=3, gamma=0.9, seed=0)
    rb = RateLimitedBuffer(buf, RateLimiter.min_size(1))
    for t in range(5):
        r = rows(1, t)
        rb.add({"obs": r["obs"][0], "reward": r["reward"][0], "next_obs": r["obs"][0],
                "terminated": False, "truncated": t == 4})  # fmt: skip
    assert rb.limiter.inserts == len(buf) == 5  # 2 windows, then 3 flushed at the end


def test_threads_hold_the_ratio_and_finish_in_time() -> None:
    buf = fastper.PrioritizedReplayBuffer(5000, FIELDS, seed=1)
    spi, batch, error = 2.0, 16, 64.0
    rb = RateLimitedBuffer(buf, RateLimiter(spi, 100, error_buffer=error), timeout=20.0)
    errors: list[BaseException] = []
    violations: list[float] = []

    def actor(a: int) -> None:
        try:
            for i in range(600):
                rb.add(rows(2, 10_000 * a + 2 * i))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def learner() -> None:
        try:
            for _ in range(int(spi * (2 * 600 * 2 - 100) // batch)):
                b = rb.sample(batch)
                rb.update_priorities(b.indices, np.ones(batch), keys=b.keys)
                lim = rb.limiter
                if not lim.min_diff <= lim.diff <= lim.max_diff:
                    violations.append(lim.diff)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=actor, args=(a,)) for a in range(2)]
    threads.append(threading.Thread(target=learner))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60.0)
    assert not any(t.is_alive() for t in threads), "a thread is still blocked"
    assert time.monotonic() - t0 < 60.0
    assert not errors, errors
    assert not violations
    lim = rb.limiter
    assert lim.inserts == 2400
    assert abs(lim.samples - spi * (lim.inserts - 100)) <= error + batch
    s = rb.stats
    assert s["insert_waits"] + s["sample_waits"] > 0  # the faster side did wait


def test_cancel_wakes_a_blocked_call_and_refuses_later_ones() -> None:
    rb = RateLimitedBuffer(fastper.ReplayBuffer(10, FIELDS), RateLimiter.min_size(5))
    caught: list[BaseException] = []

    def learner() -> None:
        try:
            rb.sample(1)  # blocks: nothing inserted
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    t = threading.Thread(target=learner)
    t.start()
    time.sleep(0.2)
    assert t.is_alive()
    rb.cancel()
    t.join(timeout=10.0)
    assert not t.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], RateLimiterCancelled)
    with pytest.raises(RateLimiterCancelled):
        rb.add(rows(1))
    assert len(rb) == 0


def test_state_round_trip_keeps_the_counters() -> None:
    lim = RateLimiter(3.0, 7, error_buffer=(0.0, 50.0))
    lim.record_insert(11)
    lim.record_sample(5)
    back = RateLimiter.from_state_dict(lim.state_dict())
    assert back.state_dict() == lim.state_dict()
    unlimited = RateLimiter.from_state_dict(RateLimiter.min_size(2).state_dict())
    assert unlimited.can_insert(10**9, 10**9)
    with pytest.raises(ValueError, match="inserts"):
        RateLimiter.from_state_dict({"samples_per_insert": 1.0})


def test_wrapper_refuses_what_is_not_a_limiter_or_buffer() -> None:
    with pytest.raises(TypeError, match="limiter"):
        RateLimitedBuffer(fastper.ReplayBuffer(4, FIELDS), object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="buffer"):
        RateLimitedBuffer(object(), RateLimiter())
    with pytest.raises(ValueError, match="timeout"):
        RateLimitedBuffer(fastper.ReplayBuffer(4, FIELDS), RateLimiter(), timeout=-1)
