"""``graphed_step``: the learner step replayed from CUDA graphs equals the eager step.

On a CUDA device the step is captured in CUDA graphs (those tests skip
without one). Everywhere, the same step runs with the graphs *emulated*
(each replay runs the captured body again into the static outputs): that
checks the step's bookkeeping (warm-up, capture, static batches, the weights
and td outside the graph, tallies, captures again when alpha changes) on the
CPU. On the CPU the public helper refuses with a message naming the eager calls.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastper.device as fd  # noqa: E402
from fastper import schedules  # noqa: E402

FIELDS = {"obs": ((4,), np.float32), "action": ((), np.int64)}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


DEVICES = [
    "cpu",  # emulated graphs
    pytest.param("cuda", marks=CUDA),
]


def _full(cls, capacity: int = 4096, device: str = "cuda", **kw):
    buf = cls(capacity, FIELDS, device=device, seed=3, backend="torch", **kw)
    g = torch.Generator(device=device).manual_seed(4)
    buf.add(
        {
            "obs": torch.randn(capacity, 4, generator=g, device=device),
            "action": torch.arange(capacity, device=device),
        }
    )
    return buf


def _step(buf, b: int):
    if buf.device.type == "cuda":
        return buf.graphed_step(b)
    return fd.GraphedStep(buf, b, _emulate=True)


def _same_batch(a, b) -> None:
    for name in ("indices", "keys", "weights", "probabilities"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in a.data:
        assert torch.equal(a.data[name], b.data[name]), name


@pytest.mark.parametrize("cls", [fd.DevicePrioritizedReplayBuffer, fd.DeviceReplayBuffer])
def test_graphed_step_refuses_the_cpu_device_and_says_what_to_call(cls) -> None:
    buf = cls(64, FIELDS, device="cpu", backend="torch")
    with pytest.raises(ValueError, match=r"CUDA device.*buffer\.sample and buffer\.update_prio"):
        buf.graphed_step(32)
    cpu = cls(64, FIELDS, device="cpu")  # the numba back end: the same refusal
    with pytest.raises(ValueError, match="CUDA"):
        cpu.graphed_step(32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [fd.DevicePrioritizedReplayBuffer, fd.DeviceReplayBuffer])
def test_graphed_steps_equal_eager_steps(cls, device) -> None:
    """Same draws, weights, priorities, counters and reports, step after step, with
    adds in between (stale keys), duplicates, a bad td entry and a beta schedule."""
    kw = {"beta": schedules.linear(0.4, 1.0, 10), "device": device}
    graphed, eager = _full(cls, **kw), _full(cls, **kw)
    step = _step(graphed, 256)
    gen = torch.Generator(device=device).manual_seed(5)
    for i in range(10):
        a, b = step.sample(), eager.sample(256)
        _same_batch(a, b)
        td = torch.randn(256, generator=gen, device=device)
        if i == 6:
            td[7] = math.nan  # dropped on the device, reported at the next check
        if i % 3 == 1:  # an add between the draw and the update: some keys go stale
            rows = {"obs": torch.zeros(1000, 4, device=device),
                    "action": torch.arange(1000, device=device)}  # fmt: skip
            graphed.add(rows)
            eager.add(rows)
        applied = step.update(td)
        assert int(applied) == int(eager.update_priorities(b, td))
    assert step._sample_graph is not None  # the graphs were used (after the warm-up step)
    for buf in (graphed, eager):
        with pytest.raises(ValueError, match="1 invalid entry"):
            buf.check()
    assert graphed.stale_updates == eager.stale_updates > 0
    assert graphed.invalid_updates == eager.invalid_updates == 1
    assert graphed.max_priority_ever == eager.max_priority_ever
    n = len(graphed)
    for name, arr in graphed._index.snapshot(n).items():
        np.testing.assert_array_equal(arr, eager._index.snapshot(n)[name], err_msg=name)
    _same_batch(graphed.sample(256), eager.sample(256))  # the generators agree after replays


@pytest.mark.parametrize("device", DEVICES)
def test_an_alpha_change_captures_again_and_stays_equal(device) -> None:
    kw = {"alpha": schedules.step([4], [0.6, 0.8]), "alpha_every": 1, "device": device}
    graphed, eager = (
        _full(fd.DevicePrioritizedReplayBuffer, **kw),
        _full(fd.DevicePrioritizedReplayBuffer, **kw),
    )
    step = _step(graphed, 128)
    captured = []
    for _ in range(8):
        a, b = step.sample(), eager.sample(128)
        captured.append(step._sample_graph)
        _same_batch(a, b)
        td = torch.rand(128, device=device)
        step.update(td)
        eager.update_priorities(b, td)
    assert graphed.alpha == eager.alpha == 0.8
    assert captured[0] is None and captured[1] is not None  # warm-up, then a capture
    assert captured[3] is not captured[5]  # alpha changed at step 4: captured again


def test_a_buffer_still_filling_runs_eagerly() -> None:
    buf = fd.DevicePrioritizedReplayBuffer(4096, FIELDS, backend="torch", seed=0)
    buf.add({"obs": torch.zeros(1000, 4), "action": torch.arange(1000)})
    step = fd.GraphedStep(buf, 64, _emulate=True)
    for _ in range(3):
        step.sample()
        step.update(torch.rand(64))
    assert step._sample_graph is None  # n changes with every add until the buffer is full
    with pytest.raises(ValueError, match="sample"):
        fd.GraphedStep(buf, 64, _emulate=True).update(torch.rand(64))


@CUDA
def test_graphed_steps_do_not_sync() -> None:
    buf = _full(fd.DevicePrioritizedReplayBuffer)
    step = buf.graphed_step(256)
    td = torch.rand(256, device="cuda")
    for _ in range(3):  # warm-up and capture
        step.sample()
        step.update(td)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            step.sample()
            step.update(td)
    finally:
        torch.cuda.set_sync_debug_mode("default")
