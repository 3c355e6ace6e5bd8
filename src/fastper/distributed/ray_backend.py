"""Sharded replay on Ray: shards as Ray actors, reached through :class:`RayTransport`.

Install the extra first: ``pip install 'fastper[ray]'``. Importing this module
does not import Ray; the first call that needs it does, and says how to
install it when it is missing.

Pieces:

* :class:`ShardHost`: the actor body, a :class:`~fastper.distributed.Shard`
  that builds (or loads) its buffer in the process it runs in, so no buffer
  ever travels through Ray's object serialisation;
* :class:`RayTransport`: the :class:`~fastper.distributed.Transport` over
  those actors (one actor method call per ``submit``; ``results`` waits with
  an optional timeout and maps a gone actor to
  :class:`~fastper.distributed.ShardLostError`);
* :func:`ray_shards`, :func:`sharded_on_ray`, :func:`load_on_ray`: start K
  shard actors (empty, or from a saved set) and the learner's
  :class:`~fastper.distributed.ShardedReplayBuffer` over them;
* :class:`~fastper.distributed.ray_router.ShardRouter` (actors insert straight
  into shards) and :mod:`~fastper.distributed.ray_limiter` (a samples-per-insert
  rate limiter across processes), re-exported here; what they share
  (importing Ray, its errors) is :mod:`~fastper.distributed.ray_common`'s.

Checkpoints are always fastper files written by the shards themselves (on
their own machine: give ``save`` a directory every shard can reach, e.g. a
shared file system). Ray moves call arguments and replies with pickle: run the
cluster where only you can reach it (see "Who may connect" in ``docs/guides/ray.md``).
"""

from __future__ import annotations

import inspect
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._validation import check_int, check_real, show
from ..errors import CheckpointError
from .coordinator import ShardedReplayBuffer
from .ray_common import lost_types, require_ray, unwrap_ray_error
from .ray_limiter import RateLimitedSharded, RateLimiterActor, rate_limiter
from .ray_router import ShardRouter
from .shard import Shard
from .transport import ShardLostError

__all__ = [
    "RateLimitedSharded",
    "SHARD_CPUS",
    "START_TIMEOUT",
    "RateLimiterActor",
    "RayTransport",
    "ShardHost",
    "ShardRouter",
    "load_on_ray",
    "rate_limiter",
    "ray_shards",
    "require_ray",
    "sharded_on_ray",
    "unwrap_ray_error",
]

_PLACEMENTS = ("spread", "local")
#: how the learner's hot calls reach the shards: direct sockets (default) or Ray actor calls
_CHANNELS = ("socket", "ray")

#: CPUs Ray reserves for each shard actor by default: a fraction, so that 8
#: shards fit a 2-CPU machine (a shard mostly waits for calls; Ray does not
#: cap an actor's use at its reservation)
SHARD_CPUS = 0.25
#: seconds :func:`ray_shards` and :func:`load_on_ray` wait for their actors to be
#: scheduled and answer by default, before they say what could not be scheduled
START_TIMEOUT = 120.0


# -- the actor body ---------------------------------------------------------------
class ShardHost(Shard):
    """A :class:`Shard` that makes its buffer where it runs (the body of a shard actor).

    Made empty (no buffer) and then given one by :meth:`build` or
    :meth:`reload`, so that a bad setting or a bad checkpoint comes back from
    an ordinary method call, as the error it is, not as a failed actor.
    Plain Python: usable without Ray (``ray.remote(ShardHost)`` is the actor).
    """

    def __init__(self, buffer: Any = None) -> None:
        if buffer is not None:
            super().__init__(buffer)

    def __getattr__(self, name: str) -> Any:
        # only reached while ``buffer`` is unset
        if name == "buffer":
            raise RuntimeError("this shard has no buffer yet: call build() or reload() first")
        raise AttributeError(name)

    def build(
        self, capacity: int, fields: Mapping[str, Any], uniform: bool = False,
        buffer_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Make an empty buffer here (``ReplayBuffer`` if ``uniform`` else ``PrioritizedReplayBuffer``).

        Returns :meth:`describe`. O(capacity) memory, allocated on this process.
        """
        from ..buffers import PrioritizedReplayBuffer, ReplayBuffer

        cls = ReplayBuffer if uniform else PrioritizedReplayBuffer
        Shard.__init__(self, cls(capacity, fields, **dict(buffer_kwargs or {})))
        return self.describe()

    def reload(self, path: str) -> dict[str, Any]:
        """Replace this shard's buffer by the one saved at ``path`` (a fastper file). O(N) read.

        Returns :meth:`describe`. Keys continue from the file's insertion
        counter.
        """
        from ..loading import load

        Shard.__init__(self, load(path))
        return self.describe()

    def priorities(self, slots: Any) -> np.ndarray:
        """Raw priorities p_i of written slots (for checks and tests). O(B)."""
        return np.asarray(self.buffer.priorities(slots))

    def open_channel(self, token: bytes, local: bool = False) -> Any:
        """Listen for the learner's socket channel (see :mod:`.wire`); the address to connect to.

        Binds to this node's IP (a ``(host, port)``), or with ``local`` (the
        learner runs on this node) to a Linux abstract Unix socket (its name).
        A connection must present ``token`` first. Opening it again closes
        the previous listener (a restarted learner).
        """
        from .wire import ChannelServer

        old = getattr(self, "_channel_server", None)
        if old is not None:
            old.close()
        host = str(require_ray().util.get_node_ip_address())
        server = ChannelServer({"step": self.channel_step}, bytes(token), host, local=bool(local))
        self._channel_server = server
        return server.address

    def node_id(self) -> str:
        """The Ray node this shard runs on (hex)."""
        return str(require_ray().get_runtime_context().get_node_id())


_REMOTE: dict[str, Any] = {}


def _copied(fn: Any) -> Any:
    """A copy of function ``fn`` (same code, globals, defaults, closure and doc)."""
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)  # fmt: skip
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__doc__, out.__qualname__, out.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
    out.__annotations__ = dict(fn.__annotations__)
    return out


def _shard_actor_class() -> Any:
    """``ray.remote`` of a subclass of :class:`ShardHost`, made once per process.

    Ray edits the methods of the class it makes an actor of in place (it adds
    a tracing argument to their signatures); the subclass holds copies of
    every method, so ``Shard`` and ``ShardHost`` in this process stay as written.
    """
    if "shard" not in _REMOTE:
        methods: dict[str, Any] = {}
        for klass in reversed(ShardHost.__mro__[:-1]):  # Shard's, then ShardHost's own
            for name, attr in vars(klass).items():
                if inspect.isfunction(attr):
                    methods[name] = _copied(attr)
        actor_cls = type("ShardActor", (ShardHost,), methods)
        _REMOTE["shard"] = require_ray().remote(actor_cls)
    return _REMOTE["shard"]


class _Call:
    """A pending call on one shard: its number and Ray's object ref."""

    __slots__ = ("ref", "shard")

    def __init__(self, shard: int, ref: Any) -> None:
        self.shard, self.ref = shard, ref

    def __repr__(self) -> str:
        return f"_Call(shard={self.shard}, ref={self.ref!r})"


# -- the transport -----------------------------------------------------------------
class _Own:
    """The transport's own :attr:`RayTransport.timeout` (a ``timeout=`` left out)."""

    def __repr__(self) -> str:
        return "the transport's timeout"


_OWN: Any = _Own()


class RayTransport:
    """The :class:`~fastper.distributed.Transport` over shard actors.

    Args:
        actors: handles of actors running :class:`ShardHost` (from
            :func:`ray_shards`), one per shard, in shard order. Actors running a
            plain ``ray.remote(Shard)`` work too, except for :meth:`restart`
            and actor-local routing.
        nodes: the Ray node of each actor (hex ids); asked from the actors
            (one parallel round trip) when omitted.
        timeout: seconds a :meth:`results` call waits for its replies, in all
            (one deadline for the call); a shard that has not answered by then
            is treated as lost (``None``: wait for ever). Also the default of
            :meth:`ask_nodes` and of the routers :meth:`router` makes.
        actor_options: Ray options for actors started by :meth:`restart`
            (e.g. ``{"num_cpus": 1}``).

    Costs: :meth:`submit` sends one message (no wait); :meth:`results` waits
    for all the calls given at once (they run in parallel on their actors);
    calls from one caller to one actor run in the order sent.
    """

    def __init__(
        self, actors: Sequence[Any], *, nodes: Sequence[str | None] | None = None,
        timeout: float | None = None, actor_options: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        if not actors:
            raise ValueError("`actors` must hold at least one shard actor")
        self._ray = require_ray()
        self._actors: list[Any] = list(actors)
        self.timeout = None if timeout is None else check_real("timeout", timeout, minimum=0.0)
        self._options = dict(actor_options or {})
        if nodes is None:
            nodes = self.ask_nodes()
        if len(nodes) != len(self._actors):
            raise ValueError(
                f"`nodes` must name one node per actor ({len(self._actors)}), got {len(nodes)}"
            )
        self._nodes: list[str | None] = list(nodes)

    def ask_nodes(self, *, timeout: float | None = _OWN) -> list[str | None]:
        """Each actor's node, asked in parallel (``None`` for actors without ``node_id``).

        ``timeout``: seconds to wait for every answer (default :attr:`timeout`;
        ``None``: for ever); then :class:`ShardLostError` names a shard that did
        not answer. One parallel round trip; :meth:`refresh_nodes` also keeps
        the answer.
        """
        calls: dict[int, _Call] = {}
        for s, a in enumerate(self._actors):
            try:
                calls[s] = _Call(s, a.node_id.remote())
            except AttributeError:  # a plain Shard actor: node unknown
                pass
        got = dict(zip(calls, self.results(list(calls.values()), timeout=timeout), strict=True))
        return [got.get(s) for s in range(len(self._actors))]

    def refresh_nodes(self, *, timeout: float | None = _OWN) -> list[str | None]:
        """Ask every actor for its node now and keep the answers (:attr:`nodes`). One round trip.

        ``timeout`` as for :meth:`ask_nodes`; the nodes kept change only if every actor answered.
        """
        self._nodes = self.ask_nodes(timeout=timeout)
        return list(self._nodes)

    @property
    def n_shards(self) -> int:
        """Number of shards, lost ones included."""
        return len(self._actors)

    @property
    def actors(self) -> list[Any]:
        """The shard actors' handles, in shard order (a restarted shard's new one)."""
        return list(self._actors)

    @property
    def nodes(self) -> list[str | None]:
        """The Ray node of each shard (hex; ``None`` where unknown)."""
        return list(self._nodes)

    def submit(self, shard: int, method: str, *args: Any, **kwargs: Any) -> _Call:
        """Send ``shard.method(*args, **kwargs)`` to its actor; returns at once."""
        return _Call(shard, getattr(self._actors[shard], method).remote(*args, **kwargs))

    def results(self, pending: Sequence[Any], *, timeout: float | None = _OWN) -> list[Any]:
        """Wait for the calls; their results in order, or the first error known.

        Args:
            pending: calls from :meth:`submit`.
            timeout: seconds this whole call may wait (default :attr:`timeout`;
                ``None``: for ever).

        Raises:
            ShardLostError: a gone actor (or node), or a shard that has not
                answered within ``timeout`` (treated as lost; the message names
                every shard still silent).
            Exception: an error raised by a shard's method, as itself, as soon
                as it is known: the first in call order among the calls that
                have answered; calls still running are not waited for (they
                go on in their actors).

        Waits for replies as they come (one wait per batch of replies that
        arrive together; all at once when they arrive together).
        """
        if not pending:
            return []
        limit = self._limit(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        try:
            return _gather(self._ray, pending, deadline)
        except _Late as late:
            silent = sorted(set(late.shards))
            others = "" if len(silent) == 1 else f"; shards {silent} did not answer"
            first = late.shards[0]
            raise ShardLostError(
                first,
                f"no reply within timeout={limit:g} s (treated as lost{others}); a stuck, "
                "overloaded or slow shard: allow a longer timeout, or kill it "
                f"(transport.kill({first})) and restart it from a checkpoint",
            ) from None

    def _limit(self, timeout: Any) -> float | None:
        """``timeout`` checked, or the transport's own for :data:`_OWN`."""
        if timeout is _OWN:
            return self.timeout
        return None if timeout is None else check_real("timeout", timeout, minimum=0.0)

    def restart(
        self, shard: int, checkpoint: str, *, start_timeout: float | None = START_TIMEOUT
    ) -> None:
        """Replace ``shard`` by a new actor loaded from ``checkpoint``; waits until it is up.

        The old actor is killed (it may be alive but unresponsive). The new
        one goes to the old one's node if that node is still there (a soft
        affinity), else anywhere; the file must be readable there. One round
        trip once the new process is up (load, then its node).

        Args:
            shard: the shard to replace.
            checkpoint: its fastper file, readable where the new actor runs.
            start_timeout: seconds for the new actor to be scheduled, load the
                file and say where it runs (default :data:`START_TIMEOUT`;
                ``None``: for ever). The transport's reply :attr:`timeout` is
                not used: starting a process takes longer than a reply.

        Raises:
            ShardLostError: the new actor died while starting, or was not up
                within ``start_timeout`` (it is killed; the message names the
                resources it asks for and those the cluster has).
            CheckpointError (or what loading raises): a bad checkpoint file.
        """
        wait = (
            None if start_timeout is None
            else check_real("start_timeout", start_timeout, minimum=0.0, strict_min=True)
        )  # fmt: skip
        self.kill(shard)
        node = self._nodes[shard]
        opts = dict(self._options)
        if node is not None and "scheduling_strategy" not in opts:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        actor = _shard_actor_class().options(**opts).remote()
        self._actors[shard] = actor
        loaded = _Call(shard, actor.reload.remote(str(checkpoint)))
        where = _Call(shard, actor.node_id.remote())  # runs after the load, on the same actor
        try:
            self._nodes[shard] = _await_start(self, [loaded, where], opts, wait)[1]
        except TimeoutError as exc:
            self.kill(shard)  # not up in time: it must not come up later, unseen
            raise ShardLostError(shard, f"its new actor was not up in time: {exc}") from None

    def kill(self, shard: int) -> None:
        """Kill ``shard``'s actor now (drills, tests, or a stuck shard); its data is gone."""
        try:
            self._ray.kill(self._actors[shard], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass

    def close(self) -> None:
        """Kill every shard actor (their data is gone; save first)."""
        for s in range(self.n_shards):
            self.kill(s)

    def router(self, **kwargs: Any) -> ShardRouter:
        """A :class:`~fastper.distributed.ray_router.ShardRouter` over these shards.

        Keyword arguments go to the router; its ``timeout`` (for the shards'
        replies) is this transport's :attr:`timeout` unless given. One round
        trip (the field spec, asked of every shard at once; the first answer
        is used), within :attr:`timeout`.

        Raises:
            ShardLostError: no shard answered (every one gone, or silent past
                :attr:`timeout`).
        """
        kwargs.setdefault("timeout", self.timeout)
        ray = self._ray
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        asked = {c.ref.hex(): c for c in (self.submit(s, "describe") for s in range(self.n_shards))}
        lost: ShardLostError | None = None
        while asked:
            ready, _ = ray.wait([c.ref for c in asked.values()], num_returns=1,
                                timeout=_left(deadline))  # fmt: skip
            if not ready:
                silent = sorted(c.shard for c in asked.values())
                raise ShardLostError(
                    silent[0],
                    f"no shard answered within timeout={self.timeout:g} s (shards {silent} "
                    "silent, the others gone): no router can be made; check the shards, or "
                    "allow the transport a longer timeout",
                ) from lost
            try:
                info = self.results([asked.pop(ready[0].hex())], timeout=_left(deadline))[0]
                break
            except ShardLostError as exc:  # gone: ask the others
                lost = exc
        else:
            assert lost is not None  # noqa: S101 - the loop ran at least once
            raise lost
        return ShardRouter(self.actors, self.nodes, fields=info["fields"], **kwargs)


class _Late(Exception):  # noqa: N818 - internal: never leaves this module
    """Calls not answered by their deadline: the shards, in call order."""

    def __init__(self, shards: list[int]) -> None:
        super().__init__(shards)
        self.shards = shards


def _gather(ray: Any, pending: Sequence[_Call], deadline: float | None) -> list[Any]:
    """The calls' results in order, or the first error known; :class:`_Late` past ``deadline``.

    Waits for any reply, takes in every reply there by then (one ``ray.get``),
    and raises the first error among them in call order; again until all are in.
    """
    out: list[Any] = [None] * len(pending)
    waiting = list(range(len(pending)))
    while waiting:
        refs = [pending[i].ref for i in waiting]
        ready, _ = ray.wait(refs, num_returns=1, timeout=_left(deadline))
        if not ready:
            raise _Late([pending[i].shard for i in waiting])
        if len(refs) > 1:  # every other reply in by now too
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = {r.hex() for r in ready}
        now = [i for i in waiting if pending[i].ref.hex() in done]
        waiting = [i for i in waiting if pending[i].ref.hex() not in done]
        try:
            got = ray.get([pending[i].ref for i in now], timeout=_left(deadline))
        except ray.exceptions.RayError:  # sorted out per call: the first error in call order
            got = [_one(ray, pending[i], deadline) for i in now]
        for i, value in zip(now, got, strict=True):
            out[i] = value
    return out


def _one(ray: Any, p: _Call, deadline: float | None) -> Any:
    """One call's result; a gone shard as :class:`ShardLostError`, a method's error as itself."""
    try:
        return ray.get(p.ref, timeout=_left(deadline))
    except ray.exceptions.GetTimeoutError:
        raise _Late([p.shard]) from None
    except lost_types(ray) as exc:
        raise ShardLostError(p.shard, f"{type(exc).__name__}: {_first_line(exc)}") from exc
    except ray.exceptions.RayTaskError as exc:
        raise unwrap_ray_error(exc)  # noqa: B904 - its __cause__ is the remote error


def _left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` time; ``None``: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- starting shards -----------------------------------------------------------------
def _actor_options(
    placement: str, num_cpus: float, actor_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    if placement not in _PLACEMENTS:
        raise ValueError(f"`placement` must be one of {list(_PLACEMENTS)}, got {placement!r}")
    ncpu = check_real("num_cpus", num_cpus, minimum=0.0)
    ray = require_ray()
    opts: dict[str, Any] = {"num_cpus": ncpu, "max_restarts": 0}
    if placement == "spread":
        opts["scheduling_strategy"] = "SPREAD"
    else:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
    opts.update(actor_options or {})
    return opts


def _start(n: int, opts: Mapping[str, Any]) -> list[Any]:
    require_ray()
    cls = _shard_actor_class()
    return [cls.options(**opts).remote() for _ in range(n)]


def _asked(opts: Mapping[str, Any]) -> dict[str, float]:
    """The resources one actor started with ``opts`` asks Ray for."""
    asked = {"CPU": float(opts.get("num_cpus", 1.0) or 0.0)}
    if opts.get("num_gpus"):
        asked["GPU"] = float(opts["num_gpus"])
    if opts.get("memory"):
        asked["memory"] = float(opts["memory"])
    for name, amount in dict(opts.get("resources") or {}).items():
        asked[str(name)] = float(amount)
    return asked


def _short(resources: Mapping[str, Any], names: Sequence[str]) -> str:
    return ", ".join(f"{k}={float(resources.get(k, 0.0)):g}" for k in names)


def _await_start(
    t: RayTransport, calls: Sequence[_Call], opts: Mapping[str, Any], timeout: float | None
) -> list[Any]:
    """The replies of the first calls to new shard actors, waiting at most ``timeout``
    seconds in all for them to be scheduled and answer; else a TimeoutError naming the
    shards not up and the resources asked against those the cluster has (the actors are
    left to the caller to kill). An error a call raised is raised as soon as it is known."""
    ray = require_ray()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        return _gather(ray, calls, deadline)
    except _Late as late:
        shards = sorted(set(late.shards))
        asked = _asked(opts)
        names = list(asked)
        try:
            total, free = ray.cluster_resources(), ray.available_resources()
            have = f"the cluster has {_short(total, names)} in all, {_short(free, names)} free now"
        except Exception as exc:  # noqa: BLE001 - the message is what matters here
            have = f"the cluster's resources could not be read ({_first_line(exc)})"
        n = len({c.shard for c in calls})
        raise TimeoutError(
            f"{len(shards)} of {n} shard actors (shards {shards}) were not up "
            f"within start_timeout={timeout:g} s: each asks for {_short(asked, names)} "
            f"({n} ask for {_short({k: v * n for k, v in asked.items()}, names)}); {have}. "
            "Ask for less per shard (num_cpus=, e.g. 0.25 or 0), start fewer shards, "
            "or give the cluster more resources; a slow machine may need a longer "
            "start_timeout"
        ) from None


def ray_shards(
    n_shards: int,
    capacity: int | Sequence[int],
    fields: Mapping[str, Any],
    *,
    uniform: bool = False,
    buffer_kwargs: Mapping[str, Any] | None = None,
    placement: str = "spread",
    num_cpus: float = SHARD_CPUS,
    timeout: float | None = None,
    start_timeout: float | None = START_TIMEOUT,
    actor_options: Mapping[str, Any] | None = None,
    channel: str = "socket",
) -> Any:
    """Start ``n_shards`` shard actors, each building its own empty buffer; their transport.

    Args:
        n_shards: K >= 1.
        capacity: slots per shard, one number for all or one per shard.
        fields: the field spec (as for the buffers).
        uniform: ``ReplayBuffer`` shards instead of ``PrioritizedReplayBuffer``.
        buffer_kwargs: for every shard's buffer (alpha, eps, clip, n_step, ...);
            shard ``s`` gets ``seed=s`` unless a seed is given (shards draw no
            random numbers when sampled through a coordinator).
        placement: ``"spread"`` (Ray's SPREAD strategy: over the cluster's
            nodes) or ``"local"`` (all on this node).
        num_cpus: CPUs Ray reserves for each shard actor (default
            :data:`SHARD_CPUS` = 0.25, so 8 shards fit 2 CPUs; Ray does not
            cap an actor at its reservation). Give a busy shard serving a
            large learner 1 on a cluster with CPUs to spare.
        timeout: reply timeout of the transport (see :class:`RayTransport`).
        start_timeout: seconds to wait for the actors to be scheduled and to
            build their buffers (default :data:`START_TIMEOUT`; ``None``: for
            ever). A cluster without the resources asked never schedules
            them: the start then fails with a TimeoutError naming them.
        actor_options: more Ray actor options (override the ones above).
        channel: how the learner's per-step calls reach the shards:
            ``"socket"`` (default: a direct TCP connection to each shard,
            fastper's own pickle-free format, tens of microseconds a call;
            the shard binds its node's IP and checks a random token) or
            ``"ray"`` (Ray actor calls, about a millisecond each). Inserts,
            saves, restarts and everything else always go through Ray.

    Raises:
        ImportError: Ray is not installed.
        ValueError / TypeError: bad arguments, or settings a buffer refuses
            (raised by the shard, as itself); the actors started are killed.
        TimeoutError: the actors were not up within ``start_timeout`` (the
            message names the shards, the resources each asks for and those
            the cluster has); the actors started are killed.

    Starts K processes and waits for them: one parallel round trip after the
    actors are up (seconds: each is a new Python process importing fastper).
    """
    _check_channel(channel)
    n = check_int("n_shards", n_shards, minimum=1)
    if isinstance(capacity, Sequence):
        caps = [check_int("capacity", c, minimum=1) for c in capacity]
        if len(caps) != n:
            raise ValueError(
                f"`capacity` must be one number or one per shard ({n}), got {len(caps)} numbers"
            )
    else:
        caps = [check_int("capacity", capacity, minimum=1)] * n
    if not isinstance(fields, Mapping):
        raise TypeError(f"`fields` must be a mapping of field specs, got fields={show(fields)}")
    wait = (
        None if start_timeout is None else check_real("start_timeout", start_timeout, minimum=0.0, strict_min=True)
    )
    opts = _actor_options(placement, num_cpus, actor_options)
    actors = _start(n, opts)
    t = RayTransport(actors, nodes=[None] * n, actor_options=opts)
    bk = dict(buffer_kwargs or {})
    try:
        _await_start(
            t,
            [t.submit(s, "build", caps[s], dict(fields), bool(uniform), {"seed": s, **bk})
             for s in range(n)],
            opts,
            wait,
        )  # fmt: skip
        t.refresh_nodes(timeout=wait)  # the actors are up: now they can say where they run
    except BaseException:
        t.close()
        raise
    t.timeout = None if timeout is None else check_real("timeout", timeout, minimum=0.0)
    return _with_channel(t, channel)


def _check_channel(channel: str) -> None:
    if channel not in _CHANNELS:
        raise ValueError(f"`channel` must be one of {list(_CHANNELS)}, got channel={channel!r}")


def _with_channel(t: RayTransport, channel: str) -> Any:
    """``t`` itself (``channel="ray"``) or ``t`` with socket channels (``"socket"``)."""
    if channel == "ray":
        return t
    try:
        return socket_channels(t)
    except BaseException:
        t.close()
        raise


def sharded_on_ray(
    n_shards: int,
    capacity: int | Sequence[int],
    fields: Mapping[str, Any],
    *,
    uniform: bool = False,
    buffer_kwargs: Mapping[str, Any] | None = None,
    placement: str = "spread",
    num_cpus: float = SHARD_CPUS,
    timeout: float | None = None,
    start_timeout: float | None = START_TIMEOUT,
    actor_options: Mapping[str, Any] | None = None,
    channel: str = "socket",
    **kwargs: Any,
) -> ShardedReplayBuffer:
    """A :class:`~fastper.distributed.ShardedReplayBuffer` over new Ray shard actors.

    The shard arguments are :func:`ray_shards`'s; ``kwargs`` (beta,
    weight_norm, on_shard_loss, seed, ...) go to the sharded buffer. To
    hand routers to actors, or kill a shard in a drill, keep the transport:
    ``t = ray_shards(...); buf = ShardedReplayBuffer(t, ...); router = t.router()``.
    """
    t = ray_shards(
        n_shards, capacity, fields, uniform=uniform, buffer_kwargs=buffer_kwargs,
        placement=placement, num_cpus=num_cpus, timeout=timeout, start_timeout=start_timeout,
        actor_options=actor_options, channel=channel,
    )  # fmt: skip
    try:
        return ShardedReplayBuffer(t, **kwargs)
    except BaseException:
        t.close()
        raise


def load_on_ray(
    directory: str | Path,
    *,
    placement: str = "spread",
    num_cpus: float = SHARD_CPUS,
    timeout: float | None = None,
    start_timeout: float | None = START_TIMEOUT,
    actor_options: Mapping[str, Any] | None = None,
    channel: str = "socket",
    **kwargs: Any,
) -> ShardedReplayBuffer:
    """A sharded buffer on new Ray shard actors from a set saved by ``ShardedReplayBuffer.save``.

    Each actor reads its own ``shard-<s>.fpk`` (fastper's pickle-free format:
    the directory must be readable where the actors run); the coordinator's
    generator and step come from the manifest, so sampling continues with
    the draws the saved buffer would have made. ``kwargs`` go to
    :class:`~fastper.distributed.ShardedReplayBuffer` (beta, weight_norm,
    on_shard_loss, ...; its seed is replaced by the saved generator). The
    shard arguments (``placement``, ``num_cpus``, ``timeout``,
    ``start_timeout``, ``actor_options``) are :func:`ray_shards`'s.

    Raises:
        CheckpointError: no manifest, missing files, or a set saved with shards
            already lost.
        TimeoutError: the actors were not up within ``start_timeout`` (see
            :func:`ray_shards`).
    """
    _check_channel(channel)
    d = Path(directory).absolute()
    m = ShardedReplayBuffer.read_manifest(d)
    n = len(m["capacities"])
    missing = sorted(set(map(str, range(n))) - set(m["shards"]))
    if missing:
        raise CheckpointError(
            f"the set in {str(d)!r} lacks shards {missing} (lost before it was saved)"
        )
    wait = (
        None if start_timeout is None else check_real("start_timeout", start_timeout, minimum=0.0, strict_min=True)
    )
    opts = _actor_options(placement, num_cpus, actor_options)
    t = RayTransport(_start(n, opts), nodes=[None] * n, actor_options=opts)
    try:
        _await_start(
            t, [t.submit(s, "reload", str(d / m["shards"][str(s)]["file"])) for s in range(n)],
            opts, wait,
        )  # fmt: skip
        t.refresh_nodes(timeout=wait)
        t.timeout = None if timeout is None else check_real("timeout", timeout, minimum=0.0)
        out = ShardedReplayBuffer(_with_channel(t, channel), **kwargs)
        out.restore_state(d)
    except BaseException:
        t.close()
        raise
    return out


def socket_channels(t: RayTransport, *, connect_timeout: float = 30.0) -> Any:
    """``t`` with the learner's hot calls on direct socket channels (see :mod:`.wire`).

    Each shard actor listens on its node's IP (:meth:`ShardHost.open_channel`),
    or on a Linux abstract Unix socket when it runs on the learner's node,
    for a connection presenting a fresh random token; ``step`` calls then go
    over that connection and everything else through ``t``. One round trip
    per shard to open them. Returns a :class:`~fastper.distributed.wire.ChannelTransport`.
    """
    import secrets

    from .wire import TOKEN_BYTES, Channel, ChannelTransport

    here = str(require_ray().get_runtime_context().get_node_id())

    def connect(s: int) -> Channel:
        token = secrets.token_bytes(TOKEN_BYTES)
        local = t.nodes[s] == here  # the same host: a Unix socket, not TCP loopback
        address = t.results([t.submit(s, "open_channel", token, local)])[0]
        if not isinstance(address, str):
            address = (str(address[0]), int(address[1]))
        try:
            return Channel(s, address, token, timeout=connect_timeout)
        except OSError as exc:
            raise ShardLostError(
                s, f"its socket channel at {address!r} could not be opened ({exc}); "
                "where a firewall admits only Ray's ports, use channel='ray'",
            ) from exc  # fmt: skip

    return ChannelTransport(t, connect)
