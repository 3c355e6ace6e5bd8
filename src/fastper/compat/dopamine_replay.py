"""Dopamine's ``OutOfGraphPrioritizedReplayBuffer`` call shape over fastper's storage.

:class:`OutOfGraphPrioritizedReplayBuffer` keeps the rows in a
:class:`fastper.storage.Storage` and the priorities in the Dopamine-shaped
:class:`~fastper.compat.dopamine_sum_tree.SumTree`, which it reaches only
through that tree's public methods; :class:`ReplayElement` names its stored
and returned elements. It is separate from the sum tree because the tree
stands alone while the buffer adds the ring, the transition validity rules
and Dopamine's batch layout. Users import both from
:mod:`fastper.compat.dopamine`, whose docstring describes what maps to what
and every difference from Dopamine.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._validation import as_index_array, check_int, check_real, show, to_numpy
from ..errors import EmptyBufferError, InvalidIndexError
from ..storage import Storage
from .dopamine_sum_tree import DopamineValueError, RngLike, SumTree

__all__ = [
    "OutOfGraphPrioritizedReplayBuffer",
    "ReplayElement",
]

_MAX_SHOW = 8
# Dopamine hands out indices as int32
_MAX_REPLAY_CAPACITY = int(np.iinfo(np.int32).max)


class ReplayElement(NamedTuple):
    """Name, shape (per transition) and dtype of one stored or returned element."""

    name: str
    shape: Sequence[int]
    type: Any


_STORED = ("observation", "action", "reward", "terminal")
_RESERVED = frozenset(
    {
        *_STORED,
        "priority",
        "state",
        "next_state",
        "next_action",
        "next_reward",
        "indices",
        "sampling_probabilities",
    }
)


def _shape(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) and int(s) >= 0 for s in value
    ):
        raise TypeError(f"`{name}` must be a tuple of non-negative ints, got {name}={show(value)}")
    return tuple(int(s) for s in value)


def _extras(extra_storage_types: Iterable[Any] | None) -> list[ReplayElement]:
    if extra_storage_types is None:
        return []
    out: list[ReplayElement] = []
    for element in extra_storage_types:
        try:
            name, shape, dtype = element.name, element.shape, element.type
        except AttributeError:
            try:
                name, shape, dtype = element
            except (TypeError, ValueError):
                raise TypeError(
                    "`extra_storage_types` must hold ReplayElement(name, shape, type) entries, "
                    f"got {show(element)}"
                ) from None
        if not isinstance(name, str) or not name:
            raise TypeError(f"extra storage element names must be non-empty strings, got {name!r}")
        if name in _RESERVED or any(e.name == name for e in out):
            raise ValueError(
                f"extra storage element name {name!r} is reserved or repeated; "
                f"reserved names are {sorted(_RESERVED)}"
            )
        out.append(ReplayElement(name, _shape(f"shape of extra element {name!r}", shape), dtype))
    return out


class OutOfGraphPrioritizedReplayBuffer:
    """Dopamine's prioritized replay buffer, for vector observations (see :mod:`fastper.compat.dopamine`).

    Args:
        observation_shape: shape of one observation, a tuple of ints.
        stack_size: must be 1 (frame stacking is not supported yet).
        replay_capacity: number of transitions kept, >= 2.
        batch_size: default batch size of ``sample_transition_batch``.
        update_horizon: must be 1 (n-step returns are not supported yet).
        gamma: discount in ``[0, 1]`` (kept; unused with one-step returns).
        max_sample_attempts: redraws allowed per batch for invalid indices.
        extra_storage_types: extra per-transition elements
            (:class:`ReplayElement` or ``(name, shape, dtype)``), passed to
            ``add`` after ``terminal`` and returned after ``indices``.
        observation_dtype, terminal_dtype, action_shape, action_dtype,
        reward_shape, reward_dtype: as in Dopamine.
        rng: generator for sampling (see :class:`SumTree`); keyword only.

    Raises:
        ValueError: ``stack_size`` or ``update_horizon`` other than 1, a
            capacity too small (or above 2**31 - 1), ``gamma`` outside
            ``[0, 1]``, or a bad extra element.
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
        obs_shape = _shape("observation_shape", observation_shape)
        stack = check_int("stack_size", stack_size, minimum=1)
        if stack != 1:
            raise ValueError(
                f"stack_size={stack} is not supported: fastper.compat.dopamine does not "
                "implement frame stacking yet; use stack_size=1 (vector observations, or "
                "frames stacked into the observation before `add`)"
            )
        horizon = check_int("update_horizon", update_horizon, minimum=1)
        if horizon != 1:
            raise ValueError(
                f"update_horizon={horizon} is not supported: fastper.compat.dopamine does not "
                "implement Dopamine's n-step returns yet; use update_horizon=1"
            )
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
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        self._gamma = check_real("gamma", gamma, minimum=0.0, maximum=1.0)
        self._max_sample_attempts = check_int("max_sample_attempts", max_sample_attempts, minimum=0)
        self._extras = _extras(extra_storage_types)
        self._action_shape = _shape("action_shape", action_shape)
        self._reward_shape = _shape("reward_shape", reward_shape)
        fields: dict[str, Any] = {
            "observation": (obs_shape, observation_dtype),
            "action": (self._action_shape, action_dtype),
            "reward": (self._reward_shape, reward_dtype),
            "terminal": ((), terminal_dtype),
        }
        for e in self._extras:
            fields[e.name] = (e.shape, e.type)
        self._storage = Storage(fields, capacity)
        self._names = list(self._storage.fields)
        self.sum_tree = SumTree(capacity, rng=rng)
        self._episode_end = np.zeros(capacity, dtype=np.bool_)  # ended here, cut short or not
        self._add_count = 0

    def __repr__(self) -> str:
        return (
            f"OutOfGraphPrioritizedReplayBuffer(replay_capacity={self._capacity}, "
            f"add_count={self._add_count})"
        )

    # -- ring ------------------------------------------------------------------
    @property
    def add_count(self) -> int:
        """Number of transitions ever added."""
        return self._add_count

    def is_empty(self) -> bool:
        """True before the first ``add``."""
        return self._add_count == 0

    def is_full(self) -> bool:
        """True once ``replay_capacity`` transitions have been added."""
        return self._add_count >= self._capacity

    def cursor(self) -> int:
        """Slot the next ``add`` writes."""
        return self._add_count % self._capacity

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
        """Add one transition at the cursor, overwriting the oldest once full. O(log N + d).

        Args:
            observation, action, reward, terminal: one transition, each of its
                element's shape; its next state is the next ``add``'s observation.
            *args: the extra storage elements, in order; then optionally the
                priority (when ``priority`` is not given by keyword).
            priority: sampling priority, a number >= 0; required (here or as
                the last positional argument). New transitions usually get
                ``sum_tree.max_recorded_priority``.
            episode_end: the episode ends here without a terminal state (a
                timeout): this transition is then never sampled, since its
                successor belongs to the next episode.

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
        transition: dict[str, Any] = {}
        for i, (name, value) in enumerate(zip(self._names, values, strict=True)):
            arr = to_numpy(value)
            expected_shape = self._storage.fields[name].shape
            if arr.shape != expected_shape:
                raise ValueError(
                    f"arg {i} ({name}) must have shape {expected_shape}, got shape {arr.shape}"
                )
            transition[name] = arr
        prio = to_numpy(priority)
        if prio.shape != ():
            raise ValueError(f"`priority` must be a scalar, got priority of shape {prio.shape}")
        p = float(self.sum_tree.checked_values("priority", prio))
        ended = bool(np.asarray(episode_end)) or bool(transition["terminal"])
        prepared, _ = self._storage.prepare(transition)
        # every check passed: write
        slot = self._add_count % self._capacity
        self.sum_tree.set(slot, p)
        self._storage.write(slot, prepared, 1)
        self._episode_end[slot] = ended
        self._add_count += 1

    # -- validity --------------------------------------------------------------
    def _valid(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` (int64, any values) are valid transitions, vectorised."""
        n, cap = self._add_count, self._capacity
        cursor = n % cap
        ok = (idx >= 0) & (idx < cap)
        if n < cap:
            ok &= idx < cursor - 1  # the successor must be written
        else:
            ok &= (idx != (cursor - 1) % cap) & (idx != cursor)  # newest, and the one at the cursor
        safe = np.where(ok, idx, 0)
        terminal = self._storage.columns["terminal"]
        cut_short = self._episode_end[safe] & (terminal[safe] == 0)
        return ok & ~cut_short

    def is_valid_transition(self, index: int) -> bool:
        """Whether slot ``index`` can be sampled now (see :mod:`fastper.compat.dopamine`). O(1)."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"`index` must be an integer, got index={show(index)}")
        return bool(self._valid(np.asarray([int(index)], dtype=np.int64))[0])

    # -- sampling --------------------------------------------------------------
    def sample_index_batch(self, batch_size: int) -> np.ndarray:
        """``batch_size`` valid indices (int32), drawn with probability proportional to priority.

        Stratified: one draw in each of ``batch_size`` equal slices of the
        total priority; an invalid draw is replaced by independent redraws
        until valid, at most ``max_sample_attempts`` redraws in all.
        O(B log N) plus O(log N) per redraw.

        Raises:
            EmptyBufferError: nothing was added yet.
            ZeroPriorityError: every priority is zero.
            RuntimeError: fewer than two transitions (none is valid yet), or
                the redraws ran out.
            TypeError, ValueError: ``batch_size`` is not an integer >= 0.
        """
        return self._sample_indices(check_int("batch_size", batch_size, minimum=0)).astype(np.int32)

    def _sample_indices(self, n: int) -> np.ndarray:
        if self._add_count == 0:
            raise EmptyBufferError("cannot sample from an empty replay buffer")
        self.sum_tree.nonempty_root()  # an empty tree raises ZeroPriorityError first
        if self._add_count < 2:
            raise RuntimeError(
                "cannot sample with fewer than stack_size (1) + update_horizon (1) transitions "
                f"added, got add_count={self._add_count}"
            )
        gen = self.sum_tree.rng
        saved = gen.bit_generator.state
        try:
            idx = self.sum_tree.stratified_indices(n)
            bad = np.flatnonzero(~self._valid(idx))
            attempts = self._max_sample_attempts
            while bad.shape[0]:
                if attempts == 0:
                    raise RuntimeError(
                        f"Max sample attempts: tried {self._max_sample_attempts} redraws but "
                        f"only {n - bad.shape[0]} of the {n} sampled indices are valid"
                    )
                k = min(bad.shape[0], attempts)
                idx[bad[:k]] = self.sum_tree.sample_indices(k)
                attempts -= k
                bad = np.flatnonzero(~self._valid(idx))
        except BaseException:
            gen.bit_generator.state = saved
            raise
        return idx

    def get_transition_elements(self, batch_size: int | None = None) -> list[ReplayElement]:
        """Name, shape and dtype of each array ``sample_transition_batch`` returns, in order."""
        b = (
            self._batch_size
            if batch_size is None
            else check_int("batch_size", batch_size, minimum=0)
        )
        fields = self._storage.fields
        state = (b, *fields["observation"].shape, 1)
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
        priorities). Copies: writing to them leaves the buffer alone.
        O(B (log N + d)).

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
                    "`indices` must name valid transitions (written, with a successor in the "
                    f"same episode, not at the cursor), got {show(idx[~valid][:_MAX_SHOW])}"
                )
        nxt = (idx + 1) % self._capacity
        now = self._storage.gather(idx)
        then = self._storage.gather(nxt)
        terminal_dtype = self._storage.fields["terminal"].dtype
        batch = [
            now["observation"][..., None],
            now["action"],
            now["reward"],
            then["observation"][..., None],
            then["action"],
            then["reward"],
            (now["terminal"] != 0).astype(terminal_dtype),
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
        return as_index_array("indices", arr, self._capacity)

    def set_priority(self, indices: Any, priorities: Any) -> None:
        """Set the priorities of slots ``indices``; a repeated slot takes its last value. O(B log N).

        Raises:
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

        Raises:
            InvalidIndexError: an index outside ``[0, replay_capacity)``.
            DopamineValueError: ``indices`` is a scalar, not an array.
        """
        idx = self._priority_indices(indices)
        return self.sum_tree.get(idx).astype(np.float32)

    # -- not supported ------------------------------------------------------------
    def save(self, checkpoint_dir: str, iteration_number: int) -> None:
        """Not supported: Dopamine's gzip checkpoints are not implemented."""
        raise NotImplementedError(
            "OutOfGraphPrioritizedReplayBuffer.save is not supported by fastper.compat.dopamine"
        )

    def load(self, checkpoint_dir: str, suffix: str) -> None:
        """Not supported: Dopamine's gzip checkpoints are not implemented."""
        raise NotImplementedError(
            "OutOfGraphPrioritizedReplayBuffer.load is not supported by fastper.compat.dopamine"
        )
