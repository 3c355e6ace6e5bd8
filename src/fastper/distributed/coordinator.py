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
trip: the shards that got points search them (``sample_mass``), the others
report their view (``view``, O(1)). Each reply's view replaces the old one,
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

Round trips: a sample is one parallel call to every live shard (two when a
shard seen empty has filled since, or one has emptied); an update one call per owning shard, not
awaited; an insert one call to one shard.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import schedules as _sched
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
from ..policy import NORMS
from .plan import ShardView, Split, combine_weights, rendezvous, split_points
from .transport import LocalTransport, ShardLostError, ShardLostWarning, Transport

__all__ = ["MANIFEST", "ShardLostWarning", "ShardedReplayBuffer"]

MANIFEST = "manifest.json"
_MANIFEST_FORMAT = 1
_POLICIES = ("raise", "continue", "restore")
#: keys carry the shard's restore generation above this bit (2^40 inserts per shard)
GENERATION_SHIFT = 40
_KEY_MASK = (1 << GENERATION_SHIFT) - 1


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
        self._pending: list[Any] = []
        self._stale_generation = 0
        k = transport.n_shards
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
        """Ask every live shard for its view now (one parallel round trip)."""
        live = self._live()
        views = self._call_all([(s, "view", ()) for s in live])
        for s, v in zip(live, views, strict=True):
            self._views[s] = v

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

    def _harvest(self) -> None:
        """Wait for the updates in flight and take their views (their errors raise here)."""
        if not self._pending:
            return
        done, self._pending = self._pending, []
        try:  # one wait for all of them (one ray.get on Ray)
            replies: list[Any] = self._t.results([p for _, p in done])
        except ShardLostError:
            replies = []
            for _, p in done:  # find which were lost; the others' views still count
                try:
                    replies.append(self._t.results([p])[0])
                except ShardLostError:
                    replies.append(None)  # handled when that shard is next called
        for (shard, _), reply in zip(done, replies, strict=True):
            if reply is not None:
                self._views[shard] = reply[1]

    def _on_loss(self, exc: ShardLostError) -> None:
        """Apply the policy to a lost shard; returns when the call may be retried."""
        s = exc.shard
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
            self._generation[s] += 1  # keys sampled before now name nothing
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
        """Draw ``batch_size`` transitions over all live shards. One parallel round trip.

        The shards' shares come from their last replies; every live shard is
        asked in the same round trip (the ones without points for their view),
        and a draw is made again over the fresh views when a shard seen empty
        holds mass now, or one seen with mass holds none (see the module
        docstring). The probabilities returned
        are those actually used (see :mod:`.plan`). IS weights use the global
        N and the global smallest mass, as of the replies. A call that raises
        leaves the generator and the step as they were. O(B log B + K) here,
        plus the shards' O(B_s log N_s) searches.

        Raises:
            EmptyBufferError: no live shard holds anything.
            ZeroPriorityError: every mass is zero.
            ShardLostError: a shard is lost and the policy is ``"raise"``.
        """
        b = check_batch_size(batch_size)  # at most 2^24 draws: an absurd size fails here
        beta_v = check_real("beta", self._beta(self._step) if beta is None else beta, minimum=0.0)
        while True:
            state = self._rng.bit_generator.state
            try:
                batch = self._sample_once(b, beta_v)
            except ShardLostError as exc:
                self._rng.bit_generator.state = state
                self._on_loss(exc)
                continue
            except BaseException:
                self._rng.bit_generator.state = state
                raise
            self._step += 1
            return batch

    def _sample_once(self, b: int, beta: float) -> SampleBatch:
        # the learner's own updates first: their replies carry the shard totals
        # that the shares of this sample must reflect (sent a learner step ago,
        # they are normally done; the shard runs them before this sample anyway)
        self._harvest()
        tries = self.n_shards + 1  # a redraw needs a shard seen empty that filled since
        for attempt in range(tries):
            final = attempt == tries - 1
            live = self._live()
            if not any(self._views[s].total > 0.0 for s in live):
                self.refresh()  # maybe only our view is empty: inserts went straight to the shards
            totals = np.zeros(self.n_shards, dtype=np.float64)
            totals[live] = [self._views[s].total for s in live]
            if not totals.sum() > 0.0:
                if sum(self._views[s].size for s in live) == 0:
                    raise EmptyBufferError("cannot sample: no live shard holds a transition")
                raise ZeroPriorityError("cannot sample: every stored priority is zero")
            self._check_minima(live)
            u = self._rng.random(b)
            split = split_points(u, totals, self._stratified)
            groups = split.groups()
            calls = [
                (s, "sample_mass", (split.local[groups[s]], float(totals[s])))
                if groups[s].size
                else (s, "view", ())
                for s in live
            ]
            try:
                replies = self._call_all(calls)
            except (EmptyBufferError, ZeroPriorityError):
                if final:
                    raise
                self.refresh()  # a shard lost its mass since its view: draw again over the rest
                continue
            for s, r in zip(live, replies, strict=True):
                self._views[s] = ShardView(r.total, r.min_mass, r.size, r.added)
            # a shard the draw could not reach holds mass now, or one it could reach holds
            # none (it got no point, by luck): draw again over the fresh views. Whether to
            # draw again depends on the views only, never on where the points fell.
            filled = any(totals[s] <= 0.0 < self._views[s].total for s in live)
            emptied = any(self._views[s].total <= 0.0 < totals[s] for s in live)
            if (filled or emptied) and not final:
                continue
            if emptied:
                raise EmptyBufferError(
                    f"cannot sample: shards lost their mass while being sampled {tries} times "
                    "in a row; sample again"
                )
            return self._assemble(b, beta, split, groups, live, replies)
        raise AssertionError("unreachable")  # pragma: no cover - the last try returns or raises

    def _assemble(
        self, b: int, beta: float, split: Split, groups: list[np.ndarray], live: list[int],
        replies: list[Any],
    ) -> SampleBatch:  # fmt: skip
        """The batch from the shards' replies to one draw. O(B + K x fields)."""
        cur_tot = np.zeros(self.n_shards, dtype=np.float64)
        cur_min = np.full(self.n_shards, np.inf)
        masses = np.empty(b, dtype=np.float64)
        idx = np.empty(b, dtype=np.int64)
        keys = np.empty(b, dtype=np.int64)
        data: dict[str, np.ndarray] = {}
        for s, r in zip(live, replies, strict=True):
            cur_tot[s], cur_min[s] = r.total, r.min_mass
            p = groups[s]
            if not p.size:
                continue
            masses[p] = r.masses
            idx[p] = np.asarray(r.indices, dtype=np.int64) + self._offsets[s]
            keys[p] = np.asarray(r.keys, dtype=np.int64) + (
                int(self._generation[s]) << GENERATION_SHIFT
            )
            for name, arr in r.data.items():
                if name not in data:
                    data[name] = np.empty((b, *arr.shape[1:]), dtype=arr.dtype)
                data[name][p] = arr
        size = int(sum(r.size for r in replies))  # N as the shards replied: every live one did
        prob, weights = combine_weights(split, masses, cur_tot, cur_min, size, beta, self._norm)
        if self._shuffle and b > 1:
            perm = self._rng.permutation(b)
            idx, prob, weights, keys = idx[perm], prob[perm], weights[perm], keys[perm]
            data = {k: v[perm] for k, v in data.items()}
        return SampleBatch(data=data, indices=idx, weights=weights, probabilities=prob, keys=keys)

    # -- priorities ----------------------------------------------------------------
    def _split_indices(self, idx: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._offsets, idx, side="right") - 1

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
        send = np.flatnonzero(current)
        order = send[np.argsort(owner[send], kind="stable")]  # the last duplicate still wins
        counts = np.bincount(owner[order], minlength=self.n_shards)
        bounds = np.concatenate(([0], np.cumsum(counts)))
        calls = []
        for s in np.flatnonzero(counts).tolist():
            sel = order[bounds[s] : bounds[s + 1]]
            calls.append((s, slots[sel], td[sel], None if local is None else local[sel]))
        if not wait:
            self._pending += [
                (s, self._t.submit(s, "update_priorities", sl, t, kk)) for s, sl, t, kk in calls
            ]
            return int(sum(c[1].shape[0] for c in calls))
        applied = 0
        while calls:
            s, sl, t, kk = calls[0]
            try:
                n, view = self._call_all([(s, "update_priorities", (sl, t, kk))])[0]
            except ShardLostError as exc:
                self._on_loss(exc)
                if self._policy == "continue":
                    calls.pop(0)
                continue
            self._views[s] = view
            applied += int(n)
            calls.pop(0)
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
                self.refresh()
                return
            except ShardLostError as exc:
                self._on_loss(exc)

    def flush(self) -> None:
        """Wait for the updates in flight and take in their replies."""
        self._harvest()

    # -- checkpoints -----------------------------------------------------------------
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
        self._harvest()
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
                "rng": _jsonable_rng(self._rng.bit_generator.state),
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
        self._step, self._rr = int(c["step"]), int(c["rr"])
        gens = c.get("generation", [0] * self.n_shards)
        self._generation = np.asarray(gens, dtype=np.int64)
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
