"""The Ray back end's parts that need no cluster: lazy import, install hint, error
unwrapping, the rate limiter actor's waiting logic (run on asyncio here), router placement."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from fastper.distributed import ShardLostError, rendezvous  # noqa: E402
from fastper.distributed.ray_backend import require_ray, unwrap_ray_error  # noqa: E402
from fastper.distributed.ray_limiter import RateLimiterActor  # noqa: E402
from fastper.distributed.ray_router import ShardRouter, count_rows  # noqa: E402
from fastper.limiter import RateLimiterCancelled, RateLimitTimeout  # noqa: E402

pytestmark = pytest.mark.ray

FIELDS = {"obs": ([4], "<f4"), "reward": ([], "<f4")}


def test_importing_fastper_and_its_distributed_modules_does_not_import_ray() -> None:
    code = (
        "import sys, fastper, fastper.distributed\n"
        "import fastper.distributed.ray_backend, fastper.distributed.ray_router\n"
        "import fastper.distributed.ray_limiter\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_missing_ray_names_the_extra_to_install(monkeypatch) -> None:
    from fastper.distributed import ray_backend, ray_limiter

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    hint = (
        r"^fastper's Ray back end needs the ray extra \(ray is not installed\): pip install "
        r"\"fastper\[ray\]\" \(in a clone: pip install -e \"\.\[ray\]\"\)$"
    )
    with pytest.raises(ImportError, match=hint):
        require_ray()
    with pytest.raises(ImportError, match=hint):
        ray_backend.ray_shards(2, 8, {"x": ((), np.float64)})
    with pytest.raises(ImportError, match=hint):
        ray_limiter.rate_limiter(1.0, 4, 8.0)


def test_a_remote_error_is_unwrapped_to_itself() -> None:
    wrapped = ray.exceptions.RayTaskError("sample_mass", "Traceback ...", ValueError("bad targets"))
    err = unwrap_ray_error(wrapped)
    assert type(err) is ValueError and str(err) == "bad targets"
    assert err.__cause__ is wrapped  # the remote traceback stays in the chain
    other = RuntimeError("x")
    assert unwrap_ray_error(other) is other


# -- the rate limiter actor's logic, on a plain event loop ---------------------------------
def test_limiter_actor_blocks_the_side_ahead_and_wakes_it() -> None:
    async def scenario() -> None:
        lim = RateLimiterActor(samples_per_insert=1.0, min_size_to_sample=2, error_buffer=4.0)
        # range [2 - 4, 2 + 4] = [-2, 6]; stage 1 admits inserts freely up to 2
        assert await lim.await_insert(2) == 0.0
        st = await lim.stats()
        assert (st["inserts"], st["pending"]) == (0, 2)  # admitted, not landed
        with pytest.raises(RateLimitTimeout, match="sample waited 0.01 s"):
            await lim.await_sample(1, timeout=0.01)  # nothing landed yet: size 0
        await lim.settle_insert(2)
        assert await lim.await_sample(1) == 0.0
        await lim.await_insert(4)  # (2 + 4) * 1 - 1 = 5 <= 6
        with pytest.raises(RateLimitTimeout, match="insert waited .* the learner must sample"):
            await lim.await_insert(2, timeout=0.01)  # (6 + 2) - 1 = 7 > 6
        waiter = asyncio.create_task(lim.await_insert(2, timeout=5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await lim.settle_insert(4)
        assert await lim.await_sample(2) == 0.0  # 6 - 1 - 2 = 3 >= -2: and it wakes the insert
        assert await asyncio.wait_for(waiter, 5.0) > 0.0
        st = await lim.stats()
        assert (st["inserts"], st["pending"], st["samples"]) == (6, 2, 3)
        assert st["insert_waits"] == 2 and st["sample_waits"] == 1
        await lim.settle_insert(0, failed=2)  # a shard lost: released, not counted
        await lim.return_sample(2)  # a sample that raised
        st = await lim.stats()
        assert (st["inserts"], st["pending"], st["samples"]) == (6, 0, 1)
        assert (st["failed_inserts"], st["returned_samples"]) == (2, 2)
        with pytest.raises(ValueError, match="can never pass"):
            await lim.await_insert(50)
        await lim.await_sample(5)  # diff 6 - 6 = 0
        waiting = asyncio.create_task(lim.await_sample(3, timeout=5.0))  # 0 - 3 < -2
        await asyncio.sleep(0.01)
        await lim.cancel()
        with pytest.raises(RateLimiterCancelled, match="while a sample waited"):
            await waiting
        with pytest.raises(RateLimiterCancelled):
            await lim.await_insert(1)
        assert (await lim.state_dict())["inserts"] == 6

    asyncio.run(scenario())


def test_limiter_actor_counts_size_up_to_the_capacity() -> None:
    # a minimum size above the capacity could never be reached: refused, not waited on
    with pytest.raises(ValueError, match="min_size_to_sample"):
        RateLimiterActor(1.0, 10, None, capacity=4)

    async def scenario() -> None:
        lim = RateLimiterActor(1.0, 4, None, capacity=4)
        await lim.await_insert(3)
        await lim.settle_insert(3)
        with pytest.raises(RateLimitTimeout):  # 3 landed: below the minimum of 4
            await lim.await_sample(1, timeout=0.01)
        await lim.await_insert(5)
        await lim.settle_insert(5)  # 8 inserts, counted as min(8, capacity) = 4: enough
        await lim.await_sample(1, timeout=1.0)

    asyncio.run(scenario())


# -- router placement without a cluster ------------------------------------------------------
def test_router_places_by_key_skips_lost_shards_and_pickles_without_its_inflight() -> None:
    r = ShardRouter([object()] * 4, [None] * 4, fields=FIELDS, placement="key", key="me")
    keys = [f"actor-{i}" for i in range(300)]
    assert [r.shard_for(k) for k in keys] == [rendezvous(k, [0, 1, 2, 3]) for k in keys]
    assert r.shard_for() == rendezvous("me", [0, 1, 2, 3])
    r._lost.add(2)  # noqa: SLF001 - as its harvest would, after a lost reply
    assert all(r.shard_for(k) != 2 for k in keys)
    moved = [k for k in keys if r.shard_for(k) != rendezvous(k, [0, 1, 2, 3])]
    assert all(rendezvous(k, [0, 1, 2, 3]) == 2 for k in moved)
    r._pending.append((0, "ref", 3))  # noqa: SLF001
    back = pickle.loads(pickle.dumps(r))
    assert back.in_flight == 0 and back.lost_shards == [2] and back.key == "me"
    r._lost.update({0, 1, 3})  # noqa: SLF001
    with pytest.raises(ShardLostError, match="every shard"):
        r.shard_for("x")


def test_router_settings_and_row_counts() -> None:
    assert count_rows(FIELDS, {"obs": np.zeros(4), "reward": 0.0}) == 1
    assert count_rows(FIELDS, {"obs": np.zeros((7, 4)), "reward": np.zeros(7)}) == 7
    assert count_rows(FIELDS, {"reward": np.zeros(3)}) == 3
    with pytest.raises(ValueError, match="placement"):
        ShardRouter([object()], [None], fields=FIELDS, placement="nearest")
    with pytest.raises(ValueError, match="max_in_flight"):
        ShardRouter([object()], [None], fields=FIELDS, max_in_flight=0)
    with pytest.raises(ValueError, match="one node per actor"):
        ShardRouter([object()], [None, None], fields=FIELDS)
