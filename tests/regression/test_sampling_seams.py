"""Sampling in two halves (draw under the lock, read the rows after) keeps every rule.

Regression tests: a failed read put back the generator only (a scheme switch
that fell due, alpha and a rank-based sampler's counters stayed moved), and a
tiered storage, whose reads move chunks between tiers, was read outside the
buffer's lock, handing out rows of other transitions as fresh.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from fastper import PrioritizedReplayBuffer, RankBasedReplayBuffer
from fastper.storage import Storage

FIELDS = {"obs": ((3,), np.float32), "action": ((), np.int64)}


class FlakyStorage(Storage):
    """RAM storage whose next ``fail`` gathers raise (a disk that hiccups)."""

    gather_can_fail = True
    fail = 0

    def gather(self, indices: Any) -> dict[str, np.ndarray]:
        if self.fail:
            self.fail -= 1
            raise OSError("read failed")
        return super().gather(indices)


def _twins(cls: Any, **kw: Any) -> tuple[Any, Any]:
    out = []
    for _ in range(2):
        buf = cls(64, FIELDS, storage=FlakyStorage, seed=3, **kw)
        buf.add({"obs": np.zeros((50, 3)), "action": np.arange(50)})
        rng = np.random.default_rng(0)
        for _ in range(3):
            s = buf.sample(8)
            buf.update_priorities(s, rng.exponential(size=8))
        out.append(buf)
    return out[0], out[1]


@pytest.mark.parametrize(
    ("cls", "kw", "switch"),
    [
        (RankBasedReplayBuffer, {"sort_every": 3}, False),
        (PrioritizedReplayBuffer, {"alpha": 0.6}, True),
        (
            PrioritizedReplayBuffer,
            {"alpha": lambda step: 0.5 + 0.1 * step, "alpha_every": 1},
            False,
        ),
    ],
)
def test_defect_failed_read_puts_back_everything_the_draw_changed(
    cls: Any, kw: dict[str, Any], switch: bool
) -> None:
    a, b = _twins(cls, **kw)
    if switch:  # a switch to rank-based replay falls due at the next sample
        for buf in (a, b):
            buf.switch_scheme("rank", at_step=buf.step)
    before = a.state_dict()
    a.storage.fail = 1
    with pytest.raises(OSError, match="read failed"):
        a.sample(8)
    after = a.state_dict()
    assert after["buffer"] == before["buffer"]  # step, scheme, pending switch, rng
    assert after["sampler"]["alpha"] == before["sampler"]["alpha"]
    for key in ("samples_since_sort", "last_batch_size"):
        assert after["sampler"].get(key) == before["sampler"].get(key)
    for _ in range(5):  # and from here on the two draw the same batches
        x, y = a.sample(8), b.sample(8)
        np.testing.assert_array_equal(x.indices, y.indices)
        np.testing.assert_array_equal(x.weights, y.weights)
        a.update_priorities(x, np.arange(1.0, 9.0))
        b.update_priorities(y, np.arange(1.0, 9.0))
    assert a.scheme == b.scheme == ("rank" if switch else a.kind)


def test_defect_tiered_storage_is_read_under_the_lock() -> None:
    """Reads of a tiered storage move chunks between tiers: with adds, draws and
    rebalances in other threads, a row read outside the lock could belong to
    another transition while its key still matched."""
    pytest.importorskip("lz4")
    from fastper.tiers import TieredStorage

    fields = {"obs": ((16,), np.float32), "action": ((), np.int64)}
    cap = 1024
    storage = TieredStorage(fields, cap, chunk_size=64, hot_bytes=64 * 16 * 4 * 4,
                            warm_bytes=64 * 16 * 4 * 8, rebalance_every=1, prefetch=False)  # fmt: skip
    buf = PrioritizedReplayBuffer(cap, fields, storage=storage, seed=0)

    def rows(k: int, first: int) -> dict[str, np.ndarray]:
        a = np.arange(first, first + k)
        return {"obs": np.repeat(a[:, None], 16, 1).astype(np.float32), "action": a}

    buf.add(rows(cap, 0))
    stop = threading.Event()
    errors: list[str] = []
    checked = [0]

    def writer() -> None:
        rng = np.random.default_rng(1)
        first = cap
        while not stop.is_set():
            buf.add(rows(16, first))
            first += 16
            drawn = buf.draw(32)  # rebalances: chunks change tiers
            buf.update_priorities(drawn, rng.exponential(size=32) * 10)

    def reader() -> None:
        while not stop.is_set():
            drawn = buf.draw(64)
            try:
                data, fresh = buf.gather(drawn.indices, drawn.keys)
            except Exception as exc:  # noqa: BLE001 - any error is the defect
                errors.append(repr(exc))
                return
            wrong = fresh & (data["action"] != drawn.keys)
            checked[0] += int(fresh.sum())
            if wrong.any():
                errors.append(f"row of key {int(data['action'][wrong][0])} returned as fresh")
                return

    threads = [threading.Thread(target=f) for f in (writer, reader, reader)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert checked[0] > 1000
