"""A samples-per-insert rate limiter across processes: one Ray actor, many clients.

The arithmetic is :class:`fastper.limiter.RateLimiter`'s (Reverb's definition:
stage 1 until ``min_size_to_sample`` transitions are in, then
``inserts * samples_per_insert - samples`` held within the error buffer).

**The actors' side.** :class:`RateLimiterActor` holds the counts; actors ask
it before inserting a batch (:meth:`~RateLimiterActor.admit_insert`, done for
them by a :class:`~fastper.distributed.ray_router.ShardRouter` given
``limiter=``). A call returns when the batch may go ahead and has been
counted; it blocks, inside the actor, while the actors are ahead.

**The learner's side makes no limiter call per step.** The learner's
:class:`RateLimitedSharded` decides each sample itself, with the same
arithmetic: its inserts are the transitions the shards say they took (the
``added`` of the views every sample's reply carries, summed over the
shards), its samples its own count. While the learner is ahead it polls the
shards (``sharded.refresh()``, one parallel round trip) with a backoff of
1 ms doubling to 50 ms, until the inserts catch up or its timeout passes.
The actor learns the learner's sample count from messages that are never
awaited, sent at most every ``publish_interval`` seconds (10 ms by default)
or ``publish_every`` samples, and at once when the learner starts to wait.

Both sides decide on counts that may lag, and both lag on the safe side: the
learner counts only inserts the shards confirmed, so it never samples beyond
the range; the actor counts only samples it was told of, so it never lets
inserts beyond the range. A lag only makes a side wait a little early.

Why an async actor with an ``asyncio.Condition`` rather than routers polling:
a waiting call costs one pending request and no thread (Ray runs an async
actor's calls as coroutines on one event loop, up to ``max_concurrency``
at once), it is woken as soon as a count changes, and the check and the count
happen between two ``await`` points on that one loop, so they are atomic
without a lock.

Counting inserts: an insert is *admitted* by ``admit_insert`` (it counts
towards the insert side at once, so concurrent actors cannot overshoot
together) and *landed* when its shard confirmed it (``settle_insert``, sent by
the router without waiting). Only landed inserts count as the buffer's size
for stage 1. Failed inserts (a shard lost) are released. A router keeps
settling its answered inserts while it waits to be admitted, so rows already
in the shards never sit uncounted while the learner waits for them.

**Insert quotas.** Routers name themselves (their ``key``, by default the
id of the Ray actor using them). When the insert budget (what the rule
allows beyond the inserts so far) cannot cover every router waiting for it,
it goes to them in order of how much each has been given, per unit of
weight (start-time fair queueing): a router's next request is tagged with
``max(its own total / weight, the tag of the last request admitted)`` and
the waiting requests are served smallest tag first (then oldest first). So
routers that keep asking share the insert rate in proportion to their
weights (equal by default), however fast each produces; a router asking for
less than its share gets all it asks for, after at most one request of each
of the others; and a router that is away (not asking) holds no budget at all
and comes back with no credit for the time it was away. Stage 1 (filling up
to ``min_size_to_sample``) is not shared: inserts go ahead freely. A router
that sends nothing for ``forget_after`` seconds (60 by default) is forgotten:
its row of ``stats()["routers"]`` goes, and inserts it was admitted and never
settled (its process died between the two) are released. ``router.close()``
forgets it at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import check_int, check_real, show
from ..limiter import RateLimiter, RateLimiterCancelled, RateLimitTimeout
from .ray_common import LIMITER_CALL_TIMEOUT, LIMITER_GRACE, call_limiter, count_rows, require_ray

__all__ = ["RateLimitedSharded", "RateLimiterActor", "call_limiter", "rate_limiter"]

#: the learner's polling while it waits for inserts: first and largest pause, seconds
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.05


class _Default:
    """The wrapper's own timeout (``RateLimitedSharded(timeout=...)``)."""

    def __repr__(self) -> str:
        return "DEFAULT"


_DEFAULT: Any = _Default()


@dataclass
class _Router:
    """What the limiter actor knows of one router (one key)."""

    weight: float = 1.0
    finish: float = 0.0  # inserts given so far / weight, from its tags (fair queueing)
    admitted: int = 0
    landed: int = 0
    failed: int = 0
    pending: int = 0  # admitted, not yet settled
    waits: int = 0
    wait_s: float = 0.0
    waiting: int = 0  # requests waiting now
    last: float = 0.0  # time.monotonic() of its last call

    def row(self, now: float) -> dict[str, Any]:
        return {"weight": self.weight, "admitted": self.admitted, "landed": self.landed,
                "failed": self.failed, "pending": self.pending, "waits": self.waits,
                "wait_s": self.wait_s, "waiting": self.waiting,
                "idle_s": max(0.0, now - self.last)}  # fmt: skip


@dataclass
class _Request:
    """One insert request, waiting or being decided."""

    router: Any
    count: int
    tag: float  # start tag: served smallest first
    seq: int  # arrival order: ties go to the oldest

    def before(self, other: _Request) -> bool:
        return (self.tag, self.seq) < (other.tag, other.seq)


class RateLimiterActor:
    """The body of the rate limiter actor (``ray.remote`` makes it an async actor).

    Args:
        samples_per_insert, min_size_to_sample, error_buffer: as for
            :class:`~fastper.limiter.RateLimiter`.
        capacity: transitions the buffer can hold (the size for stage 1 is
            ``min(landed inserts, capacity)``); ``None``: unbounded.
        state: a :meth:`~fastper.limiter.RateLimiter.state_dict` to continue
            from (counters included) instead of the three settings.
        forget_after: seconds without a call after which a router is
            forgotten (see the module docstring).

    Every method is one round trip; apart from waiting, the insert calls are
    O(routers waiting), the others O(1).
    """

    def __init__(
        self,
        samples_per_insert: float = 1.0,
        min_size_to_sample: int = 1,
        error_buffer: float | tuple[float, float] | None = None,
        capacity: int | None = None,
        state: Mapping[str, Any] | None = None,
        forget_after: float = 60.0,
    ) -> None:
        if state is not None:
            self.limiter = RateLimiter.from_state_dict(state)
        else:
            self.limiter = RateLimiter(samples_per_insert, min_size_to_sample, error_buffer)
        self.capacity = math.inf if capacity is None else check_int("capacity", capacity, minimum=1)
        if capacity is not None:  # a minimum the shards can never hold: every sample would hang
            self.limiter.check_capacity(int(capacity))
        self.forget_after = check_real("forget_after", forget_after, minimum=0.0)
        self.pending = 0  # admitted inserts not yet landed
        self.cancelled = False
        self._cond: asyncio.Condition | None = None
        self._routers: dict[Any, _Router] = {}
        self._waiting: list[_Request] = []
        self._vtime = 0.0  # the tag of the last request admitted
        self._seq = 0
        self._pruned = 0.0
        self._learners: dict[Any, int] = {}  # samples each learner reported (totals)
        self._stats = {"insert_waits": 0, "insert_wait_s": 0.0, "sample_waits": 0,
                       "sample_wait_s": 0.0, "failed_inserts": 0, "returned_samples": 0,
                       "released_inserts": 0, "sample_reports": 0}  # fmt: skip

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # made on the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    async def _notify(self) -> None:
        async with self._condition():
            self._condition().notify_all()

    def _size(self) -> int:
        return int(min(self.limiter.inserts, self.capacity))

    # -- routers -------------------------------------------------------------------------
    def _router(self, key: Any, weight: float | None = None) -> _Router:
        """The entry of router ``key`` (made on first sight), its last call now."""
        now = time.monotonic()
        self._prune(now)
        entry = self._routers.get(key)
        if entry is None:
            entry = self._routers[key] = _Router()
        if weight is not None:
            entry.weight = weight
        entry.last = now
        return entry

    def _prune(self, now: float) -> None:
        """Forget routers silent for ``forget_after`` s; release what they never settled.

        O(routers), at most once a second (or every ``forget_after`` s, if shorter).
        """
        if now - self._pruned < min(1.0, self.forget_after):
            return
        self._pruned = now
        gone = [k for k, e in self._routers.items()
                if not e.waiting and now - e.last >= self.forget_after]  # fmt: skip
        for key in gone:
            self._release(self._routers.pop(key))

    def _release(self, entry: _Router) -> None:
        self.pending = max(0, self.pending - entry.pending)
        self._stats["released_inserts"] += entry.pending
        entry.pending = 0

    def _ahead(self, req: _Request) -> int:
        """Rows the waiting requests served before ``req`` ask for. O(waiting)."""
        return sum(r.count for r in self._waiting if r is not req and r.before(req))

    def _room(self, req: _Request) -> float:
        """The largest request that ``req``'s place in the queue would have admitted now."""
        lim = self.limiter
        taken = self.pending + self._ahead(req)
        fill = lim.min_size_to_sample - self._size() - taken  # stage 1
        if math.isinf(lim.max_diff):
            return math.inf
        ratio = math.floor((lim.max_diff + lim.samples) / lim.samples_per_insert + 1e-9)
        return float(max(0, fill, ratio - lim.inserts - taken))

    # -- inserts ---------------------------------------------------------------------------
    async def admit_insert(
        self, count: int, timeout: float | None = None, router: Any = None, weight: float = 1.0
    ) -> dict[str, Any]:
        """Wait until ``router`` may insert ``count`` rows, admit them.

        Returns ``{"waited": seconds, "room": rows a next request of this
        router would be admitted for now (inf: no upper bound), "inserts",
        "samples"}``; routers answer ``can_insert`` from ``room``.

        Raises:
            ValueError: a batch this large can never pass (split it), or a
                bad weight.
            RateLimitTimeout: still blocked after ``timeout`` s (nothing admitted).
            RateLimiterCancelled: :meth:`cancel` was called.
        """
        k = check_int("count", count, minimum=1)
        w = check_real("weight", weight, minimum=0.0)
        if not 0.0 < w < math.inf:
            raise ValueError(f"`weight` must be > 0 and finite, got weight={w}")
        lim = self.limiter
        width = lim.max_diff - lim.min_diff
        if k * lim.samples_per_insert > width and k > lim.min_size_to_sample:
            raise ValueError(
                f"a batch of {k} inserts can never pass this rate limiter: count * "
                f"samples_per_insert = {k * lim.samples_per_insert:g} exceeds the width "
                f"{width:g} of its range; send smaller batches or widen error_buffer"
            )
        entry = self._router(router, w)
        self._seq += 1
        req = _Request(router, k, max(entry.finish, self._vtime), self._seq)

        def ready() -> bool:
            return lim.can_insert(self.pending + self._ahead(req) + k, self._size())

        def admit() -> None:
            self.pending += k
            self._vtime = max(self._vtime, req.tag)
            entry.finish = req.tag + k / entry.weight
            entry.admitted += k
            entry.pending += k

        def enter() -> None:
            self._waiting.append(req)
            entry.waiting += 1
            entry.waits += 1

        def leave() -> None:
            self._waiting.remove(req)
            entry.waiting -= 1

        waited = await self._wait("insert", ready, admit, timeout, enter, leave)
        entry.wait_s += waited
        entry.last = time.monotonic()
        nxt = _Request(router, 0, max(entry.finish, self._vtime), self._seq + 1)  # its next
        return {"waited": waited, "room": self._room(nxt), "inserts": lim.inserts,
                "samples": lim.samples}  # fmt: skip

    async def await_insert(
        self, count: int, timeout: float | None = None, router: Any = None, weight: float = 1.0
    ) -> float:
        """:meth:`admit_insert`, returning only the seconds waited."""
        reply = await self.admit_insert(count, timeout, router, weight)
        return float(reply["waited"])

    async def settle_insert(self, landed: int, failed: int = 0, router: Any = None) -> None:
        """Admitted inserts of ``router`` that ``landed`` in a shard (counted) or ``failed``."""
        landed, failed = int(landed), int(failed)
        entry = self._router(router)
        done = min(entry.pending, landed + failed)  # what a forgotten router held is released
        entry.pending -= done
        entry.landed += landed
        entry.failed += failed
        self.pending = max(0, self.pending - done)
        self.limiter.record_insert(landed)
        self._stats["failed_inserts"] += failed
        await self._notify()

    async def leave(self, router: Any = None) -> None:
        """Forget ``router`` now (``ShardRouter.close``); inserts it never settled are released."""
        entry = self._routers.get(router)
        if entry is not None and not entry.waiting:
            self._release(self._routers.pop(router))
            await self._notify()

    # -- samples ---------------------------------------------------------------------------
    async def report_samples(self, learner: Any, total: int) -> None:
        """The learner ``learner`` has sampled ``total`` transitions so far (sent, not awaited).

        Totals, not increments: a report that arrives late or twice changes
        nothing. Counted even after :meth:`cancel` (the counts stay true).
        """
        total = check_int("total", total, minimum=0)
        before = self._learners.get(learner, 0)
        if total > before:  # counted before the first await: in arrival order, atomically
            self._learners[learner] = total
            self.limiter.record_sample(total - before)
        self._stats["sample_reports"] += 1
        await self._notify()

    async def learner_state(self, learner: Any = None) -> dict[str, Any]:
        """The limiter's :meth:`state_dict` and ``"reported"``: what ``learner`` reported so far."""
        return {**self.limiter.state_dict(), "reported": self._learners.get(learner, 0)}

    async def await_sample(self, count: int, timeout: float | None = None) -> float:
        """Wait until a batch of ``count`` may be sampled, count it; seconds waited.

        For a learner that asks the actor before each sample;
        :class:`RateLimitedSharded` decides by itself and reports its count
        with :meth:`report_samples` instead.

        Raises:
            ValueError: the range is too narrow for a batch this large.
            RateLimitTimeout, RateLimiterCancelled: as for :meth:`admit_insert`.
        """
        lim = self.limiter
        b = lim.check_batch(check_int("count", count, minimum=1))
        return await self._wait(
            "sample", lambda: lim.can_sample(b, self._size()), lambda: lim.record_sample(b), timeout
        )

    async def return_sample(self, count: int) -> None:
        """Give back a sample admitted whose call then failed (nothing was sampled)."""
        b = check_int("count", count, minimum=0)
        self.limiter.record_sample(-b)  # the arithmetic stays RateLimiter's
        self._stats["returned_samples"] += b
        await self._notify()

    async def _wait(
        self, side: str, ready: Callable[[], bool], commit: Callable[[], None],
        timeout: float | None, enter: Callable[[], None] | None = None,
        leave: Callable[[], None] | None = None,
    ) -> float:  # fmt: skip
        """Wait until ``ready()``, then ``commit()`` and wake the others, all under the condition.

        ``enter`` / ``leave`` run when the call starts and stops waiting.
        """
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
            if enter is not None:
                enter()
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
                if leave is not None:
                    leave()
                    cond.notify_all()  # the requests behind this one may fit now
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
        await self._notify()

    async def stats(self) -> dict[str, Any]:
        """Counters and waits: inserts (landed), pending, samples, diff, waits per side.

        ``"routers"``: per router key (as ``repr``), its weight, rows admitted,
        landed, failed and pending, its waits and seconds waited, requests
        waiting now and seconds since its last call. ``"learners"``: the
        samples each learner reported.
        """
        lim = self.limiter
        now = time.monotonic()
        self._prune(now)
        routers = {repr(k): e.row(now) for k, e in self._routers.items()}
        return {"inserts": lim.inserts, "pending": self.pending, "samples": lim.samples,
                "diff": lim.diff, "min_diff": lim.min_diff, "max_diff": lim.max_diff,
                "blocked": lim.blocked_side(self._size()), **self._stats, "routers": routers,
                "learners": {repr(k): v for k, v in self._learners.items()}}  # fmt: skip

    async def state_dict(self) -> dict[str, Any]:
        """The limiter's settings and landed counters (:meth:`RateLimiter.state_dict`)."""
        return self.limiter.state_dict()


def rate_limiter(
    samples_per_insert: float = 1.0,
    min_size_to_sample: int = 1,
    error_buffer: float | tuple[float, float] | None = None,
    *,
    capacity: int | None = None,
    forget_after: float = 60.0,
    num_cpus: float = 0.0,
    actor_options: Mapping[str, Any] | None = None,
) -> Any:
    """Start a rate limiter actor; returns its handle (pass it to routers and the learner).

    The settings are checked here first (the same errors and warnings as
    :class:`~fastper.limiter.RateLimiter`). ``capacity``: the transitions all
    shards hold together, if the limiter should know the buffer is full.
    ``forget_after``: seconds of silence after which a router's share and
    unsettled inserts are dropped (see the module docstring).
    The actor reserves ``num_cpus`` (0: it mostly waits).
    """
    RateLimiter(samples_per_insert, min_size_to_sample, error_buffer)  # raises / warns here
    forget = check_real("forget_after", forget_after, minimum=0.0)
    ray = require_ray()
    opts: dict[str, Any] = {"num_cpus": check_real("num_cpus", num_cpus, minimum=0.0),
                            "max_restarts": 0}  # fmt: skip
    opts.update(actor_options or {})
    cls = ray.remote(RateLimiterActor)
    return cls.options(**opts).remote(
        samples_per_insert, min_size_to_sample, error_buffer, capacity, None, forget
    )


def _grace(timeout: float | None) -> float | None:
    """How long to wait for a limiter reply to a call allowed ``timeout`` seconds (``None``: for ever)."""
    return None if timeout is None else timeout + LIMITER_GRACE


class RateLimitedSharded:
    """The learner's sharded buffer, sampled at the rate limiter's ratio without a call per step.

    Args:
        sharded: a :class:`~fastper.distributed.ShardedReplayBuffer`.
        limiter: the handle from :func:`rate_limiter` (the actors' routers hold it too).
        timeout: default seconds ``sample`` waits for inserts (``None``: for ever).
        publish_interval: the sample count goes to the limiter actor (a message
            not awaited) when a sample finds the last one older than this (s).
        publish_every: ... or when this many samples were not sent yet
            (``None``: by time only).
        key: this learner's name at the limiter (one per learner).

    ``sample(B)`` decides by itself, with :class:`~fastper.limiter.RateLimiter`
    arithmetic over the limiter's settings: inserts are the limiter's count
    when this wrapper was made plus what the shards took since (their
    ``added``, as of the last replies: every sample refreshes them); samples
    are the limiter's count then plus this learner's since. When the learner
    is ahead, it sends its count at once and polls the shards (one parallel
    round trip, 1 ms apart doubling up to 50 ms) until the inserts catch up,
    or raises :class:`~fastper.limiter.RateLimitTimeout` after ``timeout``
    (nothing sampled, the sharded buffer's generator and step as they were).
    In the steady state a sample is the sharded buffer's one round trip and
    nothing else.

    How far the actors' view lags: after every ``sample``, the limiter actor
    has been sent every sample this learner drew up to ``publish_interval``
    seconds before (and all but fewer than ``publish_every``), so the
    actors may be held back early by at most that many samples' worth of
    inserts, never let through late. Samples drawn just before the learner
    pauses are sent at its next ``sample``, ``publish()`` or ``stats()``; call
    :meth:`publish` before a long pause (an evaluation, a checkpoint).

    Made once per learner: construction asks the limiter for its settings
    and the shards for their views (two round trips). One learner per
    limiter decides the sample side (the count it decides on is its own).
    Inserts should come through routers holding the same limiter; the
    learner's own ``add`` here counts its rows too (a round trip to the
    limiter, then the shard's). Everything else (``update_priorities``,
    ``save``, ``flush``, ...) is the sharded buffer's, unlimited. Not
    thread-safe, like the sharded buffer.
    """

    def __init__(
        self,
        sharded: Any,
        limiter: Any,
        *,
        timeout: float | None = None,
        publish_interval: float = 0.01,
        publish_every: int | None = None,
        key: Any = "learner",
    ) -> None:
        for name in ("sample", "add", "update_priorities", "views", "refresh"):
            if not callable(getattr(sharded, name, None)):
                raise TypeError(
                    f"`sharded` must be a ShardedReplayBuffer, got sharded={show(sharded)}"
                )
        self.timeout = None if timeout is None else check_real("timeout", timeout, minimum=0.0)
        self.publish_interval = check_real("publish_interval", publish_interval, minimum=0.0)
        self.publish_every = (
            None if publish_every is None else check_int("publish_every", publish_every, minimum=1)
        )
        self.sharded = sharded
        self.limiter = limiter
        self.key = key
        self._fields: dict[str, Any] | None = None
        self._cancelled = False
        # the limiter's counts first, then the shards': rows that land in between are
        # missed (counted late, on the safe side), never counted twice
        state = dict(call_limiter(limiter.learner_state.remote(key), LIMITER_CALL_TIMEOUT,
                                  what="learner_state"))  # fmt: skip
        self._rule = RateLimiter.from_state_dict(state)
        self._inserts0, self._samples0 = self._rule.inserts, self._rule.samples
        self._sent = self._drawn = int(state.get("reported", 0))  # totals, as the actor counts
        self._drawn0 = self._drawn
        self._landed = 0
        sharded.refresh()
        self._added = self._added_now()
        self._sent_at = time.monotonic()
        self._stats = {"sample_waits": 0, "sample_wait_s": 0.0, "polls": 0, "publishes": 0}

    # -- the local verdict ---------------------------------------------------------------
    def _added_now(self) -> np.ndarray:
        return np.array([v.added for v in self.sharded.views()], dtype=np.int64)

    def _sync(self) -> None:
        """Take in the inserts the last replies show. O(shards), no call.

        A shard's ``added`` falls when it is restored from a checkpoint: its
        count goes on from there, and only growth is counted.
        """
        added = self._added_now()
        grown = added - self._added
        self._landed += int(grown[grown > 0].sum())
        self._added = added
        self._rule.inserts = self._inserts0 + self._landed
        self._rule.samples = self._samples0 + self._drawn - self._drawn0

    def _size(self) -> int:
        return int(min(self._rule.inserts, self.sharded.capacity))

    def _check(self, batch_size: Any) -> int:
        return self._rule.check_batch(check_int("batch_size", batch_size, minimum=1))

    def can_sample(self, batch_size: int = 1) -> bool:
        """Whether ``sample(batch_size)`` would go ahead now without waiting. No call.

        Answered from the shards' last replies (a sample's, or :meth:`refresh`'s):
        inserts since then are not seen.
        """
        b = self._check(batch_size)
        self._sync()
        return not self._cancelled and self._rule.can_sample(b, self._size())

    def sample(
        self, batch_size: int, beta: float | None = None, *, timeout: float | None = _DEFAULT
    ) -> Any:
        """``sharded.sample`` once the ratio allows ``batch_size`` more samples.

        Raises:
            ValueError: the limiter's range is too narrow for this batch.
            RateLimitTimeout: the inserts did not catch up within ``timeout``
                (nothing sampled).
            RateLimiterCancelled: :meth:`cancel` was called here.
            Exception: whatever ``sharded.sample`` or ``sharded.refresh``
                raise (nothing counted).
        """
        b = self._check(batch_size)
        t = self.timeout if timeout is _DEFAULT else timeout
        limit = None if t is None else check_real("timeout", t, minimum=0.0)
        if self._cancelled:
            raise RateLimiterCancelled("the rate limiter was cancelled; no sample was done")
        self._sync()
        if not self._rule.can_sample(b, self._size()):
            self._wait(b, limit)
        batch = self.sharded.sample(b, beta)  # raises: nothing counted
        self._drawn += b
        self._rule.record_sample(b)
        now = time.monotonic()
        unsent = self._drawn - self._sent
        if now - self._sent_at >= self.publish_interval or (
            self.publish_every is not None and unsent >= self.publish_every
        ):
            self._publish(now)
        return batch

    def _wait(self, b: int, limit: float | None) -> None:
        """Poll the shards until a batch of ``b`` is allowed; raise after ``limit`` s."""
        self._publish(time.monotonic())  # the actors may be waiting on this very count
        t0 = time.monotonic()
        self._stats["sample_waits"] += 1
        pause = POLL_FIRST_S
        try:
            while True:
                self.sharded.refresh()
                self._stats["polls"] += 1
                self._sync()
                if self._rule.can_sample(b, self._size()):
                    return
                left = None if limit is None else t0 + limit - time.monotonic()
                if left is not None and left <= 0:
                    lim = self._rule
                    raise RateLimitTimeout(
                        f"sample waited {limit:g} s for the rate limiter and gave up, nothing "
                        f"done: size {self._size()} (min_size_to_sample "
                        f"{lim.min_size_to_sample}), inserts {lim.inserts} (landed, as the "
                        f"shards last said), samples {lim.samples}, inserts*samples_per_insert"
                        f" - samples = {lim.diff:g} (allowed [{lim.min_diff:g}, "
                        f"{lim.max_diff:g}], a batch of {b} needs {lim.min_diff + b:g}); the "
                        "actors must insert first"
                    )
                time.sleep(pause if left is None else min(pause, left))
                pause = min(2.0 * pause, POLL_MAX_S)
        finally:
            self._stats["sample_wait_s"] += time.monotonic() - t0

    def _publish(self, now: float) -> None:
        """Send the sample count to the limiter actor if it changed; never awaited."""
        self._sent_at = now
        if self._drawn == self._sent:
            return
        self.limiter.report_samples.remote(self.key, self._drawn)
        self._sent = self._drawn
        self._stats["publishes"] += 1

    def publish(self) -> None:
        """Send the samples not yet sent to the limiter actor now (one message, not awaited)."""
        self._publish(time.monotonic())

    def cancel(self) -> None:
        """Cancel the limiter actor (every waiting router raises) and this learner's samples.

        One round trip. Later ``sample`` calls raise
        :class:`~fastper.limiter.RateLimiterCancelled`; the counts stay readable.
        """
        self._cancelled = True
        self._publish(time.monotonic())
        call_limiter(self.limiter.cancel.remote(), LIMITER_CALL_TIMEOUT, what="cancel")

    def add(
        self, transition: Mapping[str, Any], *, key: Any = None, shard: int | None = None,
        env_ids: Any = None, timeout: float | None = _DEFAULT,
    ) -> Any:  # fmt: skip
        """``sharded.add`` once the limiter admits its rows; counted as landed when it returns.

        Two round trips to the limiter (admission, count) besides the shard's.
        """
        if self._fields is None:
            self._fields = self.sharded.fields  # the shards' field spec, as describe() gives it
        rows = count_rows(self._fields, transition)
        wait = self.timeout if timeout is _DEFAULT else timeout
        call_limiter(self.limiter.await_insert.remote(rows, wait, self.key), _grace(wait),
                     what=f"await_insert({rows} rows)")  # fmt: skip
        try:
            out = self.sharded.add(transition, key=key, shard=shard, env_ids=env_ids)
        except BaseException:
            call_limiter(self.limiter.settle_insert.remote(0, rows, self.key),
                         LIMITER_CALL_TIMEOUT, what="settle_insert")  # fmt: skip
            raise
        call_limiter(self.limiter.settle_insert.remote(rows, 0, self.key), LIMITER_CALL_TIMEOUT,
                     what="settle_insert")  # fmt: skip
        return out

    def stats(self) -> dict[str, Any]:
        """The limiter actor's counters and waits, once it has this learner's count.

        Two round trips (the count, awaited; the stats). ``sample_waits`` and
        ``sample_wait_s`` include this learner's waits; ``learner`` holds
        them apart, with ``polls`` (shard round trips while waiting),
        ``publishes`` (counts sent), ``samples`` (drawn here) and the local
        verdict's ``inserts`` and ``diff``.
        """
        self._sent_at = time.monotonic()
        call_limiter(self.limiter.report_samples.remote(self.key, self._drawn),
                     LIMITER_CALL_TIMEOUT, what="report_samples")  # fmt: skip
        self._sent = self._drawn
        out = dict(call_limiter(self.limiter.stats.remote(), LIMITER_CALL_TIMEOUT, what="stats"))
        self._sync()
        mine = {**self._stats, "samples": self._drawn - self._drawn0,
                "inserts": self._rule.inserts, "diff": self._rule.diff}  # fmt: skip
        out["sample_waits"] = out.get("sample_waits", 0) + self._stats["sample_waits"]
        out["sample_wait_s"] = out.get("sample_wait_s", 0.0) + self._stats["sample_wait_s"]
        out["learner"] = mine
        return out

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("sharded", "limiter"):
            raise AttributeError(name)
        return getattr(self.sharded, name)

    def __len__(self) -> int:
        return len(self.sharded)
