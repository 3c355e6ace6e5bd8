"""Buffer states: ``state_dict`` / ``load_state_dict`` / ``save``, and :func:`load`.

A buffer's state is nested dicts of JSON values whose parts (``"writer"``,
``"sampler"``, ``"storage"``, ``"nstep"``) come from the parts' own
``state_dict()``; only the part dicts hold numpy arrays. :mod:`fastper.checkpoint`
writes and reads such states as files; this module turns buffers into states
and back (:func:`from_state_dict`, :func:`load`), choosing the class by the
state's ``kind`` from :data:`BUFFER_KINDS`, where each buffer class registers
itself.

``save`` does not stop the world: it holds the buffer's lock only to take a
snapshot of the small state and the priorities (O(N) copy of 8 bytes per
slot), then streams the rows outside it, one chunk at a time under the lock.
Rows an ``add`` overwrites before they were written are first copied aside
(:class:`_SaveGuard`), so the file holds exactly the state at the snapshot.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from . import checkpoint as _ckpt
from . import schedules as _sched
from ._validation import check_int, check_real, show, to_numpy
from .buffer_core import BufferCore, constructor_args, locked
from .errors import CheckpointError, ScheduleNotSerializableError
from .frames import FrameStore
from .samplers import PriorityMax, Sampler
from .storage import Field, ReplayStorage, Storage
from .validity import Validity
from .writer import RingWriter

F = TypeVar("F", bound=Callable[..., Any])

#: what ``storage=`` accepts: a storage, or a factory ``(fields, capacity) -> storage``
StorageLike = ReplayStorage | Callable[[Mapping[str, Field], int], ReplayStorage]

SCHEMES = ("proportional", "rank")

#: buffer classes by ``kind``, filled as the classes are defined
BUFFER_KINDS: dict[str, type[Any]] = {}


class _SaveGuard:
    """Keeps the rows a save still has to write, when ``add`` overwrites them meanwhile.

    ``save`` snapshots everything small under the buffer's lock, then streams
    the storage's rows outside it, one chunk at a time under the lock. A slot
    overwritten before its rows were written gets its old rows copied here
    first (once), so the file holds the state at the snapshot.
    """

    def __init__(self, storage: ReplayStorage, n: int) -> None:
        self.storage = storage
        self.n = n
        self.names = list(storage.fields)
        self.saved_through: dict[str, int] = dict.fromkeys(self.names, 0)
        self.kept = np.zeros(n, dtype=np.bool_)
        # rows set aside, in growing arrays (doubling): a chunk read filters them
        # in O(rows set aside) without copying them again
        self.count = 0
        self.slots = np.empty(0, dtype=np.int64)
        self.rows: dict[str, np.ndarray] = {}

    def before_write(self, slots: np.ndarray) -> None:
        """Set aside the old rows of ``slots`` that the save still needs. O(k)."""
        lo = min(self.saved_through.values())
        s = slots[(slots < self.n) & (slots >= lo)]
        if s.size == 0:
            return
        s = s[~self.kept[s]]
        if s.size == 0:
            return
        self.kept[s] = True
        # host arrays, whatever the storage hands back (a device storage: tensors)
        gathered = {k: to_numpy(v) for k, v in self.storage.gather(s).items()}
        end = self.count + s.shape[0]
        if end > self.slots.shape[0]:
            size = max(2 * self.slots.shape[0], end, 256)
            self.slots = np.resize(self.slots, size)
            for name in self.names:
                old = self.rows.get(name)
                grown = np.empty((size, *gathered[name].shape[1:]), gathered[name].dtype)
                if old is not None:
                    grown[: self.count] = old[: self.count]
                self.rows[name] = grown
        self.slots[self.count : end] = s
        for name in self.names:
            self.rows[name][self.count : end] = gathered[name]
        self.count = end

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of ``name`` as they were at the snapshot."""
        rows = self.storage.read(name, lo, hi)
        if self.count:
            s = self.slots[: self.count]
            inside = np.flatnonzero((s >= lo) & (s < hi))
            if inside.size:
                rows[s[inside] - lo] = self.rows[name][inside]
        self.saved_through[name] = hi
        return rows


class StateMixin(BufferCore):
    """The state half of a buffer (see the module docstring): states, saves and
    switching the sampling scheme; used by ``buffers._Buffer``."""

    _sampler: Sampler
    _scheme: str
    _scheme_options: dict[str, Any]
    _pending_switch: dict[str, Any] | None
    _alpha_schedule: Callable[[int], float]
    _beta_schedule: Callable[[int], float]
    _noise_schedule: Callable[[int], float]
    _step: int
    _max_seen: float
    _last_max: float
    _stale_updates: int
    _rng: np.random.Generator
    _current_max: PriorityMax | None
    _lock: threading.RLock
    _save_lock: threading.Lock
    _guards: list[_SaveGuard]
    _validity: Validity

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            BUFFER_KINDS[cls.kind] = cls

    def _build_sampler(
        self, scheme: str, alpha: float, options: Mapping[str, Any], raw: np.ndarray | None
    ) -> Sampler:  # pragma: no cover - provided by the buffer
        raise NotImplementedError

    def _invalidate_slots(self, slots: np.ndarray) -> int:  # pragma: no cover - the buffer's
        raise NotImplementedError

    def _refile_frames(self, n: int) -> None:  # pragma: no cover - provided by the buffer
        raise NotImplementedError

    # -- scheme switching ------------------------------------------------------
    @locked
    def switch_scheme(
        self,
        scheme: str,
        *,
        at_step: int | None = None,
        alpha: _sched.ScheduleLike | None = None,
        sort_every: int | None = None,
        segments: bool = False,
    ) -> None:
        """Sample with another prioritized scheme from now (or from ``at_step``) on.

        A proposed recipe: rank-based early (robust to the cold start),
        proportional later. Data, priorities, keys and the ring stay; only the
        index over the priorities is rebuilt, once, O(N log N) at the switch.
        A pending switch survives checkpoints; a later call replaces it.

        Args:
            scheme: ``"proportional"`` or ``"rank"``.
            at_step: switch when :attr:`step` reaches it (checked at every
                ``sample``, O(1)); ``None`` or a step already reached: now.
            alpha: alpha (number or schedule) from the switch on; default:
                keep the current schedule.
            sort_every, segments: options of the rank-based scheme (see
                :class:`RankBasedReplayBuffer`).

        Raises:
            ValueError, TypeError: an unknown scheme, a uniform buffer, bad options.
        """
        if self.kind == "uniform":
            raise ValueError(
                "`switch_scheme` needs a prioritized buffer, got a ReplayBuffer (uniform)"
            )
        if scheme not in SCHEMES:
            raise ValueError(f"`scheme` must be one of {list(SCHEMES)}, got scheme={scheme!r}")
        if at_step is not None:
            at_step = check_int("at_step", at_step, minimum=0)
        schedule = None if alpha is None else _sched.as_schedule("alpha", alpha)
        options = self._rank_options(sort_every, segments) if scheme == "rank" else {}
        pending = {"scheme": scheme, "at_step": at_step, "alpha": schedule, "options": options}
        if at_step is None or at_step <= self._step:
            self._switch(pending)
        else:
            self._pending_switch = pending

    @staticmethod
    def _rank_options(sort_every: Any, segments: Any) -> dict[str, Any]:
        if sort_every is not None:
            sort_every = check_int("sort_every", sort_every, minimum=1)
        if not isinstance(segments, bool | np.bool_):
            raise TypeError(f"`segments` must be a bool, got segments={show(segments)}")
        return {"sort_every": sort_every, "segments": bool(segments)}

    def _switch(self, pending: Mapping[str, Any]) -> None:
        """Rebuild the index for ``pending["scheme"]``; checks first, so nothing changes on error."""
        schedule = pending["alpha"] or self._alpha_schedule
        alpha = self._checked_alpha(schedule(self._step - self._step % self._alpha_every))
        n = len(self)
        new = self._build_sampler(
            pending["scheme"], alpha, pending["options"], self._sampler.raw_leaves
        )
        new.check_priorities("priorities", self._sampler.raw[:n], alpha)
        new.check_priorities("max_priority", np.asarray([self._max_seen]), alpha)
        new.reset_priorities(self._sampler.raw[:n], n)
        invalid = self._validity.invalid_slots(n)
        if invalid.size:  # the new index gives them zero mass too
            new.invalidate(invalid, n)
        self._sampler = new
        if self._current_max is not None:  # (the tree is over the same array)
            new.keep_max(self._current_max)
        self._alpha_schedule = schedule
        self._scheme = pending["scheme"]
        self._scheme_options = dict(pending["options"])
        self._pending_switch = None

    def _state_dict(
        self, storage_state: dict[str, Any], priorities_out: np.ndarray | None = None
    ) -> dict[str, Any]:
        n = len(self)
        pending = self._pending_switch
        return {
            "kind": self.kind,
            "settings": self._settings(),
            "schedules": self._schedules_state(),
            "buffer": {
                "scheme": self._scheme,
                "scheme_options": self._scheme_options,
                "pending_switch": None
                if pending is None
                else {
                    **pending,
                    "alpha": None if pending["alpha"] is None else _sched.to_dict(pending["alpha"]),
                },
                "max_priority_ever": self._max_seen,
                "stale_updates": self._stale_updates,
                "step": self._step,
                "rng": self._rng.bit_generator.state,
                # only the "last" policy reads it: other buffers' states stay as before
                **({_LAST_KEY: self._last_max} if self._max_policy == "last" else {}),
            },
            "writer": self._writer.state_dict(),
            "sampler": self._sampler.state_dict(n, out=priorities_out),
            "storage": storage_state,
            "nstep": None if self._nstep is None else self._nstep.state_dict(),
            **({} if self._frames is None else {"frames": self._frames.state_dict()}),
            # only buffers holding invalid slots write it: other states stay as before
            **(
                {}
                if self._validity.all_valid
                else {"validity": self._validity.state_dict(n)}
            ),
        }

    @locked
    def state_dict(self) -> dict[str, Any]:
        """The buffer's whole state: settings, counters, random state and arrays. O(N).

        Nested dicts of JSON-able values; numpy arrays appear only as values of
        the part dicts ``"sampler"``, ``"storage"`` and ``"nstep"``. The storage's
        arrays are views of the buffer's memory (copy them to keep a snapshot
        while the buffer changes); the rest is copied. :func:`from_state_dict`
        and :meth:`load_state_dict` take it back; :meth:`save` writes it.
        """
        return self._state_dict(self._storage.state_dict(len(self)))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this buffer's contents with ``state`` (from :meth:`state_dict`).

        The settings must match this buffer's (:func:`fastper.from_state_dict`
        builds a buffer from any state). The state is loaded into a new buffer
        first, so a refused state changes nothing here. O(N log N) at most.

        Raises:
            ValueError: settings that differ, or an inconsistent state.
        """
        # a save in progress finishes first: it streams rows outside the lock
        with self._save_lock, self._lock:
            if self._run_count:
                self._flush_run()
            self._load_state_dict(state)

    def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        mine = _jsonable(self._settings())
        theirs = _jsonable(state.get("settings"))
        if not isinstance(theirs, dict):
            raise ValueError(f"`state` must hold the buffer's settings, got {theirs!r}")
        # the seed only started the generator, whose state the state replaces
        differ = sorted(
            k for k in mine.keys() | theirs.keys() if k != "seed" and mine.get(k) != theirs.get(k)
        )
        if state.get("kind") != self.kind or differ:
            raise ValueError(
                "`state` must come from a buffer with this buffer's settings, got kind "
                f"{state.get('kind')!r} ({self.kind!r} here) and different settings "
                + ", ".join(f"{k}={theirs.get(k)!r} ({mine.get(k)!r} here)" for k in differ)
            )
        sch = state.get("schedules", {})

        def given(name: str, mine: Any) -> Any:  # a custom callable cannot be in a state
            saved = sch.get(name) if isinstance(sch, Mapping) else None
            return mine if isinstance(saved, Mapping) and saved.get("kind") == "callable" else None

        other = from_state_dict(
            state,
            alpha=given("alpha", self._alpha_schedule),
            beta=given("beta", self._beta_schedule),
        )
        storage = self._storage
        if type(storage) is not Storage or storage.layout != other._storage.layout:
            # a custom storage, or one of another layout than the default the state's
            # buffer got, is loaded in place, last (the buffer keeps its storage)
            storage.load_state_dict(state["storage"], len(other))
        else:
            storage = other._storage
        for name in (
            "_writer", "_sampler", "_scheme", "_scheme_options", "_pending_switch", "_nstep",
            "_alpha_schedule", "_beta_schedule", "_noise_schedule", "_step", "_max_seen",
            "_last_max", "_stale_updates", "_rng", "_current_max", "_frames", "_validity",
        ):  # fmt: skip
            setattr(self, name, getattr(other, name))
        self._storage = storage

    def state_targets(self, n: int) -> dict[str, np.ndarray]:
        """Where a loader may read a state's arrays in place, by ``part/key`` name. O(1).

        Views of this buffer's own memory for ``n`` stored slots (the storage's
        rows, the priorities): :func:`load` reads a file straight into them.
        """
        out = {f"storage/{k}": v for k, v in self._storage.state_targets(n).items()}
        out.update({f"sampler/{k}": v for k, v in self._sampler.state_targets(n).items()})
        return out

    def load_state(self, state: Mapping[str, Any], alpha: Any = None, beta: Any = None) -> None:
        """Take ``state`` into this NEW buffer (built by :func:`build_buffer` from it).

        Checks the state part by part, then applies it. ``alpha`` / ``beta``
        replace the saved schedules (needed for custom callables). O(N log N).

        Raises:
            ValueError, TypeError, KeyError: an inconsistent state (see
                :data:`CONTENT_ERRORS`).
        """
        self._load(state, alpha, beta)

    def _load(self, state: Mapping[str, Any], alpha: Any, beta: Any) -> None:
        """Check ``state`` part by part, then apply it: only for a new buffer (see load_state_dict)."""
        optional = tuple(k for k in ("frames", "validity") if k in state)
        _exact_keys("state", state, _STATE_KEYS + optional)
        if ("frames" in state) != (self._frames is not None):
            raise ValueError("the frame state does not match the frame_stack settings")
        buf = state["buffer"]
        sch = state["schedules"]
        # written with the "last" policy only (older files and other policies: none)
        _exact_keys(
            "buffer", buf, _BUFFER_KEYS + (_LAST_KEY,) if _LAST_KEY in buf else _BUFFER_KEYS
        )
        _exact_keys("schedules", sch, ("alpha", "beta", "priority_noise"))
        _exact_keys("writer", state["writer"], ("size", "cursor", "total_added", "key_base"))
        alpha_s = _restore_schedule(sch["alpha"], alpha, "alpha")
        beta_s = _restore_schedule(sch["beta"], beta, "beta")
        noise_s = _restore_schedule(sch["priority_noise"], None, "priority_noise")
        writer = RingWriter(self._capacity)
        writer.load_state_dict(state["writer"])
        n = writer.size
        step = check_int("step", buf["step"], minimum=0)
        max_seen = check_real("max_priority_ever", buf["max_priority_ever"], minimum=1.0)
        last_max = check_real(_LAST_KEY, buf.get(_LAST_KEY, 1.0), minimum=0.0, strict_min=True)
        if last_max > max_seen:
            raise ValueError(f"{_LAST_KEY}={last_max!r} is above max_priority_ever={max_seen!r}")
        stale = check_int("stale_updates", buf["stale_updates"], minimum=0)
        scheme = buf["scheme"]
        if scheme not in ((self.kind,) if self.kind == "uniform" else SCHEMES):
            raise ValueError(f"scheme {scheme!r} cannot be used by a {type(self).__name__}")
        options = dict(buf["scheme_options"])
        if scheme == "rank":
            options = self._rank_options(options.get("sort_every"), options.get("segments", False))
        pending = buf.get("pending_switch")
        pending_switch = None
        if pending is not None:
            if pending["scheme"] not in SCHEMES:
                raise ValueError(f"pending switch to unknown scheme {pending['scheme']!r}")
            opts = pending["options"]
            pending_switch = {
                "scheme": pending["scheme"],
                "at_step": check_int("at_step", pending["at_step"], minimum=0),
                "alpha": None
                if pending["alpha"] is None
                else _restore_schedule(pending["alpha"], None, "alpha"),
                "options": self._rank_options(opts.get("sort_every"), opts.get("segments", False))
                if pending["scheme"] == "rank"
                else {},
            }
        sampler_state = dict(state["sampler"])
        p = sampler_state.get("priorities")
        if isinstance(p, np.ndarray) and p.size:
            self._check_stored_max(float(p.max()), max_seen)
        rng = np.random.Generator(np.random.PCG64())
        try:
            rng.bit_generator.state = buf["rng"]
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"random state is invalid: {exc}") from None
        nstep_state = state.get("nstep")
        if (nstep_state is None) != (self._nstep is None):
            raise ValueError("the n-step state does not match the n-step settings")
        sampler = self._sampler
        if scheme != self._scheme or options != self._scheme_options:
            sampler = self._build_sampler(
                scheme, float(sampler_state["alpha"]), options, self._sampler.raw_leaves
            )
        invalid = (
            Validity.check_state(state["validity"], n)
            if "validity" in state
            else np.empty(0, dtype=np.int64)
        )
        frames = self._frames
        if frames is not None:
            # a format-1 frame state kept one watermark: every key below it invalid
            below = FrameStore.watermark(state["frames"]) - (writer.added - n)
            if below > 0:
                old = (writer.added - n - writer.key_base + np.arange(min(below, n))) % self._capacity
                invalid = np.union1d(invalid, old.astype(np.int64))
        self._storage.load_state_dict(state["storage"], n)
        if self._nstep is not None and nstep_state is not None:
            self._nstep.load_state_dict(nstep_state)
        sampler.load_state_dict(sampler_state, n)
        if frames is not None:
            frames.load_state_dict(state["frames"])
        self._validity = Validity(self._capacity)
        self._sampler = sampler
        self._writer = writer
        if invalid.size:
            self._invalidate_slots(invalid)
        if frames is not None:
            self._refile_frames(n)
        self._scheme, self._scheme_options = scheme, options
        self._pending_switch = pending_switch
        self._alpha_schedule, self._beta_schedule, self._noise_schedule = alpha_s, beta_s, noise_s
        self._step, self._max_seen, self._stale_updates = step, max_seen, stale
        self._last_max = last_max
        self._rng = rng
        if self._max_policy == "current":
            self._current_max = PriorityMax(self._sampler.raw_leaves)
            self._sampler.keep_max(self._current_max)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint atomically (temporary file + rename). O(N).

        Never uses pickle (see :mod:`fastper.checkpoint`). The buffer's lock is
        held only to snapshot the small state and the priorities (O(N) copy of
        8 bytes per slot) and for each chunk of rows read: other threads keep
        adding and sampling while the file is written, and the file holds the
        state at the snapshot (rows overwritten meanwhile are kept aside
        first). Saves of one buffer run one at a time.
        """
        with self._save_lock:
            # the priorities are copied under the lock: into pages touched before it
            out = np.empty(len(self), dtype=np.float64)
            out.fill(0.0)
            with self._lock:
                if self._run_count:
                    self._flush_run()
                pending = self._pending_switch
                if pending is not None and pending["alpha"] is not None:
                    if _sched.to_dict(pending["alpha"]).get("kind") == "callable":
                        raise ScheduleNotSerializableError(
                            "a scheme switch pending at step "
                            f"{pending['at_step']} has a custom callable alpha, which "
                            "cannot be saved: give it a fastper.schedules schedule, or "
                            "save once the switch happened (load(path, alpha=...) then "
                            "takes the callable)"
                        )
                n = len(self)
                # a storage whose rows are durable already (fastper.disk) stands for
                # them by reference: nothing to copy, nothing to keep aside
                reference = getattr(self._storage, "reference_state", None)
                guard = _SaveGuard(self._storage, 0 if reference is not None else n)
                storage_state = (
                    reference(n, self._writer.cursor, path)
                    if reference is not None
                    else {
                        f"columns/{name}": _ckpt.LazyArray(
                            f.dtype, (n, *f.shape), functools.partial(self._read_rows, guard, name)
                        )
                        for name, f in self._storage.fields.items()
                    }
                )
                state = self._state_dict(storage_state, priorities_out=out)
                self._guards.append(guard)
            try:
                # frames are not streamed through a guard: a frame buffer holds its
                # lock while it writes (adds wait for the save)
                with self._lock if self._frames is not None else contextlib.nullcontext():
                    _ckpt.write_state(path, state)
            finally:
                with self._lock:
                    self._guards.remove(guard)

    def _read_rows(self, guard: _SaveGuard, name: str, lo: int, hi: int) -> np.ndarray:
        with self._lock:
            return guard.read(name, lo, hi)


_STATE_KEYS = ("kind", "settings", "schedules", "buffer", "writer", "sampler", "storage", "nstep")
_BUFFER_KEYS = (
    "scheme", "scheme_options", "pending_switch", "max_priority_ever", "stale_updates", "step",
    "rng",
)  # fmt: skip
_LAST_KEY = "max_priority_last"  # optional: only states of max_priority="last" have it


def _exact_keys(name: str, part: Any, keys: tuple[str, ...]) -> None:
    """A state part must be a mapping with exactly ``keys``: nothing dropped silently."""
    if not isinstance(part, Mapping):
        raise ValueError(f"state part `{name}` must be a mapping, got {type(part).__name__}")
    if set(part) != set(keys):
        raise ValueError(
            f"state part `{name}` must have the entries {sorted(keys)}, got {sorted(map(str, part))}"
        )


def _jsonable(value: Any) -> Any:
    """Tuples as lists, so settings compare equal after a JSON round trip."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def restore_schedule(saved: Mapping[str, Any], given: Any, name: str) -> Any:
    """The schedule a state saved as ``saved``, or ``given`` when it is not None
    (a custom callable cannot be saved: it must be given back). O(1)."""
    return _restore_schedule(saved, given, name)


def _restore_schedule(saved: Mapping[str, Any], given: Any, name: str) -> Any:
    if given is not None:
        return _sched.as_schedule(name, given)
    if saved.get("kind") == "callable":
        raise ScheduleNotSerializableError(
            f"the buffer was saved with a custom `{name}` schedule ({saved.get('repr')}); "
            f"pass it again: fastper.load(path, {name}=...)"
        )
    return _sched.from_dict(dict(saved))


def _constructor_args(state: Mapping[str, Any]) -> tuple[type[Any], dict[str, Any]]:
    kind = state.get("kind")
    if kind not in BUFFER_KINDS:
        raise ValueError(f"unknown buffer kind {kind!r}")
    args = constructor_args(state["settings"])
    return BUFFER_KINDS[kind], args


def build_buffer(
    state: Mapping[str, Any],
    alpha: Any = None,
    beta: Any = None,
    storage: StorageLike | None = None,
) -> Any:
    """An empty buffer of ``state``'s class and settings, ready for :meth:`load_state`.

    ``alpha`` / ``beta`` replace the saved schedules; ``storage`` as for the
    buffers' constructors (a disk buffer's reopened directory).
    """
    return _new_buffer(state, alpha, beta, storage=storage)


def read_buffer(
    path: str | os.PathLike[str],
    make: Callable[[dict[str, Any]], tuple[Any, dict[str, np.ndarray]]],
    alpha: Any = None,
    beta: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Read a checkpoint into a new buffer: the one loader every kind of file goes through.

    ``make(state)`` builds the empty buffer from the file's state (before its
    arrays are read) and says where the arrays may be read in place (see
    :meth:`StateMixin.state_targets`); then the state is checked and taken
    (:meth:`StateMixin.load_state`). Returns ``(buffer, state)``.

    Raises:
        CheckpointError: an unreadable file or inconsistent contents.
        ScheduleNotSerializableError: a custom schedule was saved and none was given.
    """
    made: list[Any] = []

    def targets(state: dict[str, Any]) -> dict[str, np.ndarray]:
        buf, where = make(state)
        made.append(buf)
        return where

    try:
        state, _ = _ckpt.read_state(path, targets)
        buf = made[0]
        buf.load_state(state, alpha, beta)
    except (ScheduleNotSerializableError, CheckpointError):
        raise
    except _CONTENT_ERRORS as exc:
        raise CheckpointError(f"{path}: inconsistent checkpoint contents: {exc}") from None
    return buf, state


def load_file(
    path: str | os.PathLike[str],
    alpha: _sched.ScheduleLike | None = None,
    beta: _sched.ScheduleLike | None = None,
) -> Any:
    """A buffer from a checkpoint that holds its rows (see :func:`fastper.load`)."""

    def make(state: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
        buf = _new_buffer(state, alpha, beta, check_size=True)
        n = state["writer"]["size"]
        if not (isinstance(n, int) and 0 <= n <= buf.capacity):
            return buf, {}
        out = buf.state_targets(n)
        frames = buf.frame_store
        fstate = state.get("frames")
        if frames is not None and isinstance(fstate, dict):  # frames straight into the ring
            added = fstate.get("added")
            if isinstance(added, int) and added >= 0:
                m = min(added, frames.capacity)
                out.update({"frames/frames": frames.frames[:m], "frames/prev": frames.prev[:m]})
        return buf, out

    return read_buffer(path, make, alpha, beta)[0]


def _new_buffer(
    state: Mapping[str, Any],
    alpha: Any,
    beta: Any,
    storage: StorageLike | None = None,
    check_size: bool = False,
) -> Any:
    """An empty buffer with ``state``'s settings (``check_size``: refuse one too big for RAM)."""
    cls, args = _constructor_args(state)
    if check_size:
        _check_size(args)
    sch = state["schedules"]
    if cls.kind == "uniform":  # uniform replay has no alpha (its state keeps the constant 1)
        return cls(
            **args,
            beta=_restore_schedule(sch["beta"], beta, "beta"),
            priority_noise=_restore_schedule(sch["priority_noise"], None, "priority_noise"),
            storage=storage,
        )
    return cls(
        **args,
        alpha=_restore_schedule(sch["alpha"], alpha, "alpha"),
        beta=_restore_schedule(sch["beta"], beta, "beta"),
        priority_noise=_restore_schedule(sch["priority_noise"], None, "priority_noise"),
        storage=storage,
    )


def from_state_dict(
    state: Mapping[str, Any],
    *,
    alpha: _sched.ScheduleLike | None = None,
    beta: _sched.ScheduleLike | None = None,
    storage: StorageLike | None = None,
) -> Any:
    """A new buffer holding ``state`` (from a buffer's ``state_dict()``).

    Args:
        state: the state.
        alpha, beta: schedules instead of the saved ones (needed for custom
            callables, which cannot be saved).
        storage: where the new buffer keeps its rows (default: RAM).

    Raises:
        ValueError: an inconsistent state.
        ScheduleNotSerializableError: a custom schedule was saved and none given.
    """
    buf = _new_buffer(state, alpha, beta, storage)
    buf._load(state, alpha, beta)
    return buf


def _check_size(args: Mapping[str, Any]) -> None:
    """Refuse a header whose buffer could not fit in this machine's memory.

    The arrays in the file only cover the stored slots; the capacity is taken
    from the header, so a forged header could otherwise ask for terabytes.
    Only what lives in RAM counts: the index (priorities, trees, ranks) and
    the default storage's columns.
    """
    capacity = int(args["capacity"])
    per_slot = 64  # raw priorities and trees or rank structure, generously
    for shape, dtype in args["fields"].values():
        per_slot += math.prod(int(x) for x in shape) * np.dtype(str(dtype)).itemsize
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        physical = 1 << 40
    if capacity * per_slot > physical:
        raise CheckpointError(
            f"checkpoint declares capacity={capacity} ({capacity * per_slot / 2**30:.1f} GiB), "
            f"more than this machine's memory ({physical / 2**30:.1f} GiB)"
        )


CONTENT_ERRORS = _CONTENT_ERRORS = (
    KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, SyntaxError,
    RecursionError,
)  # fmt: skip


def read_metadata(path: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """The checkpoint's settings and state without its arrays (see :func:`fastper.checkpoint.read_metadata`)."""
    return _ckpt.read_metadata(path, verify=verify)
