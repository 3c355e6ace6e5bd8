"""Frame streams: image observations stored once, stacked at sample time.

Atari-style agents see a stack of the last ``k`` frames, and consecutive
transitions of an episode share ``k - 1`` of them; ``next_obs`` of step
``t`` is ``obs`` of step ``t + 1``. Storing both stacks in every transition
keeps ``2k`` copies of each frame (56.5 GB for 1M Atari transitions); this
module keeps one (7.06 GB).

How it works. A buffer built with ``frame_stack={"obs": k}`` declares
``obs`` (and its ``next_obs``) with the shape of ONE frame, and is given one
frame per row, as any field. The :class:`FrameStore` keeps a ring of frames
(``frame_capacity`` of them) apart from the transitions; a transition stores
two int64 frame ids (the frame of ``obs`` and of ``next_obs``) and every
frame the id of the frame before it in its episode. Per stream (env / actor,
the same streams as n-step windows: ``n_envs`` or ``env_ids``):

* a row continuing an episode reuses the stream's latest frame as its
  ``obs`` (the previous row's ``next_obs``): the two must be equal, byte for
  byte, or the add is refused (rows of a stream out of order, or an episode
  end not marked); only its ``next_obs`` is written. An episode's first row
  writes both frames;
* a row with ``terminated`` or ``truncated`` ends the episode: the stream's
  next row starts a new one (with ``autoreset="next_step"``, the reset row
  is dropped as a transition and its ``next_obs`` is the new episode's first
  frame);
* :meth:`drop_pending` (the buffer's ``drop_pending()``) forgets every
  stream's episode, for envs reset by hand.

A sample gathers the ``k`` frames ending at each id by following the
``prev`` links, so a stack never crosses an episode or a stream. Before an
episode's first frame the stack is padded as Dopamine does, with zero frames
(``frame_pad="zero"``), or with the first frame repeated (``"repeat"``, as
Gymnasium's ``FrameStackObservation(padding_type="reset")``). Stacks come
back as ``(batch, k, *frame_shape)``, oldest frame first.

Validity, per transition. A transition is stored once its ``next_obs`` is
written, so no stored transition waits for a frame. When the frame ring
overwrites a frame that a stored transition still needs, that transition
(and only it) becomes invalid: the buffer gives it zero sampling mass (never
drawn, not counted in the weights' N, updates to it dropped; see
:mod:`fastper.validity`). Streams interleave, so the transitions that lose a
frame are not the oldest ones: an idle stream's transitions lose theirs while
a busy stream's older ones keep all of theirs. Each transition is filed under
the oldest frame its stacks need (a list per frame, newest first); when the
ring overwrites a frame, :meth:`FrameStore.commit` returns the keys filed
under it. With the default ``frame_capacity = capacity + capacity // 100 +
64`` this only happens when episodes average fewer than ~100 steps or
streams idle for a long time; :attr:`FrameStore.invalidated_total` counts the
casualties since the store was created (a running total, carried over by
checkpoints; never decreased when the invalid transitions leave the ring).

Costs. Per stored frame ``frame bytes + 16`` (prev link and list head); per
transition two int64 ids and 16 bytes of list links; per stream 17 bytes. An add of
``k`` rows: O(k log k) (the streams it touches, never all of them; a new
stream costs O(streams) once), a compiled kernel, one byte comparison of
each reused frame, and O(k * stack) to record which frames the stored
transitions use. A sample: O(B * stack) to follow the links plus the copy
of ``2 B stack`` frames.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._kernels import frames as _fk
from ._validation import check_int, show
from .nstep import (
    NEXT_OBS_KEYS,
    TERMINATED_KEYS,
    TRUNCATED_KEYS,
    check_env_ids,
    check_vector_step,
    lookup_rows,
    sort_ids,
)
from .storage import Field

PADS = ("zero", "repeat")
_NO_KEYS = np.empty(0, dtype=np.int64)
STATE_FORMAT = 2  # 1: with a validity watermark (read, converted by the buffer)


def default_frame_capacity(capacity: int) -> int:
    """``capacity + capacity // 100 + 64``: room for episodes of ~100 steps and up."""
    return capacity + capacity // 100 + 64


@dataclass(frozen=True, slots=True)
class FramePlan:
    """What one add writes to the frame ring, from :meth:`FrameStore.plan`."""

    k: int
    batch: dict[str, np.ndarray]  # the rows with frame ids in place of frames
    new_streams: list[int]
    touched: np.ndarray  # stream rows the add touches
    last: np.ndarray  # their states after the add
    pend: np.ndarray
    src: np.ndarray  # the new frames, (m, *shape), in id order
    new_prev: np.ndarray


class FrameStore:
    """A ring of frames with per-stream episode links (see the module docstring).

    Not locked: the buffer holds its lock around every call.

    Args:
        name, next_name: the observation field and its next-observation field.
        field: one frame's shape and dtype.
        stack: frames per stacked observation (>= 1).
        capacity: frames kept (>= 2).
        pad: ``"zero"`` or ``"repeat"``.
        n_envs: every add is one step of each of ``n_envs`` envs, or ``None``.
        autoreset: ``None`` or ``"next_step"`` (as the buffer's).
        done_keys: the fields that end an episode (terminated, truncated).
        transitions: capacity of the transition ring (for the per-transition links).
    """

    def __init__(
        self,
        name: str,
        next_name: str,
        field: Field,
        stack: int,
        capacity: int,
        *,
        pad: str = "zero",
        n_envs: int | None = None,
        autoreset: str | None = None,
        done_keys: tuple[str, ...] = (),
        transitions: int = 1,
    ) -> None:
        self.name, self.next_name = name, next_name
        self.field = field
        self.stack = check_int("frame_stack", stack, minimum=1)
        self.capacity = check_int("frame_capacity", capacity, minimum=2)
        if pad not in PADS:
            raise ValueError(f"`frame_pad` must be one of {list(PADS)}, got frame_pad={pad!r}")
        self.pad = pad
        self.n_envs = n_envs
        self.autoreset = autoreset == "next_step"
        self.done_keys = done_keys
        # one extra all-zero frame at the end: the padding, gathered like any frame
        self.frames = np.zeros((self.capacity + 1, *field.shape), dtype=field.dtype)
        self.prev = np.full(self.capacity, -1, dtype=np.int64)
        # transitions filed under the oldest frame they need (see pop_refs)
        self.transitions = check_int("capacity", transitions, minimum=1)
        self.head_ref = np.full(self.capacity, -1, dtype=np.int64)
        self.next_ref = np.full(self.transitions, -1, dtype=np.int64)
        self.added = 0  # frames ever written = the next frame's id
        self.invalidated_total = 0  # see the property `invalidated`
        self._ids = np.empty(0, dtype=np.int64)  # stream ids, by stream row
        self._last = np.empty(0, dtype=np.int64)
        self._pend = np.empty(0, dtype=np.bool_)
        self._row_of: dict[int, int] = {}
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None

    # -- introspection -----------------------------------------------------------------
    @property
    def invalidated(self) -> int:
        """Same as :attr:`invalidated_total` (the older name).

        :attr:`invalidated_total`: transitions made invalid by an overwritten
        frame since the store was created, a running total carried over by
        checkpoints. It counts events, not the transitions invalid now: it
        never goes down when those transitions leave the ring.
        """
        return self.invalidated_total

    @invalidated.setter
    def invalidated(self, value: int) -> None:
        self.invalidated_total = value

    @property
    def frame_bytes(self) -> int:
        """Bytes of one frame."""
        return int(self.field.dtype.itemsize * math.prod(self.field.shape))

    def nbytes(self) -> int:
        """Bytes held: the frame ring, its links and the stream table."""
        streams = self._ids.nbytes + self._last.nbytes + self._pend.nbytes
        links = self.head_ref.nbytes + self.next_ref.nbytes
        return int(self.frames.nbytes + self.prev.nbytes + links + streams)

    @property
    def oldest(self) -> int:
        """Id of the oldest frame still stored."""
        return max(0, self.added - self.capacity)

    # -- streams -----------------------------------------------------------------------
    def _stream_rows(self, k: int, env_ids: Any) -> tuple[np.ndarray, list[int]]:
        if self.n_envs is not None:
            check_vector_step(self.n_envs, k, env_ids)
            ids = np.arange(k, dtype=np.int64)
        elif env_ids is None:
            if k > 1:
                raise ValueError(
                    f"a batch of {k} rows of a frame stream needs stream information: pass "
                    "`env_ids` (one id per row; rows of one id are consecutive steps, e.g. "
                    f"env_ids=np.zeros({k}, dtype=np.int64) for one environment), or set "
                    "`n_envs` (row i = env i); frames of several envs are never guessed"
                )
            ids = np.zeros(1, dtype=np.int64)
        else:
            ids = check_env_ids(k, env_ids)
        if self._sorted is None:
            self._sorted = sort_ids(self._ids)
        return lookup_rows(self._sorted, self._ids.shape[0], ids)

    # -- the two-phase add -------------------------------------------------------------
    def check_frame_shapes(self, transition: Mapping[str, Any]) -> None:
        """Refuse, with the reason, a frame field given a shape other than one frame's. O(1).

        With ``frame_stack`` the two frame fields hold ONE frame per row (the
        store stacks at sample time), so a stacked observation is the usual
        mistake; the generic shape message does not say so. Fields missing
        or of a frame's shape (or a batch of them) pass: the batch check
        reports the rest.

        Raises:
            ValueError: a frame field whose shape is neither the frame's nor
                ``(B, *frame)``, or ``(B, *frame)`` in an add of one row (a
                scalar episode-end flag).
        """
        if not isinstance(transition, Mapping):
            return  # not a row dict: the batch check says so
        shape = tuple(self.field.shape)
        # a scalar episode-end flag makes the add one row: then a leading axis is a stack
        one_row = any(k in transition and np.ndim(transition[k]) == 0 for k in self.done_keys)
        for name in (self.name, self.next_name):
            if name not in transition:
                continue
            got = tuple(np.shape(transition[name]))
            if got == shape or (got[1:] == shape and not one_row):
                continue
            batch = "(B, " + ", ".join(str(d) for d in shape) + ")" if shape else "(B,)"
            raise ValueError(
                f"field `{name}` must have shape {shape} (one frame) or {batch} (a batch of "
                f"rows), got shape {got}: with frame_stack={{{self.name!r}: {self.stack}}} "
                f"each row holds only the newest frame, and the buffer stacks the last "
                f"{self.stack} frames of the episode when it samples"
            )

    def plan(self, batch: Mapping[str, np.ndarray], k: int, env_ids: Any) -> FramePlan:
        """Check and compute what an add writes; changes nothing. O(k).

        ``batch``: the add's rows, already cast to the input fields (frames of
        the frame field's shape). Returns the rows with frame ids in place of
        the two frame fields.

        Raises:
            ValueError: unknown streams, too many frames for the ring, or a
                row whose observation is not its stream's latest frame.
        """
        srow, new_streams = self._stream_rows(k, env_ids)
        # the touched streams only: an add costs O(k log k), not O(streams)
        if self.n_envs is not None:
            touched, local = srow, srow
        else:
            touched, local = np.unique(srow, return_inverse=True)
        known = touched < self._ids.shape[0]
        last = np.full(touched.shape[0], -1, dtype=np.int64)
        pend = np.zeros(touched.shape[0], dtype=np.bool_)
        last[known] = self._last[touched[known]]
        pend[known] = self._pend[touched[known]]
        done = np.zeros(k, dtype=np.bool_)
        for key in self.done_keys:
            flag = batch[key]
            done |= flag.reshape(k, -1).any(axis=1) if flag.ndim > 1 else flag.astype(bool)
        obs_id = np.empty(k, dtype=np.int64)
        next_id = np.empty(k, dtype=np.int64)
        src_row = np.empty(2 * k, dtype=np.int64)
        src_next = np.empty(2 * k, dtype=np.bool_)
        new_prev = np.empty(2 * k, dtype=np.int64)
        check_ref = np.empty(k, dtype=np.int64)
        m = _fk.frame_plan(
            local, done, last, pend, self.autoreset, self.added, self.capacity,
            obs_id, next_id, src_row, src_next, new_prev, check_ref,
        )  # fmt: skip
        if m > self.capacity:
            raise ValueError(
                f"an add must not write more than frame_capacity={self.capacity} frames, "
                f"got {m} (split the batch)"
            )
        obs, nxt = batch[self.name], batch[self.next_name]
        src_row, src_next = src_row[:m], src_next[:m]
        # each new frame copied once, from the field it comes from
        src = np.empty((m, *self.field.shape), dtype=self.field.dtype)
        src[src_next] = nxt[src_row[src_next]]
        src[~src_next] = obs[src_row[~src_next]]
        self._check_reused(obs, check_ref, src, srow, env_ids)
        out = dict(batch)
        out[self.name] = obs_id
        out[self.next_name] = next_id
        return FramePlan(k, out, new_streams, touched, last, pend, src, new_prev[:m].copy())

    def _check_reused(
        self, obs: np.ndarray, ref: np.ndarray, src: np.ndarray, srow: np.ndarray, env_ids: Any
    ) -> None:
        rows = np.flatnonzero(ref >= 0)
        if rows.size == 0:
            return
        ids = ref[rows]
        fresh = ids >= self.added
        expect = np.empty((rows.shape[0], *self.field.shape), dtype=self.field.dtype)
        expect[fresh] = src[ids[fresh] - self.added]
        expect[~fresh] = self.frames[ids[~fresh] % self.capacity]
        got = obs[rows]
        bad = (
            got.reshape(rows.shape[0], -1).view(np.uint8)
            != expect.reshape(rows.shape[0], -1).view(np.uint8)
        ).any(axis=1)
        if bad.any():
            r = int(rows[np.argmax(bad)])
            known = self._ids
            sid = int(known[srow[r]]) if srow[r] < known.shape[0] else None
            stream = (
                f"env {r}" if self.n_envs is not None else f"stream {sid if sid is not None else 0}"
            )
            raise ValueError(
                f"row {r} (`{self.name}` of {stream}) is not the `{self.next_name}` of that "
                "stream's previous row: rows of a stream must be consecutive steps. Mark an "
                "episode end with terminated / truncated, call drop_pending() after resetting "
                "envs by hand, or give each env its own id (env_ids / n_envs)"
            )

    def commit(self, plan: FramePlan, key_base: int, added: int) -> np.ndarray:
        """Write the planned frames and stream states. O(m); cannot fail.

        ``key_base`` / ``added``: the transition ring's counters (see
        :class:`~fastper.writer.RingWriter`). Returns the keys of the stored
        transitions that needed an overwritten frame.
        """
        m = plan.src.shape[0]
        cap = self.capacity
        if plan.new_streams:
            new = len(plan.new_streams)
            self._ids = np.concatenate([self._ids, np.asarray(plan.new_streams, dtype=np.int64)])
            self._last = np.concatenate([self._last, np.full(new, -1, dtype=np.int64)])
            self._pend = np.concatenate([self._pend, np.zeros(new, dtype=np.bool_)])
            self._sorted = None
        self._last[plan.touched] = plan.last
        self._pend[plan.touched] = plan.pend
        if m == 0:
            return _NO_KEYS
        slots = (self.added + np.arange(m, dtype=np.int64)) % cap
        lost = _NO_KEYS
        if self.added + m > cap:  # overwrites: transitions needing those frames go invalid
            # the ring fills first: only the frames past its capacity overwrite old ones
            over = slots[max(0, cap - self.added) :]
            out = np.empty(self.transitions, dtype=np.int64)
            count = _fk.pop_refs(over, self.head_ref, self.next_ref, key_base, added,
                                 self.transitions, out)  # fmt: skip
            lost = out[:count]
        self.frames[slots] = plan.src
        self.prev[slots] = plan.new_prev
        self.added += m
        return lost

    def reference(
        self, obs_ids: np.ndarray, next_ids: np.ndarray, keys: np.ndarray, key_base: int
    ) -> np.ndarray:
        """File the transitions ``keys`` (ascending, stored now in the ring whose last
        clear was at ``key_base``) under the oldest frame they need. O(m k).

        Returns the keys of those invalid at birth: a stack that reaches a frame
        already overwritten (an idle stream's history) cannot be rebuilt.
        """
        m = keys.shape[0]
        if m == 0:
            return _NO_KEYS
        heads = np.concatenate([obs_ids, next_ids])
        ids = np.empty((2 * m, self.stack), dtype=np.int64)
        ok = _fk.stack_ids(heads, self.prev, self.stack, self.oldest, self.capacity, False, ids)
        ok = ok[:m] & ok[m:]
        # stacks are oldest first, padding (-1) before an episode's first frame
        big = np.iinfo(np.int64).max
        oldest = np.where(ids >= 0, ids, big).min(axis=1)
        oldest = np.minimum(oldest[:m], oldest[m:])
        keep = ok & (oldest < big)
        _fk.push_refs(oldest[keep], keys[keep], self.head_ref, self.next_ref, self.capacity,
                      key_base, self.transitions)  # fmt: skip
        return keys[~keep]

    def reset_refs(self) -> None:
        """Forget every filed transition (before filing the stored ones again). O(N)."""
        self.head_ref[:] = -1
        self.next_ref[:] = -1

    def stacks(self, ids: np.ndarray) -> np.ndarray:
        """The stacked frames ``(len(ids), stack, *shape)`` ending at each id. O(B k)."""
        out = np.empty((ids.shape[0], self.stack), dtype=np.int64)
        _fk.stack_ids(
            ids, self.prev, self.stack, self.oldest, self.capacity, self.pad == "repeat", out
        )
        flat = np.where(out >= 0, out % self.capacity, self.capacity).reshape(-1)
        return self.frames.take(flat, axis=0).reshape(ids.shape[0], self.stack, *self.field.shape)

    def gather(self, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Replace the two frame-id columns of a gathered batch by their stacks."""
        b = data[self.name].shape[0]
        both = self.stacks(np.concatenate([data[self.name], data[self.next_name]]))
        out = dict(data)
        out[self.name] = both[:b]
        out[self.next_name] = both[b:]
        return out

    def end_episodes(self) -> None:
        """Every stream's next row starts an episode (envs reset by hand). O(streams)."""
        self._last = np.full_like(self._last, -1)
        self._pend = np.zeros_like(self._pend)

    def clear(self) -> None:
        """Forget the streams' episodes and the filed transitions (the buffer was emptied)."""
        self.end_episodes()
        self.reset_refs()

    # -- state -------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The frame settings: field, stack, capacity, pad."""
        return {"field": self.name, "stack": self.stack, "capacity": self.capacity, "pad": self.pad}

    def state_dict(self) -> dict[str, Any]:
        """Counters (JSON) and views of the stored frames, links and streams."""
        n = min(self.added, self.capacity)
        return {
            "format": STATE_FORMAT,
            "added": self.added,
            "invalidated": self.invalidated_total,
            "frames": self.frames[:n],
            "prev": self.prev[:n],
            "stream_ids": self._ids,
            "stream_last": self._last,
            "stream_pend": self._pend,
        }

    @staticmethod
    def watermark(state: Mapping[str, Any]) -> int:
        """Of a format-1 state (a watermark for all streams): the key below which every
        transition was invalid; 0 for later formats."""
        if isinstance(state, Mapping) and state.get("format") == 1:
            return check_int("valid_from", state.get("valid_from"), minimum=0)
        return 0

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check ``state`` (from :meth:`state_dict`), then take it. O(frames).

        The filed transitions are not part of it: the buffer files its stored
        valid transitions again (:meth:`reset_refs`, :meth:`reference`).
        """
        keys = {"format", "added", "invalidated", "frames", "prev",
                "stream_ids", "stream_last", "stream_pend"}  # fmt: skip
        fmt = state.get("format") if isinstance(state, Mapping) else None
        if fmt == 1:
            keys |= {"valid_from", "last_ref"}
        if not isinstance(state, Mapping) or set(state) != keys:
            have = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"frame state must have the entries {sorted(keys)}, got {have}")
        if fmt not in (1, STATE_FORMAT):
            raise ValueError(f"unknown frame state format {fmt!r}")
        added = check_int("frames added", state["added"], minimum=0)
        self.watermark(state)
        invalidated = check_int("invalidated", state["invalidated"], minimum=0)
        n = min(added, self.capacity)
        f = self.field
        checks: tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...] = (
            ("frames", f.dtype, (n, *f.shape)), ("prev", np.dtype(np.int64), (n,)),
        )  # fmt: skip
        for part, want, shape in checks:
            a = state[part]
            if not isinstance(a, np.ndarray) or a.dtype != want or a.shape != shape:
                got = f"{a.dtype}{a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"frame state `{part}` must be {want}{shape}, got {got}")
        ids, last, pend = state["stream_ids"], state["stream_last"], state["stream_pend"]
        s = ids.shape[0] if isinstance(ids, np.ndarray) else -1
        for part, a, kind in (
            ("stream_ids", ids, np.dtype(np.int64)), ("stream_last", last, np.dtype(np.int64)),
            ("stream_pend", pend, np.dtype(np.bool_)),
        ):  # fmt: skip
            if not isinstance(a, np.ndarray) or a.dtype != kind or a.shape != (s,):
                raise ValueError(f"frame state `{part}` must be {kind}[{s}]")
        if s and (np.unique(ids).shape[0] != s or int(ids.min()) < 0):
            raise ValueError("frame state `stream_ids` must be distinct ids >= 0")
        if s and (int(last.max()) >= added or int(last.min()) < -1):
            raise ValueError("frame state `stream_last` refers to frames never written")
        prev = state["prev"]
        if n and (int(prev.max()) >= added or int(prev.min()) < _fk.LOST):
            raise ValueError("frame state `prev` refers to frames never written")
        self.frames[:n] = state["frames"]
        self.frames[self.capacity] = 0
        self.prev[:n] = prev
        self.reset_refs()
        self.added, self.invalidated_total = added, invalidated
        self._ids, self._last, self._pend = ids.copy(), last.copy(), pend.copy()
        self._sorted = None


def frame_store_for(
    fields: Mapping[str, Field],
    capacity: Any,
    frame_stack: Any,
    frame_capacity: Any,
    frame_pad: Any,
    n_envs: Any,
    autoreset: Any,
    nstep_keys: Mapping[str, str | None] | None,
) -> FrameStore:
    """Check a buffer's frame settings against its ``fields``; the store of its frame stream.

    Raises:
        ValueError: a ``frame_stack`` that does not name one field and its next
            observation (same shape and dtype), or no field that ends episodes.
    """
    if not isinstance(frame_stack, Mapping) or len(frame_stack) != 1:
        raise ValueError(
            "`frame_stack` must map one observation field to its stack size, e.g. "
            f"frame_stack={{'obs': 4}}, got frame_stack={show(frame_stack)}"
        )
    ((name, k),) = frame_stack.items()
    keys = dict(nstep_keys or {})
    next_name = keys.get("next_obs") or f"next_{name}"
    if next_name not in fields and name == "obs":
        next_name = next((f for f in NEXT_OBS_KEYS if f in fields), next_name)
    for need in (name, next_name):
        if need not in fields:
            raise ValueError(
                f"`frame_stack` names field {name!r}, whose next observation is field "
                f"{next_name!r}: both must be fields (one frame each), got fields "
                f"{list(fields)}"
            )
    if fields[name] != fields[next_name]:
        a, b = fields[name], fields[next_name]
        raise ValueError(
            f"field {next_name!r} must have the shape and dtype of field {name!r}, "
            f"{a.shape} {a.dtype} (the next observation is the episode's next frame, stored in "
            f"the same frame ring), got {b.shape} {b.dtype}"
        )
    done: list[str] = []
    for role, names in (("terminated", TERMINATED_KEYS), ("truncated", TRUNCATED_KEYS)):
        if role in keys:
            key = keys[role]
            if key is not None:
                if key not in fields:
                    raise ValueError(f"`nstep_keys` names {role} field {key!r}, not a field")
                done.append(key)
            continue
        found = next((f for f in names if f in fields), None)
        if found is None:
            raise ValueError(
                f"frame streams must know where episodes end: no {role} field found "
                f"(looked for {list(names)}); add one, or say there is none with "
                f"nstep_keys={{'{role}': None}}"
            )
        done.append(found)
    cap = check_int("capacity", capacity, minimum=1)
    fcap = default_frame_capacity(cap) if frame_capacity is None else frame_capacity
    return FrameStore(
        name, next_name, fields[name], k, fcap, pad=frame_pad,
        n_envs=None if n_envs is None else check_int("n_envs", n_envs, minimum=1),
        autoreset=autoreset, done_keys=tuple(done), transitions=cap,
    )  # fmt: skip
