"""Rate limiting for sharded replay: the learner decides without a limiter call per step, the
actors share the insert budget by quotas, and both sides can check without a call.

Most tests need no cluster: the limiter actor's class runs in this process on one event
loop behind a handle whose ``.remote`` calls are counted, and the shards are local
(``ShardedReplayBuffer.local``): they need no Ray. One test runs it all on Ray.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from fastper.distributed import ShardedReplayBuffer, ray_limiter, ray_router
from fastper.distributed.ray_limiter import RateLimitedSharded, RateLimiterActor
from fastper.distributed.ray_router import ShardRouter
from fastper.limiter import RateLimiter, RateLimiterCancelled, RateLimitTimeout

FIELDS = {"x": ((), np.float64), "tag": ((), np.int64)}


def rows(n: int, start: int = 0, tag: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.arange(start, start + n, dtype=np.float64), "tag": np.full(n, tag)}


class _Reply:
    """What a counted call returned (or raised), for the patched ``call_limiter``."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class InProcessLimiter:
    """A limiter actor in this process: ``handle.method.remote(...)`` runs it and counts it."""

    def __init__(self, actor: RateLimiterActor) -> None:
        self.actor = actor
        self.loop = asyncio.new_event_loop()
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self.actor, name)
        handle = self

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> _Reply:
                handle.calls[name] += 1
                try:
                    return _Reply(handle.loop.run_until_complete(method(*args)))
                except Exception as exc:  # noqa: BLE001 - handed to call_limiter, as Ray would
                    return _Reply(error=exc)

        return _Remote()

    def close(self) -> None:
        self.loop.close()


def _get(ref: _Reply, *args: Any, **kwargs: Any) -> Any:
    if ref.error is not None:
        raise ref.error
    return ref.value


@pytest.fixture
def in_process(monkeypatch) -> Any:
    """Make limiter handles in this process; ``call_limiter`` reads their replies."""
    monkeypatch.setattr(ray_limiter, "call_limiter", _get)
    monkeypatch.setattr(ray_router, "call_limiter", _get)
    made: list[InProcessLimiter] = []

    def make(*args: Any, **kwargs: Any) -> InProcessLimiter:
        made.append(InProcessLimiter(RateLimiterActor(*args, **kwargs)))
        return made[-1]

    yield make
    for h in made:
        h.close()


def shard_add(sharded: ShardedReplayBuffer, shard: int, n: int, start: int = 0) -> None:
    """An actor's insert, straight into a shard: the learner's views do not see it yet."""
    sharded.transport.shards[shard].add(rows(n, start))


# -- the learner's side ------------------------------------------------------------------------
def test_the_learner_decides_from_the_shards_views_without_a_limiter_call(in_process) -> None:
    spi, min_size, err, b = 2.0, 32, 200.0, 16
    handle = in_process(spi, min_size, err)
    sharded = ShardedReplayBuffer.local(2, 256, FIELDS, seed=0)
    rb = RateLimitedSharded(sharded, handle, timeout=0.0, publish_interval=3600.0)
    assert dict(handle.calls) == {"learner_state": 1}  # made once: the settings and counts
    handle.calls.clear()
    assert not rb.can_sample(b)  # nothing in
    shard_add(sharded, 0, 64)
    shard_add(sharded, 1, 64)
    assert not rb.can_sample(b)  # the rows landed, but no reply has said so yet
    sharded.refresh()
    assert rb.can_sample(b)
    # exactly as many batches as RateLimiter's arithmetic allows for 128 inserts
    rule = RateLimiter(spi, min_size, err)
    rule.record_insert(128)
    expected = 0
    while rule.can_sample(b, 128):
        rule.record_sample(b)
        expected += 1
    steps = 0
    while rb.can_sample(b):
        rb.sample(b)
        steps += 1
    assert steps == expected == 24 and sharded.step == steps
    assert sum(handle.calls.values()) == 0  # no limiter call in all those steps
    # the next one waits for inserts: polls the shards, gives up, changes nothing
    step = sharded.step
    t0 = time.monotonic()
    with pytest.raises(
        RateLimitTimeout, match=r"sample waited 0.05 s .*samples 384.* insert first"
    ):
        rb.sample(b, timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    assert sharded.step == step
    learner = rb.stats()["learner"]
    assert learner["sample_waits"] == 1 and 2 <= learner["polls"] <= 10
    # the count went out once when the wait began (and once more for stats)
    assert handle.calls["report_samples"] == 2
    assert handle.actor.limiter.samples == steps * b


def test_the_learner_sends_its_count_at_most_every_publish_every_samples(in_process) -> None:
    handle = in_process(1.0, 8, 1000.0)
    sharded = ShardedReplayBuffer.local(2, 512, FIELDS, seed=1)
    rb = RateLimitedSharded(sharded, handle, publish_interval=3600.0, publish_every=64)
    shard_add(sharded, 0, 200)
    shard_add(sharded, 1, 200)
    handle.calls.clear()
    for _ in range(30):
        rb.sample(16)
    # one message per 64 samples (every 4th batch), never awaited; the rest still here
    assert dict(handle.calls) == {"report_samples": 30 // 4}
    assert handle.actor.limiter.samples == 16 * (30 // 4 * 4)
    rb.publish()
    assert handle.actor.limiter.samples == 30 * 16
    # a report that arrives late (a smaller total) changes nothing
    handle.loop.run_until_complete(handle.actor.report_samples("learner", 64))
    assert handle.actor.limiter.samples == 30 * 16
    # a second wrapper for the same learner goes on from its count
    again = RateLimitedSharded(sharded, handle)
    assert again.stats()["samples"] == 30 * 16 and again.stats()["learner"]["samples"] == 0


def test_a_learner_that_times_out_leaves_the_sharded_buffer_as_it_was(in_process) -> None:
    # two identical memories; one learner times out first: both must then draw the same
    handle = in_process(1.0, 4, 50.0)
    twins = [ShardedReplayBuffer.local(2, 128, FIELDS, seed=7) for _ in range(2)]
    rb = RateLimitedSharded(twins[0], handle)
    assert not rb.can_sample(8)
    with pytest.raises(RateLimitTimeout):
        rb.sample(8, timeout=0.01)  # nothing in: stage 1
    assert twins[0].step == 0 and rb.stats()["learner"]["samples"] == 0
    for t in twins:
        shard_add(t, 0, 20)
        shard_add(t, 1, 12, start=100)
        t.refresh()
    got = rb.sample(8)
    want = twins[1].sample(8)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.weights, want.weights)
    with pytest.raises(ValueError, match="can never pass this rate limiter"):
        rb.sample(200)  # wider than the range: refused at once, no wait
    rb.cancel()
    with pytest.raises(RateLimiterCancelled):
        rb.sample(8)
    assert handle.actor.cancelled and handle.actor.limiter.samples == 8


def test_the_learner_proceeds_once_inserts_land_while_it_polls(in_process, monkeypatch) -> None:
    handle = in_process(1.0, 16, 40.0)
    sharded = ShardedReplayBuffer.local(2, 128, FIELDS, seed=3)
    rb = RateLimitedSharded(sharded, handle, timeout=5.0, publish_interval=3600.0)
    shard_add(sharded, 0, 8)  # below min_size_to_sample
    refresh, polls = sharded.refresh, []

    def refresh_while_an_actor_inserts() -> None:
        polls.append(time.monotonic())
        if len(polls) == 3:  # an actor's rows land between the learner's second and third poll
            shard_add(sharded, 1, 40, start=500)
        refresh()

    monkeypatch.setattr(sharded, "refresh", refresh_while_an_actor_inserts)
    handle.calls.clear()
    batch = rb.sample(16)
    assert len(polls) == 3 and batch.indices.shape == (16,)
    assert set((batch.indices // 128).tolist()) <= {0, 1} and sharded.step == 1
    assert sum(handle.calls.values()) == 0  # nothing to publish when the wait began
    gaps = np.diff(polls)
    assert gaps[1] >= gaps[0] * 1.5 or gaps[1] >= 0.002  # the pause doubles
    st = rb.stats()
    assert (st["samples"], st["learner"]["inserts"], st["learner"]["polls"]) == (16, 48, 3)


# -- the actors' side: quotas ------------------------------------------------------------------
def run_routers(
    actor: RateLimiterActor, routers: dict[Any, tuple[int, float]], *, rounds: int, k: int = 4
) -> dict[str, Any]:
    """Routers inserting batches of ``k`` (name -> (yields between batches, weight)) while a
    learner samples ``k`` every 10 loop turns; the limiter's stats at the end."""

    async def router(name: Any, pause: int, weight: float) -> None:
        while True:
            try:
                await actor.admit_insert(k, None, name, weight)
            except RateLimiterCancelled:
                return
            await actor.settle_insert(k, 0, name)
            for _ in range(pause):
                await asyncio.sleep(0)

    async def learner() -> None:
        for i in range(rounds):
            await actor.report_samples("learner", k * (i + 1))
            for _ in range(10):
                await asyncio.sleep(0)
        await actor.cancel()

    async def main() -> dict[str, Any]:
        tasks = [asyncio.create_task(router(n, p, w)) for n, (p, w) in routers.items()]
        await learner()
        await asyncio.gather(*tasks)
        return await actor.stats()

    return asyncio.run(main())


def admitted(st: dict[str, Any], name: Any) -> int:
    return int(st["routers"][repr(name)]["admitted"])


def test_a_fast_router_cannot_take_a_slower_ones_share() -> None:
    rounds, k = 300, 4
    # both ahead of the learner; "fast" asks again at once, "slow" after 12 loop turns
    st = run_routers(RateLimiterActor(1.0, 1, 8.0), {"fast": (0, 1.0), "slow": (12, 1.0)},
                     rounds=rounds)  # fmt: skip
    fast, slow = admitted(st, "fast"), admitted(st, "slow")
    assert fast + slow == st["inserts"] + st["pending"]
    assert fast + slow >= rounds * k  # the whole budget was used
    assert abs(fast - slow) <= 2 * k, (fast, slow)  # equal shares, to a batch or two
    assert st["routers"][repr("slow")]["waits"] > 0 and st["insert_waits"] > 0
    # the same two as one participant (no quota): first come, first served
    one = RateLimiterActor(1.0, 1, 8.0)

    async def unshared() -> tuple[int, int]:
        got = Counter[str]()

        async def router(name: str, pause: int) -> None:
            while True:
                try:
                    await one.admit_insert(k, None, None)  # both under one key
                except RateLimiterCancelled:
                    return
                got[name] += k
                await one.settle_insert(k, 0, None)
                for _ in range(pause):
                    await asyncio.sleep(0)

        tasks = [asyncio.create_task(router("fast", 0)), asyncio.create_task(router("slow", 12))]
        for i in range(rounds):
            await one.report_samples("learner", k * (i + 1))
            for _ in range(10):
                await asyncio.sleep(0)
        await one.cancel()
        await asyncio.gather(*tasks)
        return got["fast"], got["slow"]

    fast1, slow1 = asyncio.run(unshared())
    # what the quotas prevent: the fast one takes about twice the slow one's inserts
    assert fast1 > 1.5 * slow1 and slow > 1.3 * slow1, (fast1, slow1, slow)


def test_router_weights_share_the_budget_in_proportion() -> None:
    st = run_routers(RateLimiterActor(1.0, 1, 8.0), {"a": (0, 3.0), "b": (0, 1.0)}, rounds=400)
    a, b = admitted(st, "a"), admitted(st, "b")
    assert a + b >= 400 * 4
    assert abs(a / (a + b) - 0.75) < 0.02, (a, b)
    assert st["routers"][repr("a")]["weight"] == 3.0


def test_a_router_below_its_share_gets_all_it_asks_for() -> None:
    # "slow" asks for far less than half the insert rate: beside "fast" it gets nearly what
    # it gets alone, and "fast" the rest (nothing is kept for a router that is not asking)
    alone = run_routers(RateLimiterActor(1.0, 1, 8.0), {"slow": (60, 1.0)}, rounds=300)
    st = run_routers(RateLimiterActor(1.0, 1, 8.0), {"fast": (0, 1.0), "slow": (60, 1.0)},
                     rounds=300)  # fmt: skip
    fast, slow = admitted(st, "fast"), admitted(st, "slow")
    assert admitted(alone, "slow") < 300 * 4 / 3  # on its own it uses under a third
    assert fast + slow >= 300 * 4 and fast > 2 * slow
    assert slow >= 0.8 * admitted(alone, "slow"), (slow, admitted(alone, "slow"))


def test_a_silent_router_is_forgotten_and_what_it_held_released() -> None:
    async def scenario() -> None:
        lim = RateLimiterActor(1.0, 1, 40.0, forget_after=0.05)
        await lim.admit_insert(8, None, "gone")  # admitted, never settled: its process died
        await asyncio.sleep(0.06)
        await lim.admit_insert(4, None, "alive")
        st = await lim.stats()
        assert "'gone'" not in st["routers"] and st["pending"] == 4
        assert st["released_inserts"] == 8
        await lim.settle_insert(8, 0, "gone")  # it was alive after all: counted, not released twice
        st = await lim.stats()
        assert (st["inserts"], st["pending"]) == (8, 4)
        kept = RateLimiterActor(1.0, 1, 40.0)  # forget_after = 60 s
        await kept.admit_insert(4, None, "r")
        await kept.settle_insert(4, 0, "r")
        assert (await kept.stats())["routers"]["'r'"]["landed"] == 4
        await kept.admit_insert(2, None, "r")
        await kept.leave("r")  # router.close(): forgotten at once, its unsettled rows released
        st = await kept.stats()
        assert st["routers"] == {} and st["pending"] == 0 and st["released_inserts"] == 2

    asyncio.run(scenario())


def test_admission_replies_carry_the_room_a_next_insert_has() -> None:
    async def scenario() -> None:
        lim = RateLimiterActor(2.0, 4, 20.0)  # range [8 - 20, 8 + 20]: inserts <= (28 + s) / 2
        r = await lim.admit_insert(4, None, "a")
        assert r["waited"] == 0.0 and r["room"] == 14 - 4  # stage 2 bound: 14 in all
        await lim.settle_insert(4, 0, "a")
        await lim.report_samples("learner", 6)  # (28 + 6) / 2 = 17 in all
        assert (await lim.admit_insert(3, None, "a"))["room"] == 17 - 7
        waiting = asyncio.create_task(lim.admit_insert(12, 1.0, "b"))  # 7 + 12 > 17: waits
        await asyncio.sleep(0.01)
        # 10 rows of room, but b's request is ahead (it has been given less than a): a newcomer
        # and a are both held back rather than take what b waits for
        for name in ("c", "a"):
            with pytest.raises(RateLimitTimeout):
                await lim.admit_insert(1, 0.01, name)
        await lim.report_samples("learner", 20)  # (28 + 20) / 2 = 24: b's 12 fit
        assert (await asyncio.wait_for(waiting, 1.0))["waited"] > 0.0
        assert lim.pending == 3 + 12
        assert (await lim.admit_insert(5, 0.0, "a"))["room"] == 0  # 24 - 4 - 15 - 5

    asyncio.run(scenario())


# -- the router's own checks -------------------------------------------------------------------
class FakeShard:
    def __init__(self) -> None:
        self.batches = 0

    @property
    def add(self) -> Any:
        shard = self

        class _Add:
            @staticmethod
            def remote(*args: Any) -> str:
                shard.batches += 1
                return f"ref-{shard.batches}"

        return _Add()


def test_router_checks_without_a_call_and_try_add_never_waits(in_process, monkeypatch) -> None:
    handle = in_process(1.0, 4, 12.0)  # range [-8, 16]: 16 inserts before any sample
    shards = [FakeShard(), FakeShard()]
    router = ShardRouter(shards, [None, None], fields=FIELDS, placement="key", key="me",
                         max_in_flight=3, limiter=handle)  # fmt: skip
    monkeypatch.setattr(router, "_collect", lambda **kw: None)  # replies: none come back here
    assert router.can_insert(100)  # nothing heard yet
    assert sum(handle.calls.values()) == 0
    assert router.try_add(rows(6)) is not None  # asks (timeout 0) and sends
    assert handle.calls["admit_insert"] == 1 and router._room == 10  # noqa: SLF001
    assert router.can_insert(10) and not router.can_insert(11)
    assert handle.calls["admit_insert"] == 1  # can_insert made no call
    assert router.try_add(rows(11)) is None  # refused from what it heard: no call
    assert handle.calls["admit_insert"] == 1 and sum(s.batches for s in shards) == 1
    # another router takes the room: this one still believes in it, is refused at once
    handle.loop.run_until_complete(handle.actor.admit_insert(8, None, "other"))
    t0 = time.monotonic()
    assert router.try_add(rows(4)) is None
    assert time.monotonic() - t0 < 0.5 and handle.calls["admit_insert"] == 2
    assert not router.can_insert(1) and handle.actor.pending == 14  # nothing admitted for it
    assert sum(s.batches for s in shards) == 1
    router.room_ttl = 0.0  # what it heard is too old to trust: it would ask again
    assert router.can_insert(1) and handle.calls["admit_insert"] == 2
    router._room = None  # noqa: SLF001 - heard nothing: the in-flight limit still holds
    router._pending = [(0, "r", 1)] * 3  # noqa: SLF001
    assert not router.can_insert(1) and router.try_add(rows(1)) is None
    assert handle.calls["admit_insert"] == 2
    with pytest.raises(ValueError, match="limiter_weight"):
        ShardRouter(shards, [None, None], fields=FIELDS, limiter=handle, limiter_weight=0.0)


# -- on Ray ------------------------------------------------------------------------------------
class Inserter:
    """An env actor stand-in inserting through its router, ``pause`` seconds between batches."""

    def ready(self) -> bool:
        return True

    def run(self, router: Any, n_batches: int, k: int, pause: float) -> dict[str, Any]:
        import time as _time

        import numpy as _np

        for j in range(n_batches):
            router.add({"x": _np.arange(j * k, (j + 1) * k, dtype=_np.float64),
                        "tag": _np.zeros(k, dtype=_np.int64)})  # fmt: skip
            _time.sleep(pause)
        return {"sent": n_batches * k, "inserted": router.flush()}


@pytest.mark.ray
def test_on_ray_the_learner_calls_the_limiter_rarely_and_routers_share(ray_cluster) -> None:
    ray = pytest.importorskip("ray")
    from fastper.distributed.ray_backend import sharded_on_ray
    from fastper.distributed.ray_limiter import rate_limiter

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spi, min_size, err, n_batches, k, b = 1.0, 32, 48.0, 24, 8, 8
    limiter = rate_limiter(spi, min_size, err)
    sharded = sharded_on_ray(1, 4096, FIELDS, seed=0, num_cpus=0)
    actors = [ray.remote(Inserter).options(num_cpus=0).remote() for _ in range(2)]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=60)  # their processes are up
        rb = RateLimitedSharded(sharded, limiter, timeout=0.05, publish_interval=0.02)
        routers = [sharded.transport.router(placement="key", key=name, limiter=limiter,
                                            limiter_timeout=30.0, max_in_flight=2)
                   for name in ("fast", "slow")]  # fmt: skip
        runs = [actors[0].run.remote(routers[0], n_batches, k, 0.0),
                actors[1].run.remote(routers[1], n_batches, k, 0.002)]  # fmt: skip
        steps = waits = stats_calls = 0
        first_done: dict[str, Any] | None = None
        other_running = False  # was the other actor still running when first_done was read?
        t0 = time.monotonic()
        while True:
            done, _ = ray.wait(runs, num_returns=2, timeout=0)
            # the first poll that finds an actor through: how far is the other? (on a
            # loaded machine both can finish between two polls: nothing to compare then)
            if done and first_done is None:
                first_done = rb.stats()["routers"]
                other_running = len(done) == 1
                stats_calls += 1
            if len(done) == 2:
                break
            assert time.monotonic() - t0 < 60, "actors and learner did not finish in time"
            try:
                rb.sample(b)
                steps += 1
                time.sleep(0.03)  # a training step: far slower than the actors, who must wait
            except RateLimitTimeout:
                waits += 1
        elapsed = time.monotonic() - t0
        out = ray.get(runs)
        st = rb.stats()
        stats_calls += 1
        assert [o["inserted"] for o in out] == [o["sent"] for o in out] == [n_batches * k] * 2
        assert st["inserts"] == 2 * n_batches * k and st["pending"] == 0
        assert st["samples"] == b * steps == st["learner"]["samples"] and steps >= 20
        assert min_size * spi - err <= st["diff"] <= min_size * spi + err
        # the learner's only calls: its count, sent at most every 20 ms, when a wait began,
        # and for stats(); not one per step
        bound = elapsed / 0.02 + waits + stats_calls + 1
        assert st["sample_reports"] == st["learner"]["publishes"] + stats_calls
        assert st["sample_reports"] <= bound, (st["sample_reports"], steps, waits, elapsed)
        # both actors were held back; when the first was through, the other had its share too
        rows = st["routers"]
        assert rows[repr("fast")]["waits"] + rows[repr("slow")]["waits"] > 0
        assert first_done is not None
        if other_running:  # the slower actor had its share while the other finished
            got = sorted(first_done[repr(n)]["admitted"] for n in ("fast", "slow"))
            assert got[0] >= 0.5 * got[1], first_done
    finally:
        for a in actors:
            ray.kill(a)
        ray.kill(limiter)
        sharded.transport.close()
