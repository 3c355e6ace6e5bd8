"""Actors insert straight into the shards: :class:`ShardRouter` (Ray).

The learner's :class:`~fastper.distributed.ShardedReplayBuffer` need not see
the data actors produce: each actor holds a router (made by
``RayTransport.router()``, pickled into the actor like any argument) that
sends its batches to a shard and keeps a few in flight. The coordinator
learns the new totals at its next sample, which asks every live shard (a
shard it saw empty included; the probabilities it returns are always the ones
actually used; see :mod:`.coordinator` and :mod:`.plan`).

Placement (``placement=``):

* ``"local"`` (default): a shard on the actor's own Ray node, so the batch
  never crosses the network; among several (or none: then among all), the
  one the actor's key picks by rendezvous hashing, so each actor's stream
  stays on one shard and the actors spread over the shards;
* ``"key"``: the shard the key picks by rendezvous hashing over all shards
  (the same key always lands on the same shard, wherever the actor runs).

The key is the router's ``key`` (default: the id of the Ray actor using it,
else of the worker process), or a key given to :meth:`ShardRouter.add`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .._validation import check_int, check_real
from ..limiter import RateLimitTimeout
from .plan import rendezvous
from .ray_common import (
    LIMITER_CALL_TIMEOUT,
    LIMITER_GRACE,
    call_limiter,
    count_rows,
    lost_types,
    require_ray,
    unwrap_ray_error,
)
from .transport import ShardLostError, ShardLostWarning

__all__ = ["ShardRouter", "count_rows"]

_PLACEMENTS = ("local", "key")


class ShardRouter:
    """Batched, asynchronous inserts from one actor into the shards; picklable.

    Args:
        actors: the shard actors' handles in shard order (``transport.actors``).
        nodes: each shard's Ray node (hex), ``None`` where unknown.
        fields: the field spec, to count the rows of a batch (``transport.router()``
            fills it in).
        placement: ``"local"`` or ``"key"`` (see the module docstring).
        key: this router's key (default: the Ray actor id where it is used).
        max_in_flight: inserts sent and not yet answered, at most (>= 1); the
            next :meth:`add` waits for the oldest. More hides more latency,
            and holds more batches in memory.
        limiter: a rate limiter actor (:func:`~fastper.distributed.ray_limiter.rate_limiter`)
            to ask before every insert, or ``None``.
        limiter_timeout: seconds an insert may wait for the limiter
            (``None``: for ever); then :class:`~fastper.limiter.RateLimitTimeout`.
            Every call on the limiter waits at most this long for its reply
            (plus :data:`~fastper.distributed.ray_common.LIMITER_GRACE`).
        limiter_weight: this router's weight in the limiter's insert quotas
            (> 0; see :mod:`~fastper.distributed.ray_limiter`): routers that
            keep asking share the insert rate in proportion to their weights.
        timeout: seconds an :meth:`add` or a :meth:`flush` waits for the
            shards' replies, in all (``None``: for ever); a shard that has not
            answered by then is treated as lost (see below).
            ``transport.router()`` gives the transport's ``timeout``.

    Costs per :meth:`add`: one message to the shard (not awaited) and a
    non-blocking check of the replies in flight; with a limiter one round
    trip to it before sending (it blocks while the actors are ahead; replies
    that come in meanwhile are taken in and reported to it) and one message
    after the shard answers. :meth:`flush` waits for all in flight.

    A shard that is gone (its reply says so), or silent past ``timeout``, is
    dropped from this router's placement: later inserts go to the others (rendezvous moves only the keys
    it held), the rows in flight to it are counted in :attr:`dropped` and a
    :class:`~fastper.distributed.ShardLostWarning` is issued. A shard restored
    by the learner is a new actor: hand the actors a new ``transport.router()``.
    Errors a shard raises for a batch (bad fields, ...) come back on a later
    ``add`` or ``flush``, as themselves.
    """

    def __init__(
        self,
        actors: Sequence[Any],
        nodes: Sequence[str | None],
        *,
        fields: Mapping[str, Any],
        placement: str = "local",
        key: Any = None,
        max_in_flight: int = 4,
        limiter: Any = None,
        limiter_timeout: float | None = None,
        limiter_weight: float = 1.0,
        timeout: float | None = None,
    ) -> None:
        if not actors:
            raise ValueError("`actors` must hold at least one shard actor")
        if len(nodes) != len(actors):
            raise ValueError(
                f"`nodes` must name one node per actor ({len(actors)}), got {len(nodes)}"
            )
        if placement not in _PLACEMENTS:
            raise ValueError(f"`placement` must be one of {list(_PLACEMENTS)}, got {placement!r}")
        self._actors = list(actors)
        self._nodes = list(nodes)
        self._fields = {k: (tuple(v[0]), v[1]) for k, v in fields.items()}
        self.placement = placement
        self.key = key
        self.max_in_flight = check_int("max_in_flight", max_in_flight, minimum=1)
        self.limiter = limiter
        self.limiter_timeout = (
            None if limiter_timeout is None else check_real("limiter_timeout", limiter_timeout, minimum=0.0)
        )  # fmt: skip
        self.limiter_weight = check_real("limiter_weight", limiter_weight, minimum=0.0)
        if not 0.0 < self.limiter_weight < float("inf"):
            raise ValueError(f"`limiter_weight` must be > 0 and finite, got {limiter_weight!r}")
        self._room: float | None = None  # rows the limiter last said a next insert may take
        self._heard_at = 0.0  # when (time.monotonic())
        self.timeout = None if timeout is None else check_real("timeout", timeout, minimum=0.0)
        self._lost: set[int] = set()
        self._pending: list[tuple[int, Any, int]] = []  # (shard, ref, rows)
        self._settles: list[Any] = []  # the limiter's acknowledgements, not awaited
        self.inserted = 0
        self.dropped = 0
        self._here: str | None = None
        self._own_key: Any = None

    # -- pickling: handles and settings travel, what is in flight does not ---------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_pending=[], _settles=[], _here=None, _own_key=None, inserted=0, dropped=0)
        state.update(_room=None, _heard_at=0.0)  # what this router heard stays here
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- placement -------------------------------------------------------------------
    @property
    def n_shards(self) -> int:
        """Shards this router knows (lost ones included)."""
        return len(self._actors)

    @property
    def lost_shards(self) -> list[int]:
        """Shards this router saw gone and no longer sends to."""
        return sorted(self._lost)

    @property
    def in_flight(self) -> int:
        """Inserts sent and not yet answered."""
        return len(self._pending)

    def _my_key(self) -> Any:
        if self.key is not None:
            return self.key
        if self._own_key is None:
            ctx = require_ray().get_runtime_context()
            self._own_key = ctx.get_actor_id() or ctx.get_worker_id()
        return self._own_key

    def _my_node(self) -> str:
        if self._here is None:
            self._here = str(require_ray().get_runtime_context().get_node_id())
        return self._here

    def shard_for(self, key: Any = None) -> int:
        """The shard an insert with ``key`` (default: the router's key) goes to. O(K).

        Raises:
            ShardLostError: every shard is lost.
        """
        live = [s for s in range(len(self._actors)) if s not in self._lost]
        if not live:
            raise ShardLostError(max(self._lost), "every shard this router knows is lost")
        k = self._my_key() if key is None else key
        if self.placement == "local":
            here = self._my_node()
            near = [s for s in live if self._nodes[s] == here]
            return rendezvous(k, near or live)
        return rendezvous(k, live)

    # -- inserts ---------------------------------------------------------------------
    def add(
        self, transition: Mapping[str, Any], *, key: Any = None, env_ids: Any = None,
        priorities: Any = None,
    ) -> int:  # fmt: skip
        """Send one transition or a batch to its shard; returns the shard. Does not wait for it.

        With a limiter, first waits until it admits the batch's rows.

        Raises:
            RateLimitTimeout: the limiter kept the insert waiting past
                ``limiter_timeout`` (nothing was sent).
            ShardLostError: every shard is lost.
            Exception: whatever a shard raised for an earlier batch of this router.
        """
        rows = count_rows(self._fields, transition)
        deadline = _deadline(self.timeout)
        self._collect(block=False)
        while len(self._pending) >= self.max_in_flight:
            self._collect(block=True, oldest_only=True, deadline=deadline)
        s = self.shard_for(key)
        if self.limiter is not None:
            self._admit(rows)
        self._send(s, transition, env_ids, priorities, rows)
        return s

    def _admit(self, rows: int) -> None:
        """Wait for the limiter to admit ``rows``, settling answered inserts meanwhile.

        The limiter counts only settled inserts for the learner's side; if this
        router stopped settling while it waited, rows already in the shards
        could hold the learner back while the learner holds this router back.
        """
        ray = require_ray()
        ref = self.limiter.admit_insert.remote(
            rows, self.limiter_timeout, self._my_key(), self.limiter_weight
        )
        wait = self._limiter_wait()
        deadline = _deadline(wait)
        what = f"admit_insert({rows} rows)"
        try:
            while self._pending:
                ready, _ = ray.wait([ref, *(p[1] for p in self._pending)], num_returns=1,
                                    timeout=_left(deadline))  # fmt: skip
                if not ready or any(r.hex() == ref.hex() for r in ready):
                    break  # the limiter's answer, or its silence, is call_limiter's to report
                self._collect(block=False)
        except BaseException:
            try:  # an earlier batch failed: once admitted, give this one back
                call_limiter(ref, _left(deadline), what=what, allowed=wait)
                call_limiter(self.limiter.settle_insert.remote(0, rows, self._my_key()), wait,
                             what=f"settle_insert(0, {rows})")  # fmt: skip
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        self._heard(call_limiter(ref, _left(deadline), what=what, allowed=wait))

    #: seconds the room heard from the limiter is trusted by :meth:`can_insert`
    room_ttl: float = 0.05

    def _heard(self, reply: Any) -> None:
        """Keep what the limiter's admission said: the room a next insert has."""
        room = reply.get("room") if isinstance(reply, Mapping) else None
        self._room = None if room is None else float(room)
        self._heard_at = time.monotonic()

    def can_insert(self, rows: int = 1) -> bool:
        """Whether an insert of ``rows`` would go ahead without waiting, as last heard. No call.

        Without a limiter: whether a batch may be sent without waiting for
        one in flight. With one: also whether the room the limiter gave with
        this router's last admission (what its next request would have been
        admitted for then, after the requests of others waiting ahead of it)
        covers ``rows``. ``True`` when nothing was heard in the last
        :attr:`room_ttl` seconds (then :meth:`try_add` asks again: at most
        one round trip per ``room_ttl`` while the limiter says no). Other
        routers may have taken that room since (then ``add`` waits), or the
        learner may have freed more (then this says ``False`` too early).
        """
        n = check_int("rows", rows, minimum=1)
        if len(self._pending) >= self.max_in_flight:
            return False
        if self.limiter is None or self._room is None:
            return True
        return n <= self._room or time.monotonic() - self._heard_at >= self.room_ttl

    def try_add(
        self, transition: Mapping[str, Any], *, key: Any = None, env_ids: Any = None,
        priorities: Any = None,
    ) -> int | None:  # fmt: skip
        """:meth:`add` if it goes ahead without waiting: the shard, or ``None`` (nothing sent).

        Never waits: ``None`` when the batches in flight are at
        ``max_in_flight`` (after taking in those answered) or, with a limiter,
        when :meth:`can_insert` says no (no call); otherwise the limiter is
        asked with a timeout of 0 (one round trip, answered at once) and a
        refusal is ``None`` too.

        Raises:
            ShardLostError, Exception: as :meth:`add`.
        """
        rows = count_rows(self._fields, transition)
        self._collect(block=False)
        if not self.can_insert(rows):
            return None
        s = self.shard_for(key)
        if self.limiter is not None:
            ref = self.limiter.admit_insert.remote(rows, 0.0, self._my_key(), self.limiter_weight)
            try:  # a limiter that does not answer at once counts as a refusal too
                self._heard(call_limiter(ref, LIMITER_GRACE, what=f"admit_insert({rows} rows)"))
            except RateLimitTimeout:  # refused: no room, as of now
                self._room, self._heard_at = 0.0, time.monotonic()
                return None
        self._send(s, transition, env_ids, priorities, rows)
        return s

    def _send(self, s: int, transition: Any, env_ids: Any, priorities: Any, rows: int) -> None:
        """Send one insert to shard ``s``'s actor (not awaited)."""
        actor = self._actors[s]
        if priorities is None:
            ref = actor.add.remote(transition, env_ids)
        else:
            ref = actor.add.remote(transition, env_ids, priorities)
        self._pending.append((s, ref, rows))

    def close(self) -> int:
        """:meth:`flush`, then tell the limiter this router is done (its quota row goes).

        Returns :attr:`inserted`. The router may still be used afterwards (it
        is then a new router to the limiter).
        """
        inserted = self.flush()
        if self.limiter is not None:
            call_limiter(self.limiter.leave.remote(self._my_key()), LIMITER_CALL_TIMEOUT,
                         what="leave")  # fmt: skip
        return inserted

    def _limiter_wait(self) -> float | None:
        """Seconds a call on the limiter may wait for its reply (``None``: for ever)."""
        return None if self.limiter_timeout is None else self.limiter_timeout + LIMITER_GRACE

    def flush(self) -> int:
        """Wait for every insert in flight (and the limiter's count of them); rows confirmed so far.

        Returns :attr:`inserted`, the rows the shards confirmed since this
        router was made (or unpickled). Waits at most ``timeout`` for the
        shards (those still silent are then treated as lost) and
        ``limiter_timeout`` (plus a grace) for the limiter.

        Raises:
            RateLimitTimeout: the limiter did not answer in time.
            Exception: whatever a shard raised for a batch of this router (as
                soon as it is known).
        """
        deadline = _deadline(self.timeout)
        while self._pending:
            self._collect(block=True, oldest_only=False, deadline=deadline)
        if self._settles:
            settles, self._settles = self._settles, []
            wait = self._limiter_wait()
            until = _deadline(wait)
            for ref in settles:
                call_limiter(ref, _left(until), what="settle_insert", allowed=wait)
        return self.inserted

    def _collect(
        self, *, block: bool, oldest_only: bool = False, deadline: float | None = None
    ) -> None:
        """Take in answered inserts: all that are done, after waiting (when ``block``) for
        the oldest, or for any one; until ``deadline`` (``time.monotonic()``), after which
        the shards still silent are treated as lost."""
        if not self._pending:
            return
        ray = require_ray()
        refs = [p[1] for p in self._pending]
        waited: list[Any] = []
        if block:
            waited = refs[:1] if oldest_only else refs
            got, _ = ray.wait(waited, num_returns=1, timeout=_left(deadline), fetch_local=False)
            if got:
                waited = []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        done = {r.hex() for r in ready}
        # past the deadline: the shards of what was waited for and is still unanswered
        silent = {s for s, ref, _ in self._pending[: len(waited)] if ref.hex() not in done}
        keep = []
        first_error: BaseException | None = None
        landed = failed = 0
        for s, ref, rows in self._pending:
            if ref.hex() not in done:
                if s in silent:  # its fate unknown: released, not counted
                    failed += rows
                    self.dropped += rows
                else:
                    keep.append((s, ref, rows))
                continue
            try:
                ray.get(ref)
                landed += rows
            except lost_types(ray) as exc:
                failed += rows
                self.dropped += rows
                if s not in self._lost:
                    self._lost.add(s)
                    warnings.warn(
                        f"shard {s} is lost ({type(exc).__name__}); this router sends to the "
                        f"{len(self._actors) - len(self._lost)} others from now on",
                        ShardLostWarning, stacklevel=3,
                    )  # fmt: skip
            except ray.exceptions.RayTaskError as exc:
                failed += rows
                if first_error is None:
                    first_error = unwrap_ray_error(exc)
        for s in sorted(silent - self._lost):
            self._lost.add(s)
            warnings.warn(
                f"shard {s} did not answer an insert within timeout={self.timeout:g} s and is "
                f"treated as lost; this router sends to the {len(self._actors) - len(self._lost)} "
                "others from now on (a stuck or overloaded shard: the learner may restart "
                "it, then hand the actors a new router; or allow the router a longer timeout)",
                ShardLostWarning, stacklevel=3,
            )  # fmt: skip
        self._pending = keep
        self.inserted += landed
        if self.limiter is not None and (landed or failed):
            self._settles.append(
                self.limiter.settle_insert.remote(landed, failed, self._my_key())
            )
            if len(self._settles) > 64:  # forget those already done
                n = len(self._settles)
                _, self._settles = ray.wait(self._settles, num_returns=n, timeout=0)
        if first_error is not None:
            raise first_error

    def __repr__(self) -> str:
        return (
            f"ShardRouter(shards={len(self._actors)}, placement={self.placement!r}, "
            f"key={self.key!r}, in_flight={len(self._pending)}, lost={sorted(self._lost)})"
        )


def _deadline(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` time ``timeout`` seconds from now (``None``: none)."""
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``None``: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
