"""A samples-per-insert rate limiter across processes: one Ray actor, many clients.

The arithmetic is :class:`fastper.limiter.RateLimiter`'s (Reverb's definition:
stage 1 until ``min_size_to_sample`` transitions are in, then
``inserts * samples_per_insert - samples`` held within the error buffer).
:class:`RateLimiterActor` holds one; actors ask it before inserting a batch
(:meth:`~RateLimiterActor.await_insert`, done for them by a
:class:`~fastper.distributed.ray_router.ShardRouter` given ``limiter=``) and
the learner before sampling (:meth:`~RateLimiterActor.await_sample`, done by
:class:`RateLimitedSharded`). A call returns when its side may go ahead and
has been counted; it blocks, inside the actor, while that side is ahead.

Why an async actor with an ``asyncio.Condition`` rather than clients polling:
a waiting call costs one pending request and no thread (Ray runs an async
actor's calls as coroutines on one event loop, up to ``max_concurrency``
at once), it is woken as soon as the other side's call changes the counts
(no polling latency and no stream of retry round trips), and the check and
the count happen between two ``await`` points on that one loop, so they are
atomic without a lock.

Counting inserts: an insert is *admitted* by ``await_insert`` (it counts
towards the insert side at once, so concurrent actors cannot overshoot
together) and *landed* when its shard confirmed it (``settle_insert``, sent by
the router without waiting). Only landed inserts count as the buffer's size
and as inserts for the sample side, so the learner never samples rows still
on their way. Failed inserts (a shard lost) are released. A router keeps
settling its answered inserts while it waits to be admitted, so rows already
in the shards never sit uncounted while the learner waits for them. A sample
is counted when admitted; :class:`RateLimitedSharded` gives it back if the
sample raises.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from typing import Any

from .._validation import check_int, check_real, show
from ..limiter import RateLimiter, RateLimiterCancelled, RateLimitTimeout
from .ray_common import call_limiter, count_rows, require_ray

__all__ = ["RateLimitedSharded", "RateLimiterActor", "call_limiter", "rate_limiter"]


class _Default:
    """The wrapper's own timeout (``RateLimitedSharded(timeout=...)``)."""

    def __repr__(self) -> str:
        return "DEFAULT"


_DEFAULT: Any = _Default()


class RateLimiterActor:
    """The body of the rate limiter actor (``ray.remote`` makes it an async actor).

    Args:
        samples_per_insert, min_size_to_sample, error_buffer: as for
            :class:`~fastper.limiter.RateLimiter`.
        capacity: transitions the buffer can hold (the size for stage 1 is
            ``min(landed inserts, capacity)``); ``None``: unbounded.
        state: a :meth:`~fastper.limiter.RateLimiter.state_dict` to continue
            from (counters included) instead of the three settings.

    Every method is O(1) apart from waiting; each is one round trip.
    """

    def __init__(
        self,
        samples_per_insert: float = 1.0,
        min_size_to_sample: int = 1,
        error_buffer: float | tuple[float, float] | None = None,
        capacity: int | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        if state is not None:
            self.limiter = RateLimiter.from_state_dict(state)
        else:
            self.limiter = RateLimiter(samples_per_insert, min_size_to_sample, error_buffer)
        self.capacity = math.inf if capacity is None else check_int("capacity", capacity, minimum=1)
        if capacity is not None:  # a minimum the shards can never hold: every sample would hang
            self.limiter.check_capacity(int(capacity))
        self.pending = 0  # admitted inserts not yet landed
        self.cancelled = False
        self._cond: asyncio.Condition | None = None
        self._stats = {"insert_waits": 0, "insert_wait_s": 0.0, "sample_waits": 0,
                       "sample_wait_s": 0.0, "failed_inserts": 0, "returned_samples": 0}  # fmt: skip

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # made on the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    def _size(self) -> int:
        return int(min(self.limiter.inserts, self.capacity))

    async def await_insert(self, count: int, timeout: float | None = None) -> float:
        """Wait until ``count`` inserts may go ahead, admit them; seconds waited.

        Raises:
            ValueError: a batch this large can never pass (split it).
            RateLimitTimeout: still blocked after ``timeout`` s (nothing admitted).
            RateLimiterCancelled: :meth:`cancel` was called.
        """
        k = check_int("count", count, minimum=1)
        lim = self.limiter
        width = lim.max_diff - lim.min_diff
        if k * lim.samples_per_insert > width and k > lim.min_size_to_sample:
            raise ValueError(
                f"a batch of {k} inserts can never pass this rate limiter: count * "
                f"samples_per_insert = {k * lim.samples_per_insert:g} exceeds the width "
                f"{width:g} of its range; send smaller batches or widen error_buffer"
            )

        def ready() -> bool:
            return lim.can_insert(self.pending + k, self._size())

        def admit() -> None:
            self.pending += k

        return await self._wait("insert", ready, admit, timeout)

    async def settle_insert(self, landed: int, failed: int = 0) -> None:
        """Admitted inserts that ``landed`` in a shard (now counted) or ``failed`` (released)."""
        landed, failed = int(landed), int(failed)
        self.pending = max(0, self.pending - landed - failed)
        self.limiter.record_insert(landed)
        self._stats["failed_inserts"] += failed
        async with self._condition():
            self._condition().notify_all()

    async def await_sample(self, count: int, timeout: float | None = None) -> float:
        """Wait until a batch of ``count`` may be sampled, count it; seconds waited.

        Raises:
            ValueError: the range is too narrow for a batch this large.
            RateLimitTimeout, RateLimiterCancelled: as for :meth:`await_insert`.
        """
        b = check_int("count", count, minimum=1)
        lim = self.limiter
        if not lim.admits_batch(b):
            raise ValueError(
                f"a batch of {b} can never pass this rate limiter: its range [{lim.min_diff:g}, "
                f"{lim.max_diff:g}] must be at least batch_size + samples_per_insert = "
                f"{b + lim.samples_per_insert:g} wide; widen error_buffer"
            )
        return await self._wait(
            "sample", lambda: lim.can_sample(b, self._size()), lambda: lim.record_sample(b), timeout
        )

    async def return_sample(self, count: int) -> None:
        """Give back a sample admitted whose call then failed (nothing was sampled)."""
        b = check_int("count", count, minimum=0)
        self.limiter.record_sample(-b)  # the arithmetic stays RateLimiter's
        self._stats["returned_samples"] += b
        async with self._condition():
            self._condition().notify_all()

    async def _wait(self, side: str, ready: Any, commit: Any, timeout: float | None) -> float:
        """Wait until ``ready()``, then ``commit()`` and wake the others, all under the condition."""
        limit = None if timeout is None else check_real("timeout", timeout, minimum=0.0)
        cond = self._condition()
        async with cond:
            if self.cancelled:
                raise RateLimiterCancelled(f"the rate limiter was cancelled; no {side} was done")
            if ready():
                commit()
                cond.notify_all()
                return 0.0
            t0 = time.monotonic()
            self._stats[f"{side}_waits"] += 1
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self.cancelled or ready()), limit)
            except TimeoutError:
                lim = self.limiter
                raise RateLimitTimeout(
                    f"{side} waited {limit:g} s for the rate limiter and gave up, nothing done: "
                    f"size {self._size()} (min_size_to_sample {lim.min_size_to_sample}), "
                    f"inserts {lim.inserts} (+{self.pending} in flight), samples {lim.samples}, "
                    f"inserts*samples_per_insert - samples = {lim.diff:g} (allowed "
                    f"[{lim.min_diff:g}, {lim.max_diff:g}]); the "
                    f"{'learner' if side == 'insert' else 'actors'} must "
                    f"{'sample' if side == 'insert' else 'insert'} first"
                ) from None
            finally:
                self._stats[f"{side}_wait_s"] += time.monotonic() - t0
            if self.cancelled:
                raise RateLimiterCancelled(
                    f"the rate limiter was cancelled while a {side} waited; nothing was done"
                )
            commit()
            cond.notify_all()
            return time.monotonic() - t0

    async def cancel(self) -> None:
        """Wake every waiting call with :class:`RateLimiterCancelled`; later calls raise too."""
        self.cancelled = True
        async with self._condition():
            self._condition().notify_all()

    async def stats(self) -> dict[str, Any]:
        """Counters and waits: inserts (landed), pending, samples, diff, waits per side."""
        lim = self.limiter
        return {"inserts": lim.inserts, "pending": self.pending, "samples": lim.samples,
                "diff": lim.diff, "min_diff": lim.min_diff, "max_diff": lim.max_diff,
                "blocked": lim.blocked_side(self._size()), **self._stats}  # fmt: skip

    async def state_dict(self) -> dict[str, Any]:
        """The limiter's settings and landed counters (:meth:`RateLimiter.state_dict`)."""
        return self.limiter.state_dict()


def rate_limiter(
    samples_per_insert: float = 1.0,
    min_size_to_sample: int = 1,
    error_buffer: float | tuple[float, float] | None = None,
    *,
    capacity: int | None = None,
    num_cpus: float = 0.0,
    actor_options: Mapping[str, Any] | None = None,
) -> Any:
    """Start a rate limiter actor; returns its handle (pass it to routers and the learner).

    The settings are checked here first (the same errors and warnings as
    :class:`~fastper.limiter.RateLimiter`). ``capacity``: the transitions all
    shards hold together, if the limiter should know the buffer is full.
    The actor reserves ``num_cpus`` (0: it mostly waits).
    """
    RateLimiter(samples_per_insert, min_size_to_sample, error_buffer)  # raises / warns here
    ray = require_ray()
    opts: dict[str, Any] = {"num_cpus": check_real("num_cpus", num_cpus, minimum=0.0),
                            "max_restarts": 0}  # fmt: skip
    opts.update(actor_options or {})
    cls = ray.remote(RateLimiterActor)
    return cls.options(**opts).remote(
        samples_per_insert, min_size_to_sample, error_buffer, capacity
    )


class RateLimitedSharded:
    """The learner's sharded buffer whose ``sample`` waits for a rate limiter actor.

    Args:
        sharded: a :class:`~fastper.distributed.ShardedReplayBuffer`.
        limiter: the handle from :func:`rate_limiter` (the actors' routers hold it too).
        timeout: default seconds ``sample`` waits (``None``: for ever).

    ``sample(B)`` costs one round trip to the limiter before the sample's own
    (the limiter counts B samples); a sample that raises is given back.
    Inserts should come through routers holding the same limiter; the
    learner's own ``add`` here counts its rows too (one more round trip).
    Everything else (``update_priorities``, ``save``, ``flush``, ...) is the
    sharded buffer's, unlimited.
    """

    def __init__(self, sharded: Any, limiter: Any, *, timeout: float | None = None) -> None:
        for name in ("sample", "add", "update_priorities"):
            if not callable(getattr(sharded, name, None)):
                raise TypeError(
                    f"`sharded` must be a ShardedReplayBuffer, got sharded={show(sharded)}"
                )
        self.sharded = sharded
        self.limiter = limiter
        self.timeout = None if timeout is None else check_real("timeout", timeout, minimum=0.0)
        self._fields: dict[str, Any] | None = None

    def sample(
        self, batch_size: int, beta: float | None = None, *, timeout: float | None = _DEFAULT
    ) -> Any:
        """``sharded.sample`` once the limiter admits ``batch_size`` samples.

        Raises:
            RateLimitTimeout, RateLimiterCancelled, ValueError: from the limiter
                (nothing sampled); whatever ``sharded.sample`` raises.
        """
        b = check_int("batch_size", batch_size, minimum=1)
        t = self.timeout if timeout is _DEFAULT else timeout
        call_limiter(self.limiter.await_sample.remote(b, t))
        try:
            return self.sharded.sample(b, beta)
        except BaseException:
            call_limiter(self.limiter.return_sample.remote(b))
            raise

    def add(
        self, transition: Mapping[str, Any], *, key: Any = None, shard: int | None = None,
        env_ids: Any = None, timeout: float | None = _DEFAULT,
    ) -> Any:  # fmt: skip
        """``sharded.add`` once the limiter admits its rows; counted as landed when it returns."""
        if self._fields is None:
            self._fields = self.sharded.fields  # the shards' field spec, as describe() gives it
        rows = count_rows(self._fields, transition)
        wait = self.timeout if timeout is _DEFAULT else timeout
        call_limiter(self.limiter.await_insert.remote(rows, wait))
        try:
            out = self.sharded.add(transition, key=key, shard=shard, env_ids=env_ids)
        except BaseException:
            call_limiter(self.limiter.settle_insert.remote(0, rows))
            raise
        call_limiter(self.limiter.settle_insert.remote(rows, 0))
        return out

    def stats(self) -> dict[str, Any]:
        """The limiter's counters and waits (one round trip)."""
        return dict(call_limiter(self.limiter.stats.remote()))

    def __getattr__(self, name: str) -> Any:
        if name in ("sharded", "limiter"):
            raise AttributeError(name)
        return getattr(self.sharded, name)

    def __len__(self) -> int:
        return len(self.sharded)
