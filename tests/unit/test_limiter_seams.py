"""The rate limiter's seams: impossible settings, the lock around reads, batch sizes, torch keys.

A stub buffer with ``draw`` / ``gather`` (the two halves of a sample) checks
that :class:`RateLimitedBuffer` draws under its lock and reads the rows after
releasing it, and that rows overwritten between the two are drawn again.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import fastper
from fastper.batch import Gathered, SampleBatch, check_batch_size, max_batch_size
from fastper.limiter import RateLimitedBuffer, RateLimiter, RateLimitTimeout

FIELDS = {"obs": ((3,), np.float32), "reward": ((), np.float32)}


def rows(k: int, start: int = 0) -> dict[str, np.ndarray]:
    v = np.arange(start, start + k, dtype=np.float32)
    return {"obs": np.repeat(v[:, None], 3, axis=1), "reward": v}


class SplitBuffer:
    """A ring of ``capacity`` slots holding each transition's key as its row.

    ``draw`` and ``add`` hold the buffer's lock; ``gather`` waits on ``gate``
    (when set) before it takes the lock and reads, and reports as stale the
    rows whose slot was overwritten since the draw (or, while ``stale_reads``
    > 0, every row). ``sample`` is draw + gather in one call, as a buffer
    without the two halves would sample.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.fields = {"x": fastper.storage.Field((), np.dtype(np.int64))}
        self.lock = threading.Lock()
        self.store = np.full(capacity, -1, dtype=np.int64)
        self.added = 0
        self.rng = np.random.default_rng(0)
        self.gate: threading.Event | None = None
        self.reading = threading.Event()
        self.stale_reads = 0
        self.fail_reads = 0
        self.draws: list[int] = []

    def __len__(self) -> int:
        return min(self.added, self.capacity)

    def _keys(self, idx: np.ndarray) -> np.ndarray:
        last = self.added - 1
        return last - (last - idx) % self.capacity

    def add(self, transition: Any, priorities: Any = None, *, env_ids: Any = None) -> np.ndarray:
        with self.lock:
            k = int(np.size(transition["x"]))
            keys = self.added + np.arange(k)
            self.store[keys % self.capacity] = keys
            self.added += k
            return keys % self.capacity

    def draw(self, batch_size: int, beta: float | None = None) -> SampleBatch:
        with self.lock:
            n = len(self)
            idx = self.rng.integers(0, n, batch_size)
            self.draws.append(batch_size)
            b = float(0.4 if beta is None else beta)
            ones = np.ones(batch_size)
            return SampleBatch(
                data={}, indices=idx, weights=ones * b, probabilities=ones / n, keys=self._keys(idx)
            )

    def gather(self, indices: np.ndarray, keys: np.ndarray) -> Gathered:
        self.reading.set()
        if self.gate is not None:
            assert self.gate.wait(20.0), "the test never opened the gate"
        if self.fail_reads:
            self.fail_reads -= 1
            raise OSError("disk read failed")
        with self.lock:
            fresh = self._keys(indices) == keys
            if self.stale_reads:
                self.stale_reads -= 1
                fresh[:] = False
            return Gathered({"x": self.store[indices].copy()}, fresh)

    def sample(self, batch_size: int, beta: float | None = None) -> fastper.SampleBatch:
        d = self.draw(batch_size, beta)
        data, _ = self.gather(d.indices, d.keys)
        return fastper.SampleBatch(data, d.indices, d.weights, d.probabilities, d.keys)


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# -- 1. impossible settings are refused, not waited on -----------------------------
def test_defect_min_size_above_capacity_is_refused_at_construction() -> None:
    with pytest.raises(
        ValueError, match=r"`min_size_to_sample` must be <= the buffer's capacity 10"
    ):
        RateLimitedBuffer(fastper.ReplayBuffer(10, FIELDS), RateLimiter.min_size(11))
    RateLimitedBuffer(fastper.ReplayBuffer(10, FIELDS), RateLimiter.min_size(10))  # fits


def test_defect_min_size_above_capacity_is_refused_when_attached() -> None:
    rb = RateLimitedBuffer(fastper.ReplayBuffer(100, FIELDS), RateLimiter.min_size(50))
    small = fastper.ReplayBuffer(20, FIELDS)
    with pytest.raises(ValueError, match="capacity 20, got min_size_to_sample=50"):
        rb.buffer = small
    with pytest.raises(ValueError, match="capacity 100, got min_size_to_sample=101"):
        rb.limiter = RateLimiter.min_size(101)
    assert rb.buffer.capacity == 100 and rb.limiter.min_size_to_sample == 50  # unchanged
    rb.limiter = RateLimiter.min_size(20)
    rb.buffer = small
    assert rb.buffer is small and len(rb) == 0


def test_defect_insert_batch_wider_than_the_range_is_refused() -> None:
    buf = fastper.ReplayBuffer(100, FIELDS)
    # range [-1, 3]: 8 inserts add 8 to the diff, and samples never take it below -1
    rb = RateLimitedBuffer(buf, RateLimiter(1.0, 1, error_buffer=2.0), timeout=5.0)
    with pytest.raises(ValueError, match="a batch of 8 inserts can never pass.*width 4"):
        rb.add(rows(8))
    assert len(buf) == 0 and rb.limiter.inserts == 0
    rb.add(rows(3))  # fits the range now: passes


# -- 3. the draw is made under the lock, the rows are read after it ----------------
def test_defect_sample_holds_no_lock_while_it_reads_rows() -> None:
    stub = SplitBuffer(16)
    rb = RateLimitedBuffer(stub, RateLimiter(1.0, 4, error_buffer=(-100.0, 100.0)), timeout=20)
    for k in range(8):
        rb.add({"x": k})
    stub.gate = threading.Event()
    learner, got = in_thread(lambda: rb.sample(4))
    assert stub.reading.wait(20.0)  # the learner is reading its rows now
    actor, added = in_thread(lambda: rb.add({"x": 8}, timeout=5.0))
    actor.join(10.0)
    finished = not actor.is_alive()
    stub.gate.set()
    learner.join(20.0)
    assert finished, "add waited for a sample's read"
    assert isinstance(added[0], np.ndarray), added
    batch = got[0]
    assert isinstance(batch, fastper.SampleBatch), batch
    assert rb.limiter.samples == 4 and rb.limiter.inserts == 9
    np.testing.assert_array_equal(batch["x"], batch.keys)


def test_defect_rows_overwritten_during_the_read_are_drawn_again() -> None:
    stub = SplitBuffer(8)
    rb = RateLimitedBuffer(stub, RateLimiter.min_size(1), timeout=20)
    rb.add({"x": np.arange(8)})
    stub.gate = threading.Event()
    learner, got = in_thread(lambda: rb.sample(6, beta=0.7))
    assert stub.reading.wait(20.0)
    rb.add({"x": np.arange(8)})  # every slot now holds a newer transition
    stub.gate.set()
    learner.join(20.0)
    batch = got[0]
    assert isinstance(batch, fastper.SampleBatch), batch
    # never a row of another transition than its key names: all were drawn again
    np.testing.assert_array_equal(batch["x"], batch.keys)
    assert batch.keys.min() >= 8 and stub.draws == [6, 6]
    np.testing.assert_array_equal(batch.weights, np.full(6, 0.7))  # the draw's beta again
    assert rb.stats["redrawn_rows"] == 6 and rb.limiter.samples == 6


def test_rows_stale_round_after_round_are_finally_sampled_whole() -> None:
    stub = SplitBuffer(8)
    rb = RateLimitedBuffer(stub, RateLimiter.min_size(1))
    rb.add({"x": np.arange(8)})
    stub.stale_reads = 4  # the first read and three more rounds all come back stale
    batch = rb.sample(5)
    np.testing.assert_array_equal(batch["x"], batch.keys)
    assert stub.draws == [5, 5, 5, 5, 5]  # 1 + 3 rounds, then sample (a draw of 5)
    assert rb.limiter.samples == 5


def test_a_failed_read_gives_the_samples_back() -> None:
    stub = SplitBuffer(8)
    rb = RateLimitedBuffer(stub, RateLimiter(1.0, 2, error_buffer=(-50.0, 50.0)))
    rb.add({"x": np.arange(4)})
    stub.fail_reads = 1
    with pytest.raises(OSError, match="disk read failed"):
        rb.sample(3)
    assert rb.limiter.samples == 0
    assert len(rb.sample(3)) == 3 and rb.limiter.samples == 3


def test_a_cpu_buffer_sampled_in_two_halves_gives_its_own_sample() -> None:
    buf = fastper.PrioritizedReplayBuffer(64, FIELDS, seed=0)
    twin = fastper.PrioritizedReplayBuffer(64, FIELDS, seed=0)
    rb = RateLimitedBuffer(buf, RateLimiter.min_size(4), timeout=0)
    rb.add(rows(10))
    twin.add(rows(10))
    twin.update_priorities(np.arange(10), np.linspace(0.1, 2.0, 10))
    rb.update_priorities(np.arange(10), np.linspace(0.1, 2.0, 10))
    for _ in range(3):
        a, b = rb.sample(8), twin.sample(8)
        for name in ("indices", "keys", "weights", "probabilities"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        np.testing.assert_array_equal(a["obs"], b["obs"])
    assert buf.step == twin.step == 3 and rb.limiter.samples == 24


class Whole:
    """A buffer with ``sample`` only (no draw / gather)."""

    def __init__(self, buffer: Any) -> None:
        self.inner = buffer
        self.capacity = buffer.capacity

    def __len__(self) -> int:
        return len(self.inner)

    def add(self, transition: Any, priorities: Any = None, *, env_ids: Any = None) -> Any:
        return self.inner.add(transition, priorities, env_ids=env_ids)

    def sample(self, batch_size: int, beta: float | None = None) -> Any:
        return self.inner.sample(batch_size, beta)


def test_buffers_without_the_two_halves_are_sampled_whole() -> None:
    buf = fastper.PrioritizedReplayBuffer(64, FIELDS, seed=0)
    twin = fastper.PrioritizedReplayBuffer(64, FIELDS, seed=0)
    rb = RateLimitedBuffer(Whole(buf), RateLimiter.min_size(4), timeout=0)
    rb.add(rows(10))
    twin.add(rows(10))
    a, b = rb.sample(8, beta=0.5), twin.sample(8, beta=0.5)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a["obs"], b["obs"])
    assert buf.step == 1 and rb.limiter.samples == 8
    with pytest.raises(ValueError, match="capacity 64, got min_size_to_sample=65"):
        RateLimitedBuffer(Whole(buf), RateLimiter.min_size(65))


# -- 4. an absurd batch size fails with a size check -------------------------------
def test_defect_huge_batch_fails_with_a_size_check_not_memory_error() -> None:
    buf = fastper.PrioritizedReplayBuffer(64, FIELDS, seed=0)
    rb = RateLimitedBuffer(buf, RateLimiter.min_size(1), timeout=0)
    rb.add(rows(10))
    limit = max_batch_size(16)  # obs (3 float32) + reward: 16 bytes a row
    assert 1 <= limit <= 2**24
    message = (
        rf"`batch_size` must be <= {limit} \(draw large batches in pieces.*got batch_size=10{{12}}"
    )
    with pytest.raises(ValueError, match=message):
        rb.sample(10**12)
    assert rb.limiter.samples == 0 and buf.step == 0
    # a limiter with a range: the size is checked before the range is
    ranged = RateLimitedBuffer(buf, RateLimiter(1.0, 20, error_buffer=100.0), timeout=0)
    with pytest.raises(ValueError, match=message):
        ranged.sample(10**12)
    with pytest.raises(RateLimitTimeout):  # a batch of a sane size waits for 20 rows as before
        ranged.sample(4)
    assert buf.step == 0


def test_check_batch_size_types_and_bounds() -> None:
    assert check_batch_size(np.int64(7)) == 7
    with pytest.raises(TypeError, match="`batch_size` must be an integer, got batch_size=2.0"):
        check_batch_size(2.0)
    with pytest.raises(TypeError, match="`batch_size` must be an integer"):
        check_batch_size(True)
    with pytest.raises(ValueError, match="`batch_size` must be >= 1, got batch_size=0"):
        check_batch_size(0)
    with pytest.raises(ValueError, match=r"must be <= 16777216 \(draw large batches in pieces"):
        check_batch_size(2**40)
    assert max_batch_size(0) == 2**24
    huge_rows = 2**40  # bytes a row: memory bounds the batch
    limit = max_batch_size(huge_rows)
    assert limit < 2**24
    with pytest.raises(ValueError, match=rf"must be <= {limit} .*GiB of memory"):
        check_batch_size(limit + 1, huge_rows)


# -- 2. to_torch keeps the keys, so a torch loop drops stale updates ---------------
def test_defect_to_torch_keeps_keys_so_stale_updates_drop() -> None:
    torch = pytest.importorskip("torch")
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, seed=0)
    buf.add(rows(8))
    s = buf.sample(6)
    out = s.to_torch("cpu")
    assert out["keys"].dtype == torch.int64 and out["probabilities"].dtype == torch.float64
    np.testing.assert_array_equal(out["keys"].numpy(), s.keys)
    np.testing.assert_array_equal(out["probabilities"].numpy(), s.probabilities)
    before = buf.priorities(np.arange(8))
    buf.add(rows(8, 100))  # every sampled slot now holds a newer transition
    td = (torch.linspace(0.5, 3.0, 6, dtype=torch.float64, requires_grad=True) * 2.0).float()
    assert td.requires_grad
    kept = buf.update_priorities(out["indices"], td, keys=out["keys"])
    assert kept == 0 and buf.stale_updates == 6
    np.testing.assert_array_equal(buf.priorities(np.arange(8)), before)
    # a fresh batch's update goes through, tensors with grad and all
    s2 = buf.sample(6)
    out2 = s2.to_torch("cpu")
    assert buf.update_priorities(out2["indices"], td, keys=out2["keys"]) == 6


def test_to_torch_refuses_a_field_named_like_a_batch_entry() -> None:
    pytest.importorskip("torch")
    buf = fastper.ReplayBuffer(4, {"keys": ((), np.int64)})
    buf.add({"keys": np.arange(4)})
    with pytest.raises(ValueError, match=r"got fields \['keys'\]: rename them"):
        buf.sample(2).to_torch()


def test_defect_a_failed_read_puts_back_the_buffers_draw(tmp_path) -> None:
    """The limiter gave the samples back when the read failed, but the buffer's
    generator and step stayed moved (a plain sample puts both back)."""
    from fastper import PrioritizedReplayBuffer, RateLimitedBuffer, RateLimiter
    from fastper.disk import DiskStorage

    fields = {"obs": ((4,), np.float32)}
    storage = DiskStorage(fields, 16, tmp_path / "buf", ram_budget=0)
    buf = PrioritizedReplayBuffer(16, fields, storage=storage, seed=0)
    buf.add({"obs": np.ones((10, 4), np.float32)})
    rb = RateLimitedBuffer(buf, RateLimiter(1.0, 1, None))
    before, step = buf.state_dict()["buffer"]["rng"], buf.step
    real = storage.gather

    def failing(idx: Any) -> Any:
        raise OSError("EIO")

    storage.gather = failing  # type: ignore[method-assign]
    with pytest.raises(OSError, match="EIO"):
        rb.sample(4)
    assert buf.state_dict()["buffer"]["rng"] == before and buf.step == step
    assert rb.limiter.samples == 0
    storage.gather = real  # type: ignore[method-assign]
    assert len(rb.sample(4)) == 4 and buf.step == step + 1
    storage.close()


def test_defect_rows_drawn_again_keep_the_step_and_one_normalisation() -> None:
    """Rows overwritten during the read are drawn again: that used to move the buffer's
    step once more per round and, with weight_norm="batch", normalise them apart."""
    from fastper import PrioritizedReplayBuffer, RateLimitedBuffer, RateLimiter

    buf = PrioritizedReplayBuffer(
        8, {"obs": ((), np.float32)}, seed=1, weight_norm="batch", shuffle=False, beta=1.0
    )
    buf.add({"obs": np.arange(8, dtype=np.float32)})
    buf.update_priorities(np.arange(8), 2.0 ** np.arange(8))
    rb = RateLimitedBuffer(buf, RateLimiter(1.0, 1, None))
    real = buf.storage.gather
    calls = [0]

    def racing(idx: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # an actor overwrites slots 0..3 while the rows are read
            buf.add({"obs": np.full(4, 100.0, np.float32)}, priorities=np.full(4, 1.0))
        return real(idx)

    buf.storage.gather = racing  # type: ignore[method-assign]
    step = buf.step
    batch = rb.sample(8)
    assert rb.stats["redrawn_rows"] > 0
    assert buf.step == step + 1
    assert batch.weights.max() == 1.0
    np.testing.assert_allclose(
        batch.weights, (batch.probabilities / batch.probabilities.min()) ** -1.0, rtol=1e-12
    )
    np.testing.assert_array_equal(buf.keys(batch.indices), batch.keys)
