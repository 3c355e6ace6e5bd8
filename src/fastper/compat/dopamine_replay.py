"""Dopamine's ``OutOfGraphPrioritizedReplayBuffer`` call shape over fastper's storage.

:class:`OutOfGraphPrioritizedReplayBuffer` keeps the rows in a
:class:`fastper.storage.Storage` and the priorities in the Dopamine-shaped
:class:`~fastper.compat.dopamine_sum_tree.SumTree`, which it reaches only
through that tree's public methods;
:class:`~fastper.compat.dopamine_elements.ReplayElement` names its stored and
returned elements. It is separate from the sum tree because the tree
stands alone while the buffer adds the ring, the transition validity rules
and Dopamine's batch layout. Users import both from
:mod:`fastper.compat.dopamine`, whose docstring describes what maps to what
and every difference from Dopamine.
"""

from __future__ import annotations

import math
import numbers
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._kernels import frames as _fk
from .._validation import as_index_array, check_int, check_real, show, to_numpy
from ..checkpoint import read_state, write_state
from ..errors import EmptyBufferError, InvalidIndexError
from ..storage import Storage, check_columns
from .dopamine_elements import ReplayElement, element_shape, extra_elements
from .dopamine_sum_tree import DopamineTypeError, DopamineValueError, RngLike, SumTree

__all__ = [
    "OutOfGraphPrioritizedReplayBuffer",
    "ReplayElement",
]

_MAX_SHOW = 8
# Dopamine hands out indices as int32
_MAX_REPLAY_CAPACITY = int(np.iinfo(np.int32).max)
_STATE_FORMAT = "fastper.compat.dopamine/1"
_CHECKPOINT_PREFIX = "fastper_replay_ckpt"
_CHECKPOINT_SUFFIX = ".fpk"
_CHECKPOINT_DURATION = 4  # Dopamine keeps the last 4 iterations' files


class OutOfGraphPrioritizedReplayBuffer:
    """Dopamine's prioritized replay buffer (see :mod:`fastper.compat.dopamine`).

    Observations are stored one per slot and stacked when sampled, as in
    Dopamine: memory holds one observation per ``add`` (plus
    ``stack_size - 1`` zero observations at each episode start), whatever
    ``stack_size`` is.

    Args:
        observation_shape: shape of one observation (one frame), a tuple of ints.
        stack_size: observations per state (4 for Dopamine's Atari agents).
        replay_capacity: number of slots kept, >= ``stack_size + update_horizon``.
        batch_size: default batch size of ``sample_transition_batch``.
        update_horizon: n of the n-step returns computed at sample time.
        gamma: discount in ``[0, 1]`` of the n-step returns.
        max_sample_attempts: redraws allowed per batch for invalid indices.
        extra_storage_types: extra per-transition elements
            (:class:`ReplayElement` or ``(name, shape, dtype)``), passed to
            ``add`` after ``terminal`` and returned after ``indices``.
        observation_dtype: dtype of the observations (``np.uint8`` for Atari).
        terminal_dtype: dtype of the terminal flags.
        action_shape: shape of one action (``()``: a scalar).
        action_dtype: dtype of the actions.
        reward_shape: shape of one reward (``()``: a scalar).
        reward_dtype: dtype of the rewards.
        rng: where sampling draws from (see :class:`SumTree`): a numpy
            Generator, an int seed, ``None``, or Python's ``random`` module
            (Dopamine's source) or a ``random.Random``; keyword only.

    Raises:
        ValueError: a capacity too small (or above 2**31 - 1), ``gamma``
            outside ``[0, 1]``, or a bad extra element.
        TypeError: arguments of the wrong type.
    """

    def __init__(
        self,
        observation_shape: Sequence[int],
        stack_size: int,
        replay_capacity: int,
        batch_size: int,
        update_horizon: int = 1,
        gamma: float = 0.99,
        max_sample_attempts: int = 1000,
        extra_storage_types: Iterable[Any] | None = None,
        observation_dtype: Any = np.uint8,
        terminal_dtype: Any = np.uint8,
        action_shape: Sequence[int] = (),
        action_dtype: Any = np.int32,
        reward_shape: Sequence[int] = (),
        reward_dtype: Any = np.float32,
        *,
        rng: RngLike = None,
    ) -> None:
        obs_shape = element_shape("observation_shape", observation_shape)
        stack = check_int("stack_size", stack_size, minimum=1)
        horizon = check_int("update_horizon", update_horizon, minimum=1)
        capacity = check_int("replay_capacity", replay_capacity, minimum=1)
        if capacity < horizon + stack:
            raise ValueError(
                f"`replay_capacity` must cover update_horizon + stack_size = {horizon + stack}, "
                f"got replay_capacity={capacity}"
            )
        if capacity > _MAX_REPLAY_CAPACITY:
            raise ValueError(
                f"`replay_capacity` must be <= {_MAX_REPLAY_CAPACITY} (indices are int32), "
                f"got replay_capacity={capacity}"
            )
        self._capacity = capacity
        self._stack_size = stack
        self._update_horizon = horizon
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        self._gamma = check_real("gamma", gamma, minimum=0.0, maximum=1.0)
        # Dopamine's discounts: gamma ** j in float32
        self._discounts = np.array([math.pow(self._gamma, j) for j in range(horizon)], np.float32)
        self._max_sample_attempts = check_int("max_sample_attempts", max_sample_attempts, minimum=0)
        self._extras = extra_elements(extra_storage_types)
        self._action_shape = element_shape("action_shape", action_shape)
        self._reward_shape = element_shape("reward_shape", reward_shape)
        fields: dict[str, Any] = {
            "observation": (obs_shape, observation_dtype),
            "action": (self._action_shape, action_dtype),
            "reward": (self._reward_shape, reward_dtype),
            "terminal": ((), terminal_dtype),
        }
        for e in self._extras:
            fields[e.name] = (e.shape, e.type)
        # columns: the stacking kernels read the observation column as one C-contiguous array
        self._storage = Storage(fields, capacity, layout="columns")
        self._names = list(self._storage.fields)
        self.sum_tree = SumTree(capacity, rng=rng)
        self._episode_end = np.zeros(capacity, dtype=np.bool_)  # ended here, cut short or not
        self._add_count = 0
        self._next_is_episode_start = True  # the next add pads its stack with zero slots

    def __repr__(self) -> str:
        return (
            f"OutOfGraphPrioritizedReplayBuffer(replay_capacity={self._capacity}, "
            f"stack_size={self._stack_size}, update_horizon={self._update_horizon}, "
            f"add_count={self._add_count})"
        )

    # -- ring ------------------------------------------------------------------
    @property
    def add_count(self) -> int:
        """Number of slots ever written: transitions plus the zero slots that pad episode starts."""
        return self._add_count

    def is_empty(self) -> bool:
        """True before the first ``add``."""
        return self._add_count == 0

    def is_full(self) -> bool:
        """True once ``replay_capacity`` slots have been written."""
        return self._add_count >= self._capacity

    def cursor(self) -> int:
        """Slot the next write goes to."""
        return self._add_count % self._capacity

    @property
    def invalid_range(self) -> np.ndarray:
        """The slots invalid because of the cursor, as Dopamine's attribute: int64, O(K + n).

        ``cursor - update_horizon .. cursor + stack_size - 1`` (modulo the
        capacity): the newest ``update_horizon`` slots lack their n-step
        successors, and the states of the next ``stack_size`` slots would
        stack frames the ring is overwriting. Before the first add: zeros.
        """
        k, n = self._stack_size, self._update_horizon
        if self._add_count == 0:
            return np.zeros(k, dtype=np.int64)
        return (self.cursor() - n + np.arange(k + n, dtype=np.int64)) % self._capacity

    @property
    def episode_end_indices(self) -> set[int]:
        """Slots whose transition ended its episode (terminal or ``episode_end``). O(N)."""
        return {int(i) for i in np.flatnonzero(self._episode_end)}

    def nbytes(self) -> int:
        """Bytes of the stored columns: one observation per slot, whatever ``stack_size`` is."""
        return self._storage.nbytes() + int(self._episode_end.nbytes)

    # -- add -------------------------------------------------------------------
    def add(
        self,
        observation: Any,
        action: Any,
        reward: Any,
        terminal: Any,
        *args: Any,
        priority: Any = None,
        episode_end: bool = False,
    ) -> None:
        """Add one transition at the cursor, overwriting the oldest slots once full. O(K log N + K d).

        As in Dopamine, the first transition of an episode is preceded by
        ``stack_size - 1`` zero slots (zero observation, action, reward,
        terminal and extras, priority 0), so that its state is padded with
        zero frames; ``add_count`` counts them.

        Args:
            observation, action, reward, terminal: one transition, each of its
                element's shape (``observation``: ONE frame, not a stack); its
                next state ends with the next ``add``'s observation.
            *args: the extra storage elements, in order; then optionally the
                priority (when ``priority`` is not given by keyword).
            priority: sampling priority, a number >= 0; required (here or as
                the last positional argument). New transitions usually get
                ``sum_tree.max_recorded_priority``.
            episode_end: the episode ends here without a terminal state (a
                timeout): the n-step transitions whose returns would reach
                past it are then never sampled, and the next ``add`` starts
                an episode.

        Raises:
            ValueError: a wrong number of arguments (the priority missing
                included) or a wrong shape; a priority not finite or too large.
            DopamineValueError: a negative priority.
            FieldTypeError: a value that its column's dtype cannot hold unchanged.
        """
        n_extra = len(self._extras)
        if priority is None and len(args) == n_extra + 1:
            priority, args = args[-1], args[:-1]
        if priority is None or len(args) != n_extra:
            expected = ", ".join([*self._names, "priority"])
            raise ValueError(
                f"Add expects ({expected}), the priority by keyword or last; got "
                f"{4 + len(args)} positional arguments"
                + (" and no priority" if priority is None else " and priority=...")
            )
        values = (observation, action, reward, terminal, *args)
        pad = self._stack_size - 1 if self._next_is_episode_start else 0
        rows: dict[str, Any] = {}
        for i, (name, value) in enumerate(zip(self._names, values, strict=True)):
            arr = to_numpy(value)
            expected_shape = self._storage.fields[name].shape
            if arr.shape != expected_shape:
                why = ""
                if name == "observation" and arr.shape[-1:] == (self._stack_size,):
                    why = (
                        " (one frame: the buffer stacks the last "
                        f"stack_size={self._stack_size} frames when it samples)"
                    )
                raise ValueError(
                    f"arg {i} ({name}) must have shape {expected_shape}{why}, got shape {arr.shape}"
                )
            if pad:
                arr = np.concatenate([np.zeros((pad, *arr.shape), arr.dtype), arr[None]])
            rows[name] = arr
        prio = to_numpy(priority)
        if prio.shape != ():
            raise ValueError(f"`priority` must be a scalar, got priority of shape {prio.shape}")
        p = float(self.sum_tree.checked_values("priority", prio))
        ended = bool(np.asarray(episode_end)) or bool(np.asarray(terminal))
        prepared, k = self._storage.prepare(rows)
        # every check passed: write
        start = self.cursor()
        slots = (start + np.arange(k, dtype=np.int64)) % self._capacity
        priorities = np.zeros(k, dtype=np.float64)
        priorities[-1] = p
        self.sum_tree.set(slots, priorities)
        self._storage.write(start, prepared, k)
        self._episode_end[slots] = False
        self._episode_end[slots[-1]] = ended
        self._add_count += k
        self._next_is_episode_start = ended

    # -- validity --------------------------------------------------------------
    def _valid(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` (int64, any values) are valid transitions: Dopamine's rules, vectorised.

        O(B (K + n)): a slot is valid when it is written with its n-step
        successors, is not in :attr:`invalid_range`, no terminal lies among
        the ``stack_size - 1`` slots before it (its stack would cross into
        the previous episode), and no episode cut short (``episode_end``
        without ``terminal``) lies among its ``update_horizon`` slots.
        """
        n, cap = self._add_count, self._capacity
        k, h = self._stack_size, self._update_horizon
        cursor = n % cap
        ok = (idx >= 0) & (idx < cap)
        if n < cap:
            ok &= (idx < cursor - h) & (idx >= k - 1)
        ok &= (idx - (cursor - h)) % cap >= k + h
        safe = np.where(ok, idx, 0)
        terminal = self._storage.columns["terminal"]
        for j in range(1, k):  # the stack's history: no terminal before the last frame
            ok &= terminal[(safe - j) % cap] == 0
        for j in range(h):  # the n-step window: no episode cut short
            s = (safe + j) % cap
            ok &= ~(self._episode_end[s] & (terminal[s] == 0))
        return ok

    def _valid_one(self, i: int) -> bool:
        """:meth:`_valid` of one index, on Python ints: the redraw loop's check. O(K + n)."""
        n, cap = self._add_count, self._capacity
        k, h = self._stack_size, self._update_horizon
        cursor = n % cap
        if not 0 <= i < cap or (n < cap and not k - 1 <= i < cursor - h):
            return False
        if (i - (cursor - h)) % cap < k + h:
            return False
        terminal = self._storage.columns["terminal"]
        if any(terminal[(i - j) % cap] != 0 for j in range(1, k)):
            return False
        ends = self._episode_end
        return not any(ends[s] and terminal[s] == 0 for s in ((i + j) % cap for j in range(h)))

    def is_valid_transition(self, index: int) -> bool:
        """Whether slot ``index`` can be sampled now (Dopamine's rules, see :meth:`_valid`). O(K + n)."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"`index` must be an integer, got index={show(index)}")
        return self._valid_one(int(index))

    # -- stacks ------------------------------------------------------------------
    def _stack_slots(self, idx: np.ndarray) -> np.ndarray:
        """``(B, stack_size)`` slots of the stacks ending at ``idx``, oldest first."""
        offsets = np.arange(1 - self._stack_size, 1, dtype=np.int64)
        return (idx[:, None] + offsets) % self._capacity

    def _stacks(self, idx: np.ndarray) -> np.ndarray:
        """States ``(B, *observation_shape, stack_size)`` ending at ``idx``, C-contiguous. O(B K F)."""
        obs = self._storage.columns["observation"]
        b, k = idx.shape[0], self._stack_size
        if k == 1:
            return obs.take(idx, axis=0)[..., None]
        flat = obs.reshape(obs.shape[0], -1)  # a view: the column is C-contiguous
        out = np.empty((b, flat.shape[1], k), dtype=obs.dtype)
        _fk.gather_stacks_last(flat, self._stack_slots(idx), out)
        return out.reshape(b, *obs.shape[1:], k)

    def _written_index(self, index: Any) -> np.ndarray:
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"`index` must be an integer, got index={show(index)}")
        written = None if self.is_full() else self._add_count
        return as_index_array("index", np.asarray([int(index)]), self._capacity, written=written)

    def get_observation_stack(self, index: int) -> np.ndarray:
        """The state at slot ``index``: ``(*observation_shape, stack_size)``, oldest frame first. O(K).

        The frames of slots ``index - stack_size + 1 .. index`` (modulo the
        capacity), as Dopamine stacks them; slots before the first write read
        as zeros.

        Raises:
            InvalidIndexError: ``index`` outside ``[0, replay_capacity)`` or
                not written yet.
            TypeError: ``index`` is not an integer.
        """
        return self._stacks(self._written_index(index))[0]

    def get_terminal_stack(self, index: int) -> np.ndarray:
        """The terminal flags of the slots stacked at ``index``, oldest first: ``(stack_size,)``. O(K).

        Raises:
            InvalidIndexError: ``index`` outside ``[0, replay_capacity)`` or
                not written yet.
            TypeError: ``index`` is not an integer.
        """
        slots = self._stack_slots(self._written_index(index))[0]
        return self._storage.columns["terminal"].take(slots, axis=0)

    # -- sampling --------------------------------------------------------------
    def sample_index_batch(self, batch_size: int) -> np.ndarray:
        """``batch_size`` valid indices (int32), drawn with probability proportional to priority.

        Stratified: one draw in each of ``batch_size`` equal slices of the
        total priority; then, in batch order, each invalid draw is replaced by
        independent redraws until valid, at most ``max_sample_attempts``
        redraws in all: Dopamine's draws, in Dopamine's order.
        O(B (log N + K + n)) plus O(log N + K + n) per redraw.

        Raises:
            EmptyBufferError: nothing was added yet.
            ZeroPriorityError: every priority is zero.
            RuntimeError: fewer than ``stack_size + update_horizon`` slots
                written (no valid transition yet), or the redraws ran out.
            TypeError, ValueError: ``batch_size`` is not an integer >= 0.
        """
        return self._sample_indices(check_int("batch_size", batch_size, minimum=0)).astype(np.int32)

    def _sample_indices(self, n: int) -> np.ndarray:
        if self._add_count == 0:
            raise EmptyBufferError("cannot sample from an empty replay buffer")
        self.sum_tree.nonempty_root()  # an empty tree raises ZeroPriorityError first
        k, h = self._stack_size, self._update_horizon
        if not self.is_full() and self._add_count - h <= k - 1:
            raise RuntimeError(
                f"cannot sample with fewer than stack_size ({k}) + update_horizon ({h}) "
                f"slots written, got add_count={self._add_count}"
            )
        tree = self.sum_tree
        saved = tree.rng_state()
        try:
            idx = tree.stratified_indices(n)
            bad = np.flatnonzero(~self._valid(idx))
            attempts = self._max_sample_attempts
            # Redraws one at a time, in batch order, as Dopamine makes them, so a
            # seeded draw source gives Dopamine's indices; they are rare (only
            # draws of invalid slots), so this loop is not per transition.
            for i in bad.tolist():
                while attempts > 0:
                    index = tree.sample()
                    attempts -= 1
                    if self._valid_one(index):
                        break
                else:
                    raise RuntimeError(
                        f"Max sample attempts: tried {self._max_sample_attempts} redraws but "
                        f"only the first {i} of the batch's {n} indices are valid"
                    )
                idx[i] = index
        except BaseException:
            tree.set_rng_state(saved)
            raise
        return idx

    def get_storage_signature(self) -> list[ReplayElement]:
        """Name, shape and dtype of each stored element, in ``add``'s order (no priority)."""
        return [ReplayElement(n, f.shape, f.dtype) for n, f in self._storage.fields.items()]

    def get_add_args_signature(self) -> list[ReplayElement]:
        """What ``add`` takes, in order: the stored elements, then the priority (float32)."""
        return [*self.get_storage_signature(), ReplayElement("priority", (), np.dtype(np.float32))]

    def get_transition_elements(self, batch_size: int | None = None) -> list[ReplayElement]:
        """Name, shape and dtype of each array ``sample_transition_batch`` returns, in order."""
        b = (
            self._batch_size
            if batch_size is None
            else check_int("batch_size", batch_size, minimum=0)
        )
        fields = self._storage.fields
        state = (b, *fields["observation"].shape, self._stack_size)
        obs_dtype = fields["observation"].dtype
        action = ((b, *self._action_shape), fields["action"].dtype)
        reward = ((b, *self._reward_shape), fields["reward"].dtype)
        elements = [
            ReplayElement("state", state, obs_dtype),
            ReplayElement("action", *action),
            ReplayElement("reward", *reward),
            ReplayElement("next_state", state, obs_dtype),
            ReplayElement("next_action", *action),
            ReplayElement("next_reward", *reward),
            ReplayElement("terminal", (b,), fields["terminal"].dtype),
            ReplayElement("indices", (b,), np.dtype(np.int32)),
        ]
        for e in self._extras:
            elements.append(ReplayElement(e.name, (b, *e.shape), fields[e.name].dtype))
        elements.append(ReplayElement("sampling_probabilities", (b,), np.dtype(np.float32)))
        return elements

    def sample_transition_batch(
        self, batch_size: int | None = None, indices: Any = None
    ) -> tuple[np.ndarray, ...]:
        """A batch as Dopamine returns it: one array per ``get_transition_elements`` entry.

        ``state, action, reward, next_state, next_action, next_reward,
        terminal, indices, *extras, sampling_probabilities`` (the raw
        priorities). For a transition at slot ``i``, its n-step window is
        slots ``i .. i + update_horizon - 1``, cut after the first terminal;
        with ``L`` its length, ``reward`` is ``sum_j gamma**j reward[i + j]``
        over the window, ``terminal`` says whether the window holds a terminal,
        and ``next_state``, ``next_action`` and ``next_reward`` are the state,
        action and reward of slot ``i + L`` (after a terminal, whatever the
        ring holds there; Dopamine's agents mask it with ``terminal``).
        States are ``(batch, *observation_shape, stack_size)``, oldest frame
        first. Copies: writing to them leaves the buffer alone.
        O(B (log N + K frame + n d)).

        Args:
            batch_size: number of transitions; ``None`` gives the constructor's
                ``batch_size``, or ``len(indices)`` when indices are given.
            indices: slots to read instead of sampling; each must be valid.

        Raises:
            InvalidIndexError: an index out of range or not a valid transition.
            ValueError: ``indices`` and ``batch_size`` disagree.
            and whatever :meth:`sample_index_batch` raises.
        """
        if indices is None:
            n = (
                self._batch_size
                if batch_size is None
                else check_int("batch_size", batch_size, minimum=0)
            )
            idx = self._sample_indices(n)
        else:
            idx = as_index_array("indices", indices, self._capacity)
            if batch_size is not None and check_int("batch_size", batch_size) != idx.shape[0]:
                raise DopamineValueError(
                    f"`indices` must hold batch_size={batch_size} entries, got {idx.shape[0]}"
                )
            valid = self._valid(idx)
            if not valid.all():
                raise InvalidIndexError(
                    "`indices` must name valid transitions (written with their n-step "
                    "successors, away from the cursor, a stack within one episode, no episode "
                    f"cut short in the n-step window), got {show(idx[~valid][:_MAX_SHOW])}"
                )
        cols = self._storage.columns
        cap, h = self._capacity, self._update_horizon
        window = (idx[:, None] + np.arange(h, dtype=np.int64)) % cap
        ends = cols["terminal"].take(window, axis=0) != 0
        is_terminal = ends.any(axis=1)
        length = np.where(is_terminal, ends.argmax(axis=1) + 1, h)
        nxt = (idx + length) % cap
        rewards = cols["reward"]
        acc_dtype = np.result_type(self._discounts.dtype, rewards.dtype)
        ret = np.zeros((idx.shape[0], *self._reward_shape), dtype=acc_dtype)
        for j in range(h):  # in order: numpy's sum order for horizons below 8
            inside = (j < length).reshape(-1, *([1] * len(self._reward_shape)))
            ret += np.where(inside, self._discounts[j] * rewards.take(window[:, j], axis=0), 0)
        now = self._storage.gather(idx)
        terminal_dtype = self._storage.fields["terminal"].dtype
        batch = [
            self._stacks(idx),
            now["action"],
            ret.astype(rewards.dtype, copy=False),
            self._stacks(nxt),
            cols["action"].take(nxt, axis=0),
            rewards.take(nxt, axis=0),
            is_terminal.astype(terminal_dtype),
            idx.astype(np.int32),
        ]
        batch.extend(now[e.name] for e in self._extras)
        batch.append(self.sum_tree.get(idx).astype(np.float32))
        return tuple(batch)

    # -- priorities -------------------------------------------------------------
    def _priority_indices(self, indices: Any) -> np.ndarray:
        arr = to_numpy(indices)
        if arr.ndim == 0:
            raise DopamineValueError(
                f"`indices` must be a 1-D array, got the scalar indices={show(indices)}"
            )
        if arr.dtype != np.int32:
            raise DopamineTypeError(
                f"`indices` must be an int32 array, as in Dopamine (sample_index_batch and "
                f"the batch's indices are int32), got indices with dtype {arr.dtype}; convert "
                "with np.asarray(indices, dtype=np.int32)"
            )
        return as_index_array("indices", arr, self._capacity)

    def set_priority(self, indices: Any, priorities: Any) -> None:
        """Set the priorities of slots ``indices``; a repeated slot takes its last value. O(B log N).

        Args:
            indices: a 1-D int32 array (as Dopamine requires), e.g. the batch's
                ``indices``.
            priorities: one number >= 0 per index.

        Raises:
            DopamineTypeError: indices that are not int32 (a ``TypeError``
                and an ``AssertionError``, which Dopamine raises).
            InvalidIndexError: an index outside ``[0, replay_capacity)``.
            DopamineValueError: a negative priority, lengths that differ, or
                scalar indices.
            ValueError: a priority not finite or too large.
        """
        idx = self._priority_indices(indices)
        prio = to_numpy(priorities)
        if prio.shape != idx.shape:
            raise DopamineValueError(
                f"`priorities` must have one entry per index ({idx.shape[0]}), "
                f"got priorities of shape {prio.shape}"
            )
        self.sum_tree.set(idx, prio)

    def get_priority(self, indices: Any) -> np.ndarray:
        """Priorities of slots ``indices`` as float32 (0 for slots never written). O(B).

        Args:
            indices: a 1-D int32 array (as Dopamine requires).

        Raises:
            DopamineTypeError: indices that are not int32.
            InvalidIndexError: an index outside ``[0, replay_capacity)``.
            DopamineValueError: ``indices`` is a scalar, not an array.
        """
        idx = self._priority_indices(indices)
        return self.sum_tree.get(idx).astype(np.float32)

    # -- checkpoints ---------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        fields = self._storage.fields
        return {
            "replay_capacity": self._capacity,
            "stack_size": self._stack_size,
            "update_horizon": self._update_horizon,
            "gamma": self._gamma,
            "fields": {name: f.to_dict() for name, f in fields.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything the buffer holds, as JSON values and numpy arrays (views). O(N).

        The slots written, their priorities and episode ends, the counters,
        ``max_recorded_priority`` and the draw source's state (a numpy
        Generator's or a ``random.Random``'s; not that of Python's global
        ``random`` module, which belongs to the program).
        """
        n = min(self._add_count, self._capacity)
        src = self.sum_tree.rng
        if isinstance(src, np.random.Generator):
            rng: dict[str, Any] = {"kind": "numpy", "state": src.bit_generator.state}
        elif isinstance(src, random.Random):
            version, internal, gauss = src.getstate()
            rng = {"kind": "random.Random", "state": [version, list(internal), gauss]}
        else:
            rng = {"kind": "random module"}
        tree = self.sum_tree.to_state_dict()
        return {
            "format": _STATE_FORMAT,
            "settings": self._settings(),
            "ring": {
                "add_count": self._add_count,
                "next_is_episode_start": self._next_is_episode_start,
                "episode_end": self._episode_end,
            },
            "storage": self._storage.state_dict(n),
            "tree": {
                "priorities": self.sum_tree.get(np.arange(self._capacity)),
                "max_recorded_priority": tree["max_recorded_priority"],
            },
            "rng": rng,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a state from :meth:`state_dict` of a buffer with the same settings. O(N).

        Everything is checked before anything is taken: a state that does not
        fit leaves the buffer as it was. The draw source's state is taken when
        this buffer draws from the same kind of source (a numpy Generator, or
        a ``random.Random``); Python's global ``random`` is never touched.

        Raises:
            ValueError: a state of another format, of a buffer with other
                settings, or with arrays of the wrong dtype or shape, negative
                or non-finite priorities, or counters out of range.
        """
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"`state` must come from OutOfGraphPrioritizedReplayBuffer.state_dict "
                f"(format {_STATE_FORMAT!r}), got {show(state)}"
            )
        settings = self._settings()
        given = state.get("settings")
        if given != settings:
            theirs = given if isinstance(given, Mapping) else {}
            diff = [k for k in settings if theirs.get(k) != settings[k]]
            raise ValueError(
                f"the state is of a buffer with other settings ({', '.join(diff)}): build the "
                f"buffer with the saved settings {show(given)}"
            )
        ring, cols, tree_state = state.get("ring"), state.get("storage"), state.get("tree")
        if not all(isinstance(p, Mapping) for p in (ring, cols, tree_state)):
            raise ValueError("`state` must hold the parts 'ring', 'storage' and 'tree'")
        assert isinstance(ring, Mapping) and isinstance(cols, Mapping)
        assert isinstance(tree_state, Mapping)
        add_count = check_int("state['ring']['add_count']", ring.get("add_count"), minimum=0)
        start = ring.get("next_is_episode_start")
        if not isinstance(start, bool):
            raise ValueError("state['ring']['next_is_episode_start'] must be a bool")
        ends = ring.get("episode_end")
        if (
            not isinstance(ends, np.ndarray)
            or ends.dtype != np.bool_
            or ends.shape != (self._capacity,)
        ):
            raise ValueError(f"state['ring']['episode_end'] must be bool[{self._capacity}]")
        n = min(add_count, self._capacity)
        check_columns(self._storage.fields, cols, n)
        prio = tree_state.get("priorities")
        if not isinstance(prio, np.ndarray) or prio.shape != (self._capacity,):
            raise ValueError(
                f"state['tree']['priorities'] must be an array of {self._capacity} priorities"
            )
        leaves = self.sum_tree.checked_values("state['tree']['priorities']", prio)
        if leaves[n:].any():
            raise ValueError("state['tree']['priorities'] must be zero for slots never written")
        probe = SumTree(self._capacity)
        probe.set(np.arange(self._capacity), leaves)
        probe.max_recorded_priority = check_real(
            "state['tree']['max_recorded_priority']",
            tree_state.get("max_recorded_priority"),
            minimum=0.0,
        )
        rng_state = self._checked_rng_state(state.get("rng"))
        # every check passed: take it
        self._storage.load_state_dict(cols, n)
        self.sum_tree.from_state_dict(probe.to_state_dict())
        self._episode_end[:] = ends
        self._add_count = add_count
        self._next_is_episode_start = start
        if rng_state is not None:
            self.sum_tree.set_rng_state(rng_state)

    def _checked_rng_state(self, saved: Any) -> Any:
        """The saved draw-source state to restore, checked on a scratch source; or None."""
        src = self.sum_tree.rng
        if not isinstance(saved, Mapping):
            raise ValueError("`state` must hold the part 'rng'")
        kind = saved.get("kind")
        try:
            if kind == "numpy" and isinstance(src, np.random.Generator):
                scratch = type(src.bit_generator)()
                scratch.state = saved["state"]
                return saved["state"]
            if kind == "random.Random" and isinstance(src, random.Random):
                version, internal, gauss = saved["state"]
                value = (version, tuple(internal), gauss)
                random.Random().setstate(value)
                return value
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"state['rng'] holds no valid {kind} state: {exc}") from None
        return None

    def _checkpoint_file(self, checkpoint_dir: str | os.PathLike[str], suffix: Any) -> Path:
        return Path(checkpoint_dir) / f"{_CHECKPOINT_PREFIX}.{suffix}{_CHECKPOINT_SUFFIX}"

    def save(self, checkpoint_dir: str | os.PathLike[str], iteration_number: int) -> None:
        """Write the buffer to ``checkpoint_dir`` for iteration ``iteration_number``. O(N).

        One pickle-free, checksummed fastper checkpoint file,
        ``fastper_replay_ckpt.<iteration_number>.fpk`` (see
        :meth:`state_dict`), written atomically. As Dopamine does, the file of
        iteration ``iteration_number - 4`` is then removed if present.
        Dopamine's own files are not written or read.

        Raises:
            FileNotFoundError: ``checkpoint_dir`` does not exist (Dopamine
                silently skips the save).
        """
        it = check_int("iteration_number", iteration_number, minimum=0)
        folder = Path(checkpoint_dir)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"`checkpoint_dir` must be an existing directory, got {str(folder)!r}"
            )
        write_state(self._checkpoint_file(folder, it), self.state_dict())
        stale = it - _CHECKPOINT_DURATION
        if stale >= 0:
            self._checkpoint_file(folder, stale).unlink(missing_ok=True)

    def load(self, checkpoint_dir: str | os.PathLike[str], suffix: str | int) -> None:
        """Read the file :meth:`save` wrote for iteration ``suffix``. O(N).

        Raises:
            FileNotFoundError: no such checkpoint in ``checkpoint_dir``.
            CheckpointError: a truncated or altered file.
            ValueError: a checkpoint of a buffer with other settings (the
                buffer is left as it was).
        """
        path = self._checkpoint_file(checkpoint_dir, suffix)
        if not path.is_file():
            raise FileNotFoundError(f"no replay checkpoint {str(path)!r}: save(...) writes it")
        state, _ = read_state(path)
        self.load_state_dict(state)
