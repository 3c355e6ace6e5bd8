"""The learner's side of sharded replay: one buffer's API over K shards.

:class:`ShardedReplayBuffer` is an index over remote shards: it keeps each
shard's *view* (total mass, smallest mass, size, transitions added; every
reply of a shard carries it) and nothing else. It samples the union of its
shards exactly as one buffer holding all their priorities would (see
:mod:`.plan`), with IS weights over the global N and the global smallest
mass; routes priority updates to the owning shard with the keys that drop
stale ones; places inserts by rendezvous hashing of a key or round robin;
checkpoints all shards under one manifest; and applies a policy when a shard
is lost.

Shards change behind the coordinator's back (actors insert straight into
them), so every sample asks every live shard, in its one parallel round
trip: the shards that got points search them (``Shard.step``), the others
report their view (the same call without points, O(1)). Each reply's view replaces the old one,
so N, the smallest mass and the shares of the next sample are never older
than the last sample. A shard whose view held no mass gets no point of the
draw; if its reply shows mass now (or a shard seen with mass holds none),
the draw is discarded and made again over the fresh views: one more round
trip, only when a shard seen empty has filled or one has emptied. Whether to
draw again depends on the replies' views, never on where the points fell, so
the probabilities returned are always those of the draw actually used; N is
the sum of the sizes the shards replied with.

Global indices: shard ``s``'s slot ``i`` is ``offset[s] + i`` with
``offset`` the running sum of the shards' capacities, so a
:class:`~fastper.SampleBatch` from here goes back to ``update_priorities``
like one from a local buffer. ``keys`` are the shard's insertion counters,
plus ``generation << 40`` once a shard has been restored from a checkpoint:
a restored shard counts its inserts again from the checkpoint's count, so
without the generation an update sampled before the loss could name a
transition added after the restore. Updates from an older generation are
dropped (counted in :attr:`stale_updates`), even for transitions the
checkpoint kept.

Round trips (strict mode, the default): a sample is one parallel call to
every live shard (two when a shard seen empty has filled since, or one has
emptied); an update one call per owning shard, not awaited; an insert one
call to one shard. Pipelined mode (``depth`` > 1 or ``batches_per_call`` >
1) keeps calls in flight and makes one call per live shard per
``batches_per_call`` learner steps, updates included: each call applies the
updates queued since the last one, then draws the next batches (see
:class:`ShardedReplayBuffer`). The shard's ``step`` reply is one array per
field (indices, keys, masses, each field's rows, the view), joined and
reordered here with one take per field per batch.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import threading
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from .. import schedules as _sched
from .._kernels.routing import ROUTED, route_keyed
from .._validation import (
    as_1d,
    as_index_array,
    as_value_array,
    check_int,
    check_real,
    show,
    unwrap_batch,
)
from ..batch import SampleBatch, check_batch_size
from ..checkpoint import make_parent
from ..errors import CheckpointError, EmptyBufferError, InvalidIndexError, ZeroPriorityError
from ..policy import NORMS, batch_order, is_weights, probabilities
from .plan import ShardView, Split, draw_masses, group_by_shard, rendezvous, split_points
from .shard import DRAW_EMPTY, DRAW_OK, DRAW_ZERO
from .transport import LocalTransport, ShardLostError, ShardLostWarning, Transport

__all__ = ["MANIFEST", "ShardLostWarning", "ShardedReplayBuffer"]

MANIFEST = "manifest.json"
_MANIFEST_FORMAT = 1
_POLICIES = ("raise", "continue", "restore")
#: keys carry the shard's restore generation above this bit (2^40 inserts per shard)
GENERATION_SHIFT = 40
_KEY_MASK = (1 << GENERATION_SHIFT) - 1
_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run ``method`` under the buffer's lock (one caller at a time)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(_F, run)


@dataclass
class _Request:
    """One call per live shard, drawing ``len(splits)`` batches of ``b``; not yet answered."""

    b: int
    live: list[int]
    splits: list[Split]  # one split of all its batches' draws, end to end
    perms: list[np.ndarray | None]
    states: list[Any]  # the generator's state before each batch's draws
    shard: np.ndarray  # each draw's shard, all batches end to end
    order: np.ndarray  # the draws sorted by shard (stable)
    counts: np.ndarray  # draws per shard
    calls: list[Any]
    seqs: list[int]
    issued_at: int  # batches handed out when it was sent
    covered: int  # batches whose updates the views it was split by had seen
    carried: dict[int, int] | None  # update entries it carried per shard (None: carries none)


@dataclass
class _Ready:
    """A batch whose rows have arrived, waiting to be handed out (weights made then)."""

    b: int
    masses: np.ndarray  # each draw's mass in the split's units (all in handed-out order)
    probabilities: np.ndarray
    min_mass: float  # the smallest mass over the shards drawn from, in the split's units
    view_sum: float
    indices: np.ndarray
    keys: np.ndarray
    data: dict[str, np.ndarray]
    size: int
    covered: int
    state: Any


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    if len(parts) == 1:
        return np.asarray(parts[0], dtype=dtype)
    return np.concatenate(parts).astype(dtype, copy=False) if dtype else np.concatenate(parts)


class ShardedReplayBuffer:
    """Prioritized (or uniform) replay over K shards, sampled exactly as one buffer.

    Args:
        transport: how to reach the shards (:class:`LocalTransport`, or the Ray
            transport of :func:`fastper.distributed.ray_shards`).
        beta: IS exponent, a number or a schedule of :attr:`step`.
        stratified, shuffle: as for the local buffers (B equal slices of the
            global mass; the batch handed back in random order).
        weight_norm: ``"buffer"`` (largest weight over all shards = 1; needs
            shards that keep their smallest mass: prioritized buffers made
            with ``weight_norm="buffer"``, or uniform ones), ``"batch"`` or
            ``"none"``.
        on_shard_loss: ``"raise"`` (:class:`ShardLostError`, nothing changed),
            ``"continue"`` (go on exactly over the survivors; a
            :class:`ShardLostWarning` and :attr:`lost_shards` say so) or
            ``"restore"`` (reload the shard from its last checkpoint under
            :meth:`save`, then go on; raise if it has none).
        seed: seed of the coordinator's generator (all the draws).
        depth: calls per shard kept in flight. 1 (with ``batches_per_call=1``)
            is strict mode: each ``sample`` is one parallel call per live
            shard over views that already show the learner's updates, and the
            law is exact. Above 1, pipelined mode: the next batches are drawn
            while the learner trains on this one, and each call also carries
            the priority updates made since the last call (one call per shard
            per ``batches_per_call`` learner steps, updates included). The
            priorities a draw sees are then up to :attr:`max_staleness`
            learner steps old; every batch reports its own figure
            (:attr:`SampleBatch.staleness`), and the probabilities and
            weights are always those of the draw actually made.
        batches_per_call: batches each call draws (M). More batches per call
            means fewer calls per learner step (K calls per M steps) and more
            staleness.

    Thread safety: every public method takes one lock, so a prefetch thread
    may call ``sample`` while the learner's thread calls ``update_priorities``.

    Raises:
        ValueError: bad settings, shards of different fields or schemes, or
            ``weight_norm="buffer"`` over shards that keep no smallest mass.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        beta: _sched.ScheduleLike = 0.4,
        stratified: bool = True,
        shuffle: bool = True,
        weight_norm: str = "buffer",
        on_shard_loss: str = "raise",
        seed: int | None = None,
        depth: int = 1,
        batches_per_call: int = 1,
    ) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"`transport` must be a Transport, got transport={show(transport)}")
        if weight_norm not in NORMS:
            raise ValueError(f"`weight_norm` must be one of {list(NORMS)}, got {weight_norm!r}")
        if on_shard_loss not in _POLICIES:
            raise ValueError(
                f"`on_shard_loss` must be one of {list(_POLICIES)}, got {on_shard_loss!r}"
            )
        self._beta = _sched.as_schedule("beta", beta)
        check_real("beta", self._beta(0), minimum=0.0)
        self._t = transport
        self._stratified = bool(stratified)
        self._shuffle = bool(shuffle)
        self._norm = weight_norm
        self._policy = on_shard_loss
        self._seed = seed
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._step = 0
        self._rr = 0
        self._lost: list[int] = []
        self._checkpoints: dict[int, str] = {}
        self._depth = check_int("depth", depth, minimum=1)
        self._per_call = check_int("batches_per_call", batches_per_call, minimum=1)
        self._lock = threading.RLock()
        # updates sent on their own: (shard, call, seq, batches handed out then, entries)
        self._pending: list[tuple[int, Any, int, int, int]] = []
        # updates not sent yet: (owner shard, slot, |td|, local key or None), in the order made
        self._queue: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []
        self._ready: deque[_Ready] = deque()
        self._inflight: deque[_Request] = deque()
        self._applied_upto = 0
        self._stale_generation = 0
        self._dropped_updates = 0
        k = transport.n_shards
        self._seq = np.zeros(k, dtype=np.int64)  # calls sent to each shard
        self._view_seq = np.zeros(k, dtype=np.int64)  # the call whose reply gave its view
        info = transport.results([transport.submit(s, "describe") for s in range(k)])
        fields = {json.dumps(i["fields"], sort_keys=True) for i in info}
        schemes = {i["scheme"] for i in info}
        if len(fields) > 1 or len(schemes) > 1:
            raise ValueError(
                "all shards must hold the same fields and scheme, got "
                f"schemes {sorted(schemes)} and {len(fields)} different field specs"
            )
        self.scheme: str = info[0]["scheme"]
        self._fields: dict[str, Any] = dict(info[0]["fields"])
        self._capacities = np.array([i["capacity"] for i in info], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._capacities)]).astype(np.int64)
        self._views: list[ShardView] = [i["view"] for i in info]
        self._generation = np.zeros(k, dtype=np.int64)
        self._restored = False  # a shard restored since: keys carry generations (slow path)
        self._check_minima(range(k))

    # -- introspection ---------------------------------------------------------
    @classmethod
    def local(
        cls, n_shards: int, capacity: int, fields: Mapping[str, Any], *,
        uniform: bool = False, buffer_kwargs: Mapping[str, Any] | None = None, **kwargs: Any,
    ) -> ShardedReplayBuffer:  # fmt: skip
        """K shards as buffers in this process (``capacity`` each); for tests and one machine.

        ``buffer_kwargs`` go to each shard's buffer (alpha, eps, clip, ...;
        shard ``s`` gets seed ``s``); the rest to this class.
        """
        from ..buffers import PrioritizedReplayBuffer, ReplayBuffer
        from .shard import Shard

        n = check_int("n_shards", n_shards, minimum=1)
        cls_ = ReplayBuffer if uniform else PrioritizedReplayBuffer
        bk = dict(buffer_kwargs or {})
        shards = [Shard(cls_(capacity, fields, **{"seed": s, **bk})) for s in range(n)]
        return cls(LocalTransport(shards, loader=Shard.load), **kwargs)

    @property
    def n_shards(self) -> int:
        """Shards, lost ones included (they keep their numbers and index ranges)."""
        return int(self._capacities.shape[0])

    @property
    def lost_shards(self) -> list[int]:
        """Shards lost and gone on without (``on_shard_loss="continue"``)."""
        return list(self._lost)

    @property
    def transport(self) -> Transport:
        """How the shards are reached."""
        return self._t

    @property
    def stale_updates(self) -> int:
        """Update entries dropped here because their shard was restored since they were sampled.

        (Entries a shard drops itself, for slots overwritten since, are counted
        by the shard.)
        """
        return self._stale_generation

    @property
    def fields(self) -> dict[str, Any]:
        """The shards' field spec: ``{name: (shape, dtype string)}`` (as ``Shard.describe``)."""
        return dict(self._fields)

    @property
    def capacity(self) -> int:
        """Slots over all shards."""
        return int(self._offsets[-1])

    @property
    def step(self) -> int:
        """Successful ``sample`` calls (the beta schedule's step)."""
        return self._step

    @property
    def beta(self) -> float:
        """The beta the next ``sample`` uses."""
        return float(self._beta(self._step))

    def views(self) -> list[ShardView]:
        """What each shard said last (total, min mass, size, added)."""
        return [ShardView(v.total, v.min_mass, v.size, v.added) for v in self._views]

    def __len__(self) -> int:
        """Transitions over the live shards, as of their last replies (every sample's included)."""
        return int(sum(v.size for s, v in enumerate(self._views) if s not in self._lost))

    def refresh(self) -> None:
        """Ask every live shard for its view now (one parallel round trip).

        Sent with the queued priority updates (pipelined mode), after the calls
        in flight. A lost shard is handled by the ``on_shard_loss`` policy, as
        in every other call (``"raise"``: :class:`ShardLostError`).
        """
        with self._lock:
            self._refresh_by_policy()

    def _refresh_once(self) -> None:
        with self._lock:
            self._harvest()
            live = self._live()
            updates = self._take_queued()
            calls, seqs = [], []
            for s in live:
                sl, td, kk = updates.get(s, (None, None, None))
                calls.append(self._t.submit(s, "step", sl, td, kk))
                seqs.append(self._next_seq(s))
            try:
                replies = self._t.results(calls)
            except ShardLostError:  # the others' replies still count; the caller's policy runs
                for s, seq, call in zip(live, seqs, calls, strict=True):
                    try:
                        r = self._t.results([call])[0]
                    except ShardLostError:
                        self._dropped_updates += int(updates[s][0].shape[0]) if s in updates else 0
                        continue
                    self._take_view(s, seq, r["stats"], r["counts"])
                raise
            for s, seq, r in zip(live, seqs, replies, strict=True):
                self._take_view(s, seq, r["stats"], r["counts"])
            self._applied_upto = self._step

    def _check_minima(self, shards: Any) -> None:
        """Refuse ``weight_norm="buffer"`` over shards that keep no smallest mass (NaN)."""
        if self._norm != "buffer":
            return
        bad = [int(s) for s in shards if math.isnan(self._views[s].min_mass)]
        if bad:
            raise ValueError(
                "`weight_norm` must be 'batch' or 'none' over shards that do not keep their "
                f"smallest mass (shards {bad}: buffers made with weight_norm 'batch' or 'none'), "
                "got weight_norm='buffer'; make every shard's buffer with weight_norm='buffer' "
                "to normalise over the whole memory"
            )

    def _live(self) -> list[int]:
        return [s for s in range(self.n_shards) if s not in self._lost]

    # -- shard failures ----------------------------------------------------------
    def _call_all(self, calls: Sequence[tuple[int, str, tuple[Any, ...]]]) -> list[Any]:
        """Run calls in parallel; a lost shard raises :class:`ShardLostError`."""
        self._harvest()
        pending = [self._t.submit(s, m, *a) for s, m, a in calls]
        return self._t.results(pending)

    def _harvest(self) -> int:
        """Wait for the updates sent on their own and take their views; the entries applied.

        Their errors raise here; a lost shard's updates are dropped and
        counted (:attr:`dropped_updates`), the others' views still count.
        """
        if not self._pending:
            return 0
        done, self._pending = self._pending, []
        try:  # one wait for all of them (one ray.get on Ray)
            replies: list[Any] = self._t.results([p for _, p, _, _, _ in done])
        except ShardLostError:
            replies = []
            for _, p, _, _, n in done:  # find which were lost; the others' views still count
                try:
                    replies.append(self._t.results([p])[0])
                except ShardLostError:
                    replies.append(None)  # the shard's loss is handled when it is next called
                    self._dropped_updates += n
        applied = 0
        for (shard, _, seq, upto, _), reply in zip(done, replies, strict=True):
            if reply is None:
                continue
            self._take_view(shard, seq, reply["stats"], reply["counts"])
            self._applied_upto = max(self._applied_upto, upto)
            applied += int(reply["counts"][2])
        return applied

    def _take_queued(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """The queued updates per shard, in the order made (the last duplicate wins). O(U log U + K)."""
        if not self._queue:
            return {}
        parts, self._queue = self._queue, []
        if len(parts) == 1:
            owner, slots, td, keys = parts[0]
        else:
            owner = np.concatenate([p[0] for p in parts])
            slots = np.concatenate([p[1] for p in parts])
            td = np.concatenate([p[2] for p in parts])
            keys = None if parts[0][3] is None else np.concatenate([p[3] for p in parts])
        order, bounds = group_by_shard(owner, self.n_shards)  # call order kept within a shard
        out = {}
        for s in np.flatnonzero(np.diff(bounds)).tolist():
            sel = order[bounds[s] : bounds[s + 1]]
            out[s] = (slots[sel], td[sel], None if keys is None else keys[sel])
        return out

    def _send_updates(self, updates: Mapping[int, tuple[np.ndarray, np.ndarray, Any]]) -> None:
        """Send updates now, one call per shard (their replies are taken by the next call)."""
        for s, (sl, td, kk) in updates.items():
            self._pending.append((s, self._t.submit(s, "step", sl, td, kk), self._next_seq(s),
                                  self._step, int(sl.shape[0])))  # fmt: skip

    def _drop_queued(self, s: int) -> None:
        """Drop (and count) the queued updates addressed to shard ``s``."""
        keep = []
        for owner, slots, td, keys in self._queue:
            mine = owner == s
            n = int(np.count_nonzero(mine))
            if n == 0:
                keep.append((owner, slots, td, keys))
                continue
            self._dropped_updates += n
            if n < owner.shape[0]:
                o = ~mine
                keep.append((owner[o], slots[o], td[o], None if keys is None else keys[o]))
        self._queue = keep

    @property
    def dropped_updates(self) -> int:
        """Update entries dropped because their shard was lost (never applied to another)."""
        return self._dropped_updates

    def _on_loss(self, exc: ShardLostError) -> None:
        """Apply the policy to a lost shard; returns when the call may be retried."""
        s = exc.shard
        self._drop_queued(s)
        if self._policy == "raise":
            raise exc
        if self._policy == "restore":
            path = self._checkpoints.get(s)
            if path is None:
                raise ShardLostError(
                    s,
                    "no checkpoint to restore it from (call save() first, or use "
                    "on_shard_loss='continue')",
                ) from exc
            self._t.restart(s, path)
            self._views[s] = self._t.results([self._t.submit(s, "view")])[0]
            self._view_seq[s] = self._seq[s] = self._seq[s] + 1  # older replies name the old shard
            self._generation[s] += 1  # keys sampled before now name nothing
            self._restored = True
            warnings.warn(
                f"shard {s} was lost and restored from {path}: what it took in since that "
                "checkpoint is gone", ShardLostWarning, stacklevel=3,
            )  # fmt: skip
            return
        if s not in self._lost:
            self._lost.append(s)
            warnings.warn(
                f"shard {s} was lost; sampling goes on exactly over the {len(self._live())} "
                f"others (its {self._views[s].size} transitions are gone)",
                ShardLostWarning, stacklevel=3,
            )  # fmt: skip
        if not self._live():
            raise ShardLostError(s, "no shard is left") from exc

    # -- insert --------------------------------------------------------------------
    def shard_for(self, key: Any = None) -> int:
        """The live shard an insert goes to: rendezvous hashing of ``key``, or round robin."""
        live = self._live()
        if key is None:
            self._rr += 1
            return live[(self._rr - 1) % len(live)]
        return rendezvous(key, live)

    @_locked
    def add(
        self, transition: Mapping[str, Any], *, key: Any = None, shard: int | None = None,
        env_ids: Any = None, priorities: Any = None,
    ) -> np.ndarray:  # fmt: skip
        """Store transitions on one shard; returns their global indices.

        The shard is ``shard`` if given, else the one ``key`` hashes to (the
        same key always lands on the same live shard: an actor's id keeps its
        stream on one shard), else the next in round robin. ``priorities``:
        raw priorities computed by the caller (Ape-X actors), one per row.
        """
        while True:
            s = self.shard_for(key) if shard is None else check_int("shard", shard, minimum=0)
            if s >= self.n_shards or s in self._lost:
                raise ValueError(f"`shard` must name a live shard, got shard={s}")
            try:
                slots, view = self._call_all([(s, "add", (transition, env_ids, priorities))])[0]
            except ShardLostError as exc:
                self._on_loss(exc)
                if shard is not None and self._policy == "continue":
                    raise
                continue
            self._views[s] = view
            return np.asarray(slots, dtype=np.int64) + self._offsets[s]

    # -- sample --------------------------------------------------------------------
    def sample(self, batch_size: int, beta: float | None = None) -> SampleBatch:
        """Draw ``batch_size`` transitions over all live shards.

        Strict mode (``depth=1, batches_per_call=1``): one parallel round
        trip, one call per live shard. The shards' shares come from their
        last replies, which already reflect the learner's own updates (sent
        when made); every live shard is asked in the same round trip (the
        ones without points for their view), and a draw is made again over
        the fresh views when a shard seen empty holds mass now, or one seen
        with mass holds none (see the module docstring).

        Pipelined mode: the batch comes from a call made earlier (see the
        class docstring); waits only when none has arrived yet.

        The probabilities returned are those the draw used (see
        :mod:`.plan`). IS weights use the global N and the global smallest
        mass, as of the replies, with the beta of this call. A call that
        raises leaves the generator and the step as they were (in pipelined
        mode: as they were before the oldest batch not yet handed out).
        O(B log B + K) here per batch, plus the shards' O(B_s log N_s) searches.

        Raises:
            EmptyBufferError: no live shard holds anything.
            ZeroPriorityError: every mass is zero.
            ShardLostError: a shard is lost and the policy is ``"raise"``.
        """
        with self._lock:
            b = check_batch_size(batch_size)  # at most 2^24 draws: an absurd size fails here
            beta_v = check_real("beta", self._beta(self._step) if beta is None else beta, minimum=0.0)
            while True:
                # what to rewind to when nothing is drawn ahead (else: the oldest draw ahead)
                rewind = None if self._ready or self._inflight else self._rng.bit_generator.state
                try:
                    ready = self._next_ready(b)
                except ShardLostError as exc:
                    self._abandon(rewind)
                    self._on_loss(exc)
                    continue
                except BaseException:
                    self._abandon(rewind)
                    raise
                batch = self._hand_out(ready, beta_v)
                self._step += 1
                return batch

    @property
    def depth(self) -> int:
        """Calls per shard kept in flight (1: strict mode)."""
        return self._depth

    @property
    def batches_per_call(self) -> int:
        """Batches one call per shard draws."""
        return self._per_call

    @property
    def pipelined(self) -> bool:
        """Whether batches are drawn ahead (``depth > 1`` or ``batches_per_call > 1``)."""
        return self._depth > 1 or self._per_call > 1

    @property
    def max_staleness(self) -> int:
        """The most learner steps whose priority updates a batch's draw may miss.

        0 in strict mode; ``2 * depth * batches_per_call - 1`` in pipelined
        mode, assuming the learner updates each batch before its next sample
        (every batch reports its own figure in :attr:`SampleBatch.staleness`).
        A call carries the updates made before it was sent and the shard
        applies them before it searches, so the rows found within a shard
        miss at most ``depth * batches_per_call - 1`` steps; the shards'
        shares of the draw come from the views of the last replies, sent
        ``depth`` calls earlier, which miss ``depth * batches_per_call`` more.
        """
        return 0 if not self.pipelined else 2 * self._depth * self._per_call - 1

    def _next_ready(self, b: int) -> _Ready:
        """The next batch to hand out: from the ready queue, else the oldest call in flight."""
        if self._ready and self._ready[0].b != b:
            self._abandon()  # drawn for another batch size: draw again at this one
        if self._inflight and self._inflight[0].b != b:
            self._abandon()
        if not self.pipelined:
            self._harvest()  # the learner's own updates first: their replies carry the totals
            return self._draw_now(b)
        if not self._ready:
            self._harvest()
            self._top_up(b)  # `depth` calls in flight; the new one carries the updates made since
            self._collect(self._inflight[0])
        return self._ready.popleft()

    def _ensure_mass(self) -> None:
        """Views with mass to split by: refresh when ours show none; raise when there is none."""
        live = self._live()
        if not any(self._views[s].total > 0.0 for s in live):
            self._refresh_once()  # maybe only our view is empty: inserts went straight to the shards
        if not any(self._views[s].total > 0.0 for s in live):
            if sum(self._views[s].size for s in live) == 0:
                raise EmptyBufferError("cannot sample: no live shard holds a transition")
            raise ZeroPriorityError("cannot sample: every stored priority is zero")
        self._check_minima(live)

    def _draw_now(self, b: int) -> _Ready:
        """Strict mode: one call per live shard now, drawn over the current views."""
        tries = self.n_shards + 1  # a redraw needs a shard seen empty that filled since
        for attempt in range(tries):
            final = attempt == tries - 1
            self._ensure_mass()
            req = self._issue(b, 1, carry=False)
            before = {s: self._views[s].total for s in req.live}
            try:
                self._collect(req)
            except (EmptyBufferError, ZeroPriorityError):
                if final:
                    raise
                continue  # a shard lost its mass since its view: draw again over the rest
            # a shard the draw could not reach holds mass now, or one it could reach holds
            # none (it got no point, by luck): draw again over the fresh views. Whether to
            # draw again depends on the views only, never on where the points fell.
            filled = any(before[s] <= 0.0 < self._views[s].total for s in req.live)
            emptied = any(self._views[s].total <= 0.0 < before[s] for s in req.live)
            if (filled or emptied) and not final:
                self._ready.clear()
                continue
            if emptied:
                self._ready.clear()
                raise EmptyBufferError(
                    f"cannot sample: shards lost their mass while being sampled {tries} times "
                    "in a row; sample again"
                )
            return self._ready.popleft()
        raise AssertionError("unreachable")  # pragma: no cover - the last try returns or raises

    def _top_up(self, b: int) -> None:
        """Send calls until ``depth`` are in flight; the first carries the queued updates."""
        while len(self._inflight) < self._depth:
            self._ensure_mass()
            self._issue(b, self._per_call, carry=True)

    def _issue(self, b: int, m: int, *, carry: bool) -> _Request:
        """Draw ``m`` batches over the current views and send one call per live shard. O(mB log mB + K)."""
        k = self.n_shards
        live = self._live()
        totals = np.zeros(k, dtype=np.float64)
        totals[live] = [self._views[s].total for s in live]
        states, perms = [], []
        u = np.empty((m, b), dtype=np.float64)
        for j in range(m):  # per batch: its uniforms, then its order (one buffer's draws)
            states.append(self._rng.bit_generator.state if carry else None)  # strict: sample() keeps it
            self._rng.random(out=u[j])
            perms.append(batch_order(self._rng.random(b)) if self._shuffle and b > 1 else None)
        split = split_points(u if m > 1 else u[0], totals, self._stratified)  # all at once
        splits = [split]
        shard, local = split.shard, split.local
        order, bounds = group_by_shard(shard, k)  # shard-major; batch and draw order kept within
        counts = np.diff(bounds)
        updates = self._take_queued() if carry else {}
        calls, seqs = [], []
        for s in live:
            targets = local[order[bounds[s] : bounds[s + 1]]]
            sl, td, kk = updates.get(s, (None, None, None))
            calls.append(self._t.submit(s, "step", sl, td, kk, targets, float(totals[s])))
            seqs.append(self._next_seq(s))
        req = _Request(
            b=b, live=live, splits=splits, perms=perms, states=states, shard=shard, order=order,
            counts=counts, calls=calls, seqs=seqs, issued_at=self._step, covered=self._applied_upto,
            carried={s: int(u[0].shape[0]) for s, u in updates.items()} if carry else None,
        )  # fmt: skip
        self._inflight.append(req)
        return req

    def _collect(self, req: _Request) -> None:
        """Wait for a call's replies and turn them into ready batches. O(mB + K x fields)."""
        replies = self._t.results(req.calls)  # if this raises, the call stays to be abandoned
        self._inflight.remove(req)
        k, m, b = self.n_shards, len(req.perms), req.b
        cur_tot = np.zeros(k, dtype=np.float64)
        cur_min = np.full(k, np.inf)
        size = 0
        bad: list[int] = []
        for s, seq, r in zip(req.live, req.seqs, replies, strict=True):
            stats, counts = r["stats"], r["counts"]
            self._take_view(s, seq, stats, counts)
            cur_tot[s], cur_min[s] = stats[0], stats[1]
            size += int(counts[0])
            if req.counts[s] and int(counts[3]) != DRAW_OK:
                bad.append(s)
        if req.carried is not None:  # the updates it carried are applied: the views show them
            self._applied_upto = max(self._applied_upto, req.issued_at)
        if bad:
            kind = {int(replies[req.live.index(s)]["counts"][3]) for s in bad}
            if kind == {DRAW_EMPTY} and size == 0:
                raise EmptyBufferError("cannot sample: no live shard holds a transition")
            raise ZeroPriorityError(
                f"cannot sample: shards {bad} held no mass when their points reached them"
            ) if DRAW_ZERO in kind else EmptyBufferError(
                f"cannot sample: shards {bad} were empty when their points reached them"
            )
        with_rows = [r for s, r in zip(req.live, replies, strict=True) if req.counts[s]]
        shard_of_row = np.repeat(np.asarray(req.live, dtype=np.int64), req.counts[req.live])
        cat_idx = _cat([r["indices"] for r in with_rows], np.int64) + self._offsets[shard_of_row]
        cat_keys = _cat([r["keys"] for r in with_rows], np.int64) + (
            self._generation[shard_of_row] << GENERATION_SHIFT
        )
        cat_mass = _cat([r["masses"] for r in with_rows], np.float64)
        names = [n for n in (with_rows[0] if with_rows else {}) if n.startswith("data.")]
        cat_data = {n[5:]: _cat([r[n] for r in with_rows], None) for n in names}
        inv = np.empty(m * b, dtype=np.int64)
        inv[req.order] = np.arange(m * b, dtype=np.int64)  # draw -> row of the joined replies
        # every batch's masses in the split's units and probabilities at once (same views)
        view = req.splits[0]
        mins = cur_min if self._norm == "buffer" else np.ones(k)  # other norms need no minimum
        g, g_min = draw_masses(req.shard, cat_mass[inv], view.view_totals, cur_tot, mins)
        prob = probabilities(g, view.view_sum)
        for j in range(m):
            perm = req.perms[j]
            draws = np.arange(j * b, (j + 1) * b) if perm is None else j * b + perm
            take = inv[draws]
            self._ready.append(_Ready(
                b=b, masses=g[draws], probabilities=prob[draws], min_mass=g_min,
                view_sum=view.view_sum, indices=cat_idx[take], keys=cat_keys[take],
                data={n: v[take] for n, v in cat_data.items()}, size=size,
                covered=req.covered, state=req.states[j],
            ))  # fmt: skip

    def _hand_out(self, r: _Ready, beta: float) -> SampleBatch:
        """The batch, with IS weights for ``beta`` and its staleness. O(B)."""
        min_mass = r.min_mass if self._norm == "buffer" else 1.0
        weights = is_weights(r.masses, r.view_sum, min_mass, r.size, beta, self._norm)
        return SampleBatch(data=r.data, indices=r.indices, weights=weights,
                           probabilities=r.probabilities, keys=r.keys, beta=float(beta),
                           staleness=max(0, self._step - r.covered) if self.pipelined else 0)  # fmt: skip

    def _abandon(self, rewind: Any = None) -> None:
        """Drop the batches drawn ahead and the calls in flight; rewind the generator.

        The generator goes back to its state before the oldest batch not
        handed out, so the draws are made again as if never made. Replies of
        abandoned calls are awaited (within the transport's timeout) and only
        their views kept: the updates they carried were applied.
        """
        states = [r.state for r in self._ready] + [q.states[0] for q in self._inflight]
        states = [s for s in states if s is not None]
        if states or rewind is not None:
            self._rng.bit_generator.state = states[0] if states else rewind
        self._ready.clear()
        while self._inflight:
            req = self._inflight.popleft()
            for s, seq, call in zip(req.live, req.seqs, req.calls, strict=True):
                try:
                    r = self._t.results([call])[0]
                except ShardLostError:  # handled by the caller's policy; its updates are gone
                    self._dropped_updates += req.carried.get(s, 0) if req.carried else 0
                    continue
                except Exception:  # noqa: BLE001 - the caller raises its own error
                    continue
                self._take_view(s, seq, r["stats"], r["counts"])
                self._applied_upto = max(self._applied_upto, req.issued_at)

    def _next_seq(self, s: int) -> int:
        self._seq[s] += 1
        return int(self._seq[s])

    def _take_view(self, s: int, seq: int, stats: np.ndarray, counts: np.ndarray) -> None:
        """Take a reply's view unless a later call's reply was taken already."""
        if seq >= self._view_seq[s]:
            self._view_seq[s] = seq
            self._views[s] = ShardView(float(stats[0]), float(stats[1]), int(counts[0]),
                                       int(counts[1]))  # fmt: skip

    # -- priorities ----------------------------------------------------------------
    def _split_indices(self, idx: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._offsets, idx, side="right") - 1

    @_locked
    def get(self, indices: Any) -> dict[str, np.ndarray]:
        """The rows stored at global ``indices``, read without sampling. O(B) here, one
        parallel round trip to the shards that hold them.

        Returns the fields a :class:`SampleBatch` of this buffer holds, in the
        order of ``indices``, each with a leading dimension of ``len(indices)``.
        Draws nothing and changes nothing (updates in flight are collected
        first, as by every call).

        Raises:
            InvalidIndexError: an index outside ``[0, capacity)``, on a lost
                shard, or a slot its shard has not written or made invalid
                (the message names the global indices).
            ShardLostError: a shard was lost during the call (after the loss
                policy ran: call again).
        """
        idx = as_index_array("indices", indices, self.capacity)
        owner = self._split_indices(idx)
        lost = np.isin(owner, self._lost) if self._lost else np.zeros(idx.shape[0], dtype=bool)
        if lost.any():
            raise InvalidIndexError(
                f"`indices` must name slots of live shards, got indices={show(idx[lost][:8])} "
                f"on lost shards {sorted(set(owner[lost].tolist()))}"
            )
        slots = idx - self._offsets[owner]
        # no index: one live shard's empty rows give the fields' shapes and dtypes
        shards = np.unique(owner).tolist() if idx.shape[0] else self._live()[:1]
        picks = [np.flatnonzero(owner == s) for s in shards]
        try:
            parts = self._call_all(
                [(s, "get", (slots[p],)) for s, p in zip(shards, picks, strict=True)]
            )
        except InvalidIndexError as exc:  # the shard names its own slots: say how they map
            raise InvalidIndexError(
                f"`indices` must name written, valid slots of their shards; a shard refused "
                f"some of indices={show(idx[:8])}. In its words (slots counted from 0 within "
                f"the shard; global index = shard offset + slot, offsets "
                f"{self._offsets[:-1].tolist()}): {exc}"
            ) from None
        except ShardLostError as exc:
            self._on_loss(exc)
            raise
        out: dict[str, np.ndarray] = {}
        for name in parts[0] if parts else ():
            first = np.asarray(parts[0][name])
            column = np.empty((idx.shape[0], *first.shape[1:]), dtype=first.dtype)
            for p, part in zip(picks, parts, strict=True):
                column[p] = part[name]
            out[name] = column
        return out

    @_locked
    def update_priorities(
        self, indices: Any, td_errors: Any, keys: Any = None, *, wait: bool = False
    ) -> int:
        """Send ``|td|`` to the owning shards, with keys; returns the entries sent (or applied).

        The arguments are checked as :meth:`fastper.PrioritizedReplayBuffer.update_priorities`
        checks them (integer indices and keys, finite real td errors, one per
        index), and each index must name a slot its shard has filled (below
        its insert count) and each key one its shard issued, checked against
        the shards' views (if one looks unwritten, the views are asked again
        first, one round trip). A call that raises sends nothing and changes
        nothing.

        Not awaited by default: the replies (each shard's new view) are
        collected at the next call. With ``wait=True`` the call waits and
        returns how many were applied (stale ones dropped by the shards).
        Updates for a lost shard are dropped under ``"continue"``; those with
        keys from before their shard's last restore are dropped here (counted
        in :attr:`stale_updates`). ``update_priorities(batch, td_errors)``
        takes the batch's indices and keys. O(B log B + K) here.

        Raises:
            TypeError: indices or keys that are not integers, td errors that
                are not real numbers.
            ValueError: not 1-D, lengths that differ, non-finite td errors,
                keys this buffer never issued.
            InvalidIndexError: indices outside the global range or naming
                slots never written.
        """
        indices, keys = unwrap_batch(indices, keys)
        idx = as_1d("indices", indices, "iu")
        td = as_1d("td_errors", td_errors, "iuf")
        use_keys = keys is not None
        if use_keys and not self._lost and not self._restored:
            routed = self._route_fast(idx, td, as_1d("keys", keys, "iu"))
            if routed is not None:
                return self._commit_updates(routed, wait)
        k = as_1d("keys", keys, "iu") if use_keys else idx
        for name, arr in (("td_errors", td), ("keys", k)):
            if arr.shape[0] != idx.shape[0]:
                raise ValueError(
                    f"`{name}` must have {idx.shape[0]} entries (one entry per index), "
                    f"got {name} with {arr.shape[0]}"
                )
        idx = as_index_array("indices", idx, self.capacity)
        td = as_value_array("td_errors", td, idx.shape[0], nonnegative=False)
        owner = self._split_indices(idx)
        slots = idx - self._offsets[owner]
        live = ~np.isin(owner, self._lost) if self._lost else np.ones(idx.shape[0], dtype=bool)
        current = live
        local = None
        if use_keys:
            gen = k >> GENERATION_SHIFT
            ahead = (k < 0) | (gen > self._generation[owner])
            if ahead.any():
                raise ValueError(
                    "`keys` must be keys issued by this buffer (from its samples), got "
                    f"keys={show(k[ahead][:8])}"
                )
            current = live & (gen == self._generation[owner])
            local = k & _KEY_MASK
        unwritten, unissued = self._unknown(owner, slots, local, current)
        if unwritten.any() or unissued.any():
            self._refresh_by_policy()  # our views may lag inserts that went straight to a shard
            live = ~np.isin(owner, self._lost) if self._lost else live
            if use_keys:  # a shard restored by the refresh started a new generation
                current = live & ((k >> GENERATION_SHIFT) == self._generation[owner])
            else:
                current = current & live
            unwritten, unissued = self._unknown(owner, slots, local, current)
        if unwritten.any():
            bad = idx[unwritten][:8]
            raise InvalidIndexError(
                "`indices` must name written slots (a shard that took n transitions has filled "
                f"its first min(n, capacity) slots), got never-written indices={show(bad)}"
            )
        if unissued.any():
            raise ValueError(
                "`keys` must be keys issued by this buffer (from its samples), got "
                f"keys={show(np.asarray(k)[unissued][:8])}"
            )
        # checked: from here on the call commits
        if use_keys:
            self._stale_generation += int((live & ~current).sum())
        self._dropped_updates += int(idx.shape[0] - np.count_nonzero(live))
        if current.all():
            entry = (owner, slots, td, local)
        else:
            sel = np.flatnonzero(current)
            entry = (owner[sel], slots[sel], td[sel], None if local is None else local[sel])
        return self._commit_updates(entry, wait)

    def _route_fast(
        self, idx: np.ndarray, td: np.ndarray, keys: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The common case in one compiled pass (every shard live, none restored, so a key
        is its shard's own counter): ``(owner, slot, td, key)``, or ``None`` when anything
        needs the full path (which names the problem, or asks the shards first). O(B log K)."""
        n = idx.shape[0]
        if n == 0 or td.shape[0] != n or keys.shape[0] != n:
            return None
        added = np.fromiter((v.added for v in self._views), np.int64, self.n_shards)
        written = np.minimum(added, self._capacities)
        idx64 = idx.astype(np.int64, copy=False)
        keys64 = keys.astype(np.int64, copy=False)
        tdf = td.astype(np.float64, copy=False)
        owner = np.empty(n, dtype=np.int64)
        slots = np.empty(n, dtype=np.int64)
        status, _ = route_keyed(idx64, tdf, keys64, self._offsets, written, added, owner, slots)
        if status != ROUTED:
            return None
        return owner, slots, tdf, keys64

    def _commit_updates(
        self, entry: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None], wait: bool
    ) -> int:
        """Queue checked updates ``(owner, slot, |td|, local key)``, send them unless pipelined."""
        local = entry[3]
        n_sent = int(entry[0].shape[0])
        if self._queue and (wait or (self._queue[0][3] is None) != (local is None)):
            self._send_updates(self._take_queued())  # made earlier; keyed and unkeyed apart
        mine = len(self._pending)  # the entries from here on are this call's
        self._queue.append(entry)
        if self.pipelined and not wait:
            return n_sent  # carried by the next call to each shard
        self._send_updates(self._take_queued())
        if not wait:
            return n_sent
        done, self._pending = self._pending, []
        applied = 0
        for i, (s, call, seq, upto, n) in enumerate(done):
            try:
                r = self._t.results([call])[0]
            except ShardLostError as exc:
                self._dropped_updates += n
                self._pending = done[i + 1 :] + self._pending  # taken by the next call
                self._on_loss(exc)  # raises under "raise"
                self._pending, rest = [], self._pending
                done[i + 1 :] = rest
                continue
            self._take_view(s, seq, r["stats"], r["counts"])
            self._applied_upto = max(self._applied_upto, upto)
            applied += int(r["counts"][2]) if i >= mine else 0
        return applied

    def _unknown(
        self, owner: np.ndarray, slots: np.ndarray, local: np.ndarray | None, check: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Entries (among ``check``) naming slots or keys beyond their shard's view. O(B + K).

        A shard that has taken ``added`` transitions has written slots below
        ``min(added, capacity)`` only (its ring fills slot ``k % capacity``
        with the ``k``-th) and issued keys below ``added``.
        """
        added = np.array([v.added for v in self._views], dtype=np.int64)
        unwritten = check & (slots >= np.minimum(added, self._capacities)[owner])
        if local is None:
            return unwritten, np.zeros_like(unwritten)
        return unwritten, check & (local >= added[owner])

    def _refresh_by_policy(self) -> None:
        """:meth:`refresh`, applying the loss policy to a shard that is gone."""
        while True:
            try:
                self._refresh_once()
                return
            except ShardLostError as exc:
                self._on_loss(exc)

    @_locked
    def flush(self) -> None:
        """Send the queued updates and wait for every call in flight; take in their replies.

        Batches drawn ahead (pipelined mode) are kept and handed out by the
        next samples. After ``flush`` the shards hold every update made so far.
        """
        self._send_updates(self._take_queued())
        self._harvest()
        while self._inflight:
            self._collect(self._inflight[0])

    # -- checkpoints -----------------------------------------------------------------
    def _undrawn_state(self) -> Any:
        """The generator's state before the oldest batch drawn and not handed out."""
        if self._ready:
            return self._ready[0].state
        return self._inflight[0].states[0] if self._inflight else self._rng.bit_generator.state

    @_locked
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Checkpoint every live shard and write the manifest that ties them together.

        ``directory`` is created (with its parents) if missing.
        Each shard saves itself to ``shard-<s>.fpk`` (fastper's pickle-free
        format, atomic) in parallel; the manifest (``manifest.json``, written
        last and atomically) lists them with the views they saved and the
        coordinator's state (generator, step). A shard's file is a snapshot
        of that shard at its save; inserts that reach a shard while the set
        is being saved land before or after its own snapshot, so the set is
        consistent per shard, not a global instant (stop the actors first for
        that). Returns the manifest's path.
        """
        d = Path(directory)
        if d.exists() and not d.is_dir():
            raise FileExistsError(
                f"`directory` must be a folder (it is created if missing), got {str(d)!r}, "
                "which is a file"
            )
        make_parent(d / MANIFEST)  # the folder and its parents, if missing
        self.flush()  # every update made so far reaches the shards before they save
        live = self._live()
        paths = {s: str((d / f"shard-{s}.fpk").absolute()) for s in live}
        while True:
            try:
                views = self._call_all([(s, "save", (paths[s],)) for s in live])
                break
            except ShardLostError as exc:
                self._on_loss(exc)
                live = [s for s in self._live() if s in paths]
        manifest = {
            "format": _MANIFEST_FORMAT,
            "kind": "fastper.sharded",
            "scheme": self.scheme,
            "capacities": self._capacities.tolist(),
            "shards": {
                str(s): {"file": Path(paths[s]).name, "size": v.size, "added": v.added}
                for s, v in zip(live, views, strict=True)
            },  # fmt: skip
            "lost": self._lost,
            "coordinator": {
                "step": self._step,
                "rr": self._rr,
                "generation": self._generation.tolist(),
                # batches drawn ahead are not saved: a loaded set draws them again
                "rng": _jsonable_rng(self._undrawn_state()),
            },  # fmt: skip
        }
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=d)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, d / MANIFEST)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for s, v in zip(live, views, strict=True):
            self._views[s] = v
            self._checkpoints[s] = paths[s]
        return d / MANIFEST

    @staticmethod
    def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
        """The manifest of a saved set, checked (every listed shard file present)."""
        d = Path(directory)
        path = d / MANIFEST
        if not path.is_file():
            raise CheckpointError(f"{str(d)!r} is not a sharded replay checkpoint: no {MANIFEST}")
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{str(path)!r} is not a readable manifest: {exc}") from exc
        if not isinstance(m, dict) or m.get("kind") != "fastper.sharded":
            raise CheckpointError(f"{str(path)!r} is not a fastper sharded replay manifest")
        if m.get("format") != _MANIFEST_FORMAT:
            raise CheckpointError(
                f"{str(path)!r} has manifest format {m.get('format')!r}; this fastper reads "
                f"{_MANIFEST_FORMAT}"
            )
        missing = [e["file"] for e in m["shards"].values() if not (d / e["file"]).is_file()]
        if missing:
            raise CheckpointError(f"the manifest in {str(d)!r} lists missing shard files {missing}")
        return m

    @_locked
    def restore_state(self, directory: str | os.PathLike[str]) -> None:
        """Take the coordinator's state (generator, step) and checkpoint paths from a saved set.

        Use after the shards themselves were made from the set's files (e.g.
        :meth:`load_local`, or Ray shards loaded from them).
        """
        m = self.read_manifest(directory)
        if m["capacities"] != self._capacities.tolist():
            raise CheckpointError(
                f"the saved set has shard capacities {m['capacities']}, these shards "
                f"{self._capacities.tolist()}"
            )
        c = m["coordinator"]
        self._abandon()  # batches drawn ahead belong to the state being replaced
        self._queue = []
        self._step, self._rr = int(c["step"]), int(c["rr"])
        self._applied_upto = self._step
        gens = c.get("generation", [0] * self.n_shards)
        self._generation = np.asarray(gens, dtype=np.int64)
        self._restored = bool(self._generation.any())
        self._rng.bit_generator.state = c["rng"]
        self._lost = [int(s) for s in m["lost"]]
        d = Path(directory)
        self._checkpoints = {
            int(s): str((d / e["file"]).absolute()) for s, e in m["shards"].items()
        }
        self.refresh()

    @classmethod
    def load_local(cls, directory: str | os.PathLike[str], **kwargs: Any) -> ShardedReplayBuffer:
        """A local sharded buffer from a saved set (shards as buffers in this process)."""
        from .shard import Shard

        m = cls.read_manifest(directory)
        d = Path(directory)
        n = len(m["capacities"])
        if set(m["shards"]) != {str(s) for s in range(n)}:
            raise CheckpointError(
                f"the set in {str(d)!r} lacks shards {sorted(set(map(str, range(n))) - set(m['shards']))} "
                "(lost before it was saved); load it with the shards it has by hand"
            )
        shards = [Shard.load(str(d / m["shards"][str(s)]["file"])) for s in range(n)]
        out = cls(LocalTransport(shards, loader=Shard.load), **kwargs)
        out.restore_state(d)
        return out


def _jsonable_rng(state: Mapping[str, Any]) -> dict[str, Any]:
    """A PCG64 state with Python ints (JSON keeps them exactly)."""
    return json.loads(json.dumps(state, default=int))
