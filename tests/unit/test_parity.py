"""One core under every front end: the same operations and the same uniforms give
identical indices, probabilities and weights.

The CPU buffer, the sharded buffer (K = 1 and K = 3 shards in this process)
and the device buffer (torch back end on the CPU) are fed the same adds and
priority updates. The CPU buffer and the sharded coordinator draw their
uniforms from the same kind of generator with the same seed, in the same
order (``random(B)``, then ``B`` more whose :func:`~fastper.policy.batch_order` orders
a shuffled batch); the device
buffer's draw is fed the CPU buffer's uniforms. Their batches must then agree
exactly (``==``, not approximately): the stratified targets, the
probabilities and the IS weights each come from one implementation
(:mod:`fastper.policy`).

To make K = 3 comparable with one buffer, shard ``s`` holds the ``s``-th
third of the transitions, so the shards' slots laid end to end are the CPU
buffer's slots, and the priorities are powers of 4 with ``alpha = 0.5``: every
sum of masses is exact, whatever tree adds it up (one tree of 48 leaves or
three of 16). Rank-based replay has no sharded or device front end (a rank
is a property of the whole memory), so it is not part of the comparison.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fastper import PrioritizedReplayBuffer, ReplayBuffer
from fastper.distributed import ShardedReplayBuffer
from fastper.distributed.shard import Shard
from fastper.distributed.transport import LocalTransport
from fastper.policy import batch_order

PER_SHARD = 16
K_MAX = 3
CAP = PER_SHARD * K_MAX
SHAPE = (2, 2)
VEC = {
    "obs": ((3,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
    "next_obs": ((3,), np.float32), "terminated": ((), np.bool_), "truncated": ((), np.bool_),
}  # fmt: skip
FRAMES = {
    "obs": (SHAPE, np.uint8), "action": ((), np.int64), "reward": ((), np.float32),
    "next_obs": (SHAPE, np.uint8), "terminated": ((), np.bool_), "truncated": ((), np.bool_),
}  # fmt: skip
VARIANTS = {
    "plain": {"fields": VEC, "kwargs": {}},
    "nstep": {"fields": VEC, "kwargs": {"n_step": 3, "gamma": 0.5}},
    "frames": {"fields": FRAMES, "kwargs": {"frame_stack": {"obs": 2}}},
}


def stream_rows(stream: int, variant: str) -> list[dict[str, Any]]:
    """One episode of ``PER_SHARD`` steps of ``stream`` (its last step terminates)."""
    rows = []
    for t in range(PER_SHARD):
        if variant == "frames":
            obs = np.full(SHAPE, (stream * 40 + t) % 251, dtype=np.uint8)
            nxt = np.full(SHAPE, (stream * 40 + t + 1) % 251, dtype=np.uint8)
        else:
            obs = np.full(3, stream * 100 + t, dtype=np.float32)
            nxt = obs + 1
        rows.append({
            "obs": obs, "action": stream * 100 + t, "reward": float(t % 3),
            "next_obs": nxt, "terminated": t == PER_SHARD - 1, "truncated": False,
        })  # fmt: skip
    return rows


def batches(rows: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
    """The rows in batches of 1, 2, 3, 4, 1, 2, ... (consecutive steps of one stream)."""
    out, i, size = [], 0, 1
    while i < len(rows):
        part = rows[i : i + size]
        out.append({k: np.stack([np.asarray(r[k]) for r in part]) for k in part[0]})
        i += size
        size = size % 4 + 1
    return out


def td_of(indices: np.ndarray) -> np.ndarray:
    """TD errors whose priorities (eps = 0) are powers of 4: exact masses at alpha = 0.5."""
    return 4.0 ** ((indices * 7 + 3) % 4 - 1.0)


def make_cpu(cls: Any, variant: str, **common: Any) -> Any:
    v = VARIANTS[variant]
    return cls(CAP, v["fields"], **v["kwargs"], **common)


def make_sharded(
    cls: Any, variant: str, k: int, shard_common: dict[str, Any], **common: Any
) -> Any:
    v = VARIANTS[variant]
    cap = CAP // k
    shards = [Shard(cls(cap, v["fields"], **v["kwargs"], **shard_common, seed=s)) for s in range(k)]
    sharded = ShardedReplayBuffer(LocalTransport(shards), **common)
    sharded.shard_buffers = [s.buffer for s in shards]  # the test's handle on them
    return sharded


def fill(cpu: Any, sharded: Any, k: int, variant: str) -> None:
    """Stream s's episode into the CPU buffer and into shard ``s * k // K_MAX``."""
    for s in range(K_MAX):
        for part in batches(stream_rows(s, variant)):
            ids = np.full(part["action"].shape[0], s, dtype=np.int64)
            cpu.add(part, env_ids=ids)
            sharded.add(part, shard=s * k // K_MAX, env_ids=ids)
    assert len(cpu) == len(sharded) == CAP


def assert_same(a: Any, b: Any, what: str) -> None:
    np.testing.assert_array_equal(a.indices, b.indices, err_msg=f"indices ({what})")
    np.testing.assert_array_equal(a.probabilities, b.probabilities, err_msg=f"P(i) ({what})")
    np.testing.assert_array_equal(a.weights, b.weights, err_msg=f"weights ({what})")
    np.testing.assert_array_equal(a.data["action"], b.data["action"], err_msg=f"rows ({what})")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("scheme", ["uniform", "proportional"])
@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("stratified", [True, False])
@pytest.mark.parametrize("invalid", [False, True])
def test_cpu_and_sharded_buffers_draw_identically(
    variant: str, k: int, scheme: str, norm: str, stratified: bool, invalid: bool
) -> None:
    cls = ReplayBuffer if scheme == "uniform" else PrioritizedReplayBuffer
    shard_common: dict[str, Any] = {"eps": 0.0, "weight_norm": norm}
    if cls is PrioritizedReplayBuffer:
        shard_common["alpha"] = 0.5
    cpu = make_cpu(cls, variant, **shard_common, beta=0.4, stratified=stratified, seed=9)
    sharded = make_sharded(
        cls, variant, k, shard_common, beta=0.4, stratified=stratified, weight_norm=norm, seed=9
    )
    fill(cpu, sharded, k, variant)
    if invalid:  # slots that may not be drawn (torn rows, say): the same ones everywhere
        bad = np.array([3, 17, 18, 30, 41, 47])
        cpu.invalidate(bad)
        per = CAP // k
        for g in bad:
            sharded.shard_buffers[g // per].invalidate([g % per])
        sharded.refresh()  # changed behind the coordinator's back: take the shards' views
        assert cpu.num_valid == CAP - bad.size
    for round_ in range(12):
        a, b = cpu.sample(37), sharded.sample(37)
        assert_same(a, b, f"{variant}, K={k}, round {round_}")
        if invalid:
            assert not np.isin(a.indices, bad).any()
        if k == 1:
            np.testing.assert_array_equal(a.keys, b.keys)
        td = td_of(a.indices)
        cpu.update_priorities(a.indices, td, keys=a.keys)
        sharded.update_priorities(b.indices, td, keys=b.keys)
    if cls is PrioritizedReplayBuffer:  # the updates moved the law away from uniform
        assert len(np.unique(cpu.probabilities(np.arange(CAP)))) > 1


@pytest.mark.parametrize("variant", ["plain", "nstep"])
@pytest.mark.parametrize("scheme", ["uniform", "proportional"])
@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_cpu_and_device_buffers_draw_identically(
    variant: str, scheme: str, norm: str, backend: str, shuffle: bool, monkeypatch: Any
) -> None:
    """The device buffer (torch on the CPU) against the CPU buffer, fed its uniforms.

    The device buffer draws from a torch generator; here ``torch.rand`` and
    ``torch.randperm`` hand it the CPU buffer's draws (a twin of its numpy
    generator), so both indexes get the same points. Weights come back as
    float32 from the device buffer: they equal the CPU buffer's, cast. (The
    frame store is a host feature: there is no device frame buffer.)
    """
    torch = pytest.importorskip("torch")
    from fastper.device import DevicePrioritizedReplayBuffer, DeviceReplayBuffer

    cls = ReplayBuffer if scheme == "uniform" else PrioritizedReplayBuffer
    dcls = DeviceReplayBuffer if scheme == "uniform" else DevicePrioritizedReplayBuffer
    common: dict[str, Any] = {"eps": 0.0, "weight_norm": norm, "beta": 0.4, "shuffle": shuffle}
    if cls is PrioritizedReplayBuffer:
        common["alpha"] = 0.5
    v = VARIANTS[variant]
    cpu = cls(CAP, v["fields"], **v["kwargs"], **common, seed=9)
    dev = dcls(CAP, v["fields"], **v["kwargs"], **common, seed=9, device="cpu", backend=backend)
    for s in range(K_MAX):
        for part in batches(stream_rows(s, variant)):
            ids = np.full(part["action"].shape[0], s, dtype=np.int64)
            cpu.add(part, env_ids=ids)
            dev.add(part, env_ids=ids)
    assert len(cpu) == len(dev) == CAP
    twin = np.random.Generator(np.random.PCG64(9))  # the CPU buffer's generator, replayed
    b = 37
    for round_ in range(12):
        u = twin.random(b)
        perm = batch_order(twin.random(b)) if shuffle else None
        a = cpu.sample(b)
        with monkeypatch.context() as m:
            m.setattr(torch, "rand", lambda *args, _u=u, **kw: torch.from_numpy(_u.copy()))
            m.setattr(torch, "randperm", lambda *args, _p=perm, **kw: torch.from_numpy(_p.copy()))
            d = dev.sample(b)
        what = f"{variant}, {backend}, round {round_}"
        np.testing.assert_array_equal(a.indices, d.indices.numpy(), err_msg=what)
        np.testing.assert_array_equal(a.keys, d.keys.numpy(), err_msg=what)
        np.testing.assert_array_equal(a.probabilities, d.probabilities.numpy(), err_msg=what)
        np.testing.assert_array_equal(a.weights.astype(np.float32), d.weights.numpy(), err_msg=what)
        np.testing.assert_array_equal(a.data["action"], d.data["action"].numpy(), err_msg=what)
        td = td_of(a.indices)
        cpu.update_priorities(a.indices, td, keys=a.keys)
        dev.update_priorities(d.indices, torch.from_numpy(td), keys=d.keys)


def test_parity_with_priorities_that_round() -> None:
    """Priorities whose masses round (alpha 0.6, random |td|): one shard and the device
    buffer's numba index still agree with the CPU buffer bit for bit (the same sums in
    the same order); only sums over differently shaped trees (K = 3) could round apart."""
    torch = pytest.importorskip("torch")
    from fastper.device import DevicePrioritizedReplayBuffer

    common: dict[str, Any] = {"alpha": 0.6, "beta": 0.7, "eps": 1e-6, "shuffle": False}
    cpu = PrioritizedReplayBuffer(CAP, VEC, **common, seed=4)
    one = make_sharded(PrioritizedReplayBuffer, "plain", 1, {"alpha": 0.6, "eps": 1e-6},
                       beta=0.7, shuffle=False, seed=4)  # fmt: skip
    dev = DevicePrioritizedReplayBuffer(CAP, VEC, **common, seed=4, device="cpu", backend="numba")
    rows = {k: np.stack([np.asarray(r[k]) for r in stream_rows(0, "plain") * 3]) for k in VEC}
    for buf in (cpu, one):
        buf.add(rows, env_ids=np.zeros(CAP, dtype=np.int64))
    dev.add(rows, env_ids=np.zeros(CAP, dtype=np.int64))
    rng = np.random.default_rng(0)
    twin = np.random.Generator(np.random.PCG64(4))
    for _ in range(10):
        u = twin.random(64)
        a, b = cpu.sample(64), one.sample(64)
        orig = torch.rand
        torch.rand = lambda *args, _u=u, **kw: torch.from_numpy(_u.copy())  # type: ignore[assignment]
        try:
            d = dev.sample(64)
        finally:
            torch.rand = orig  # type: ignore[assignment]
        assert_same(a, b, "K=1")
        np.testing.assert_array_equal(a.indices, d.indices.numpy())
        np.testing.assert_array_equal(a.probabilities, d.probabilities.numpy())
        np.testing.assert_array_equal(a.weights.astype(np.float32), d.weights.numpy())
        td = rng.standard_normal(64) * rng.exponential(size=64)
        cpu.update_priorities(a.indices, td, keys=a.keys)
        one.update_priorities(b.indices, td, keys=b.keys)
        dev.update_priorities(d.indices, torch.from_numpy(td), keys=d.keys)
