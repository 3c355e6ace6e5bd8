"""Dopamine's replay API on fastper's trees: a drop-in for code written against Dopamine.

Two classes, each with the call shape of its Dopamine counterpart (module
paths relative to ``dopamine``):

* ``replay_memory.sum_tree.SumTree`` and ``jax.replay_memory.sum_tree.SumTree``
  -> :class:`SumTree` (one class with both APIs);
* ``replay_memory.prioritized_replay_buffer.OutOfGraphPrioritizedReplayBuffer``
  -> :class:`OutOfGraphPrioritizedReplayBuffer` (vector observations; a subset);
* ``replay_memory.circular_replay_buffer.ReplayElement`` -> :class:`ReplayElement`.

Importing this module imports numpy and fastper only: no TensorFlow, JAX, gin
or torch.

What maps to what
-----------------

:class:`SumTree` holds its leaves in a :class:`fastper.SumTree` (float64,
8 children per node, every internal node recomputed from its children).

* Dopamine's NumPy tree: ``set(node_index, value)``, ``get(node_index)``,
  ``sample(query_value=None)`` (``query_value`` in ``[0, 1]`` is a fraction of
  the total), ``stratified_sample(batch_size)`` (one draw in each of
  ``batch_size`` equal slices of ``[0, 1]``), ``max_recorded_priority``
  (starts at 1.0, raised by every ``set``, never lowered) and ``nodes`` (the
  levels of a binary tree, root first).
* Dopamine's JAX-side tree: ``set(indices, values)`` / ``get(index)`` on arrays,
  ``query(targets)`` with absolute targets in ``[0, root)``, ``root``,
  ``clear()``, ``to_state_dict()`` / ``from_state_dict()`` (``{"nodes": ...}``
  in that tree's flat binary-heap layout, so state moves both ways).

:class:`OutOfGraphPrioritizedReplayBuffer` keeps the rows in a
:class:`fastper.storage.Storage` and the priorities in a :class:`SumTree`
(attribute ``sum_tree``, as in Dopamine, so agents can read
``replay.sum_tree.max_recorded_priority``). It has Dopamine's constructor
arguments, ``add(observation, action, reward, terminal, *args, priority=None,
episode_end=False)``, ``sample_index_batch``, ``sample_transition_batch``,
``get_transition_elements``, ``set_priority``, ``get_priority``,
``is_valid_transition``, ``is_empty``, ``is_full``, ``cursor`` and
``add_count``. Slot ``add_count % replay_capacity`` receives the next
transition; a transition's index is its slot; its next state is the
observation of the next slot. Priorities are used as given (no exponent, no
epsilon): ``P(i) = p_i / sum_j p_j`` over the valid transitions, exactly as in
Dopamine, where the agent applies the exponent before ``set_priority``.

``sample_transition_batch`` returns Dopamine's tuple, in Dopamine's order:
``state, action, reward, next_state, next_action, next_reward, terminal,
indices``, then one array per extra storage element, then
``sampling_probabilities``. ``state`` and ``next_state`` have shape
``(batch, *observation_shape, 1)`` (the stack axis last, of size 1), and
``sampling_probabilities`` holds the raw priorities (float32), which is what
Dopamine puts under that name; divide by ``sum_tree.root`` for probabilities.

Randomness
----------

Dopamine's NumPy tree draws from Python's global ``random`` module. Here each
tree draws from its own :class:`numpy.random.Generator`: pass ``rng=`` (a
Generator, used as is and shared, or an int seed) for reproducible draws; the
default ``None`` takes fresh OS entropy. The buffer passes its ``rng=`` to its
tree and draws only from it. Neither touches ``random`` or ``numpy.random``'s
global state. A call that raises leaves the generator where it was.

Errors
------

Where the two Dopamine trees disagree on the exception type, the one raised
here is both: :class:`DopamineValueError` subclasses ``ValueError`` (the NumPy
tree's type) and ``AssertionError`` (the JAX tree asserts), and
:class:`DopamineTypeError` subclasses ``TypeError`` and ``AssertionError``.
They are raised for a capacity that is not a positive integer, a negative
value, indices and values of different shapes and a ``nodes`` array of the
wrong shape. Sampling an empty tree (total zero) raises
:class:`fastper.ZeroPriorityError` (a ``ValueError``; Dopamine raises a bare
``Exception``); ``query_value`` outside ``[0, 1]`` and query targets outside
``[0, root)`` raise ``ValueError``, as in Dopamine. An index outside
``[0, capacity)`` raises :class:`fastper.InvalidIndexError` (an
``IndexError``). A call that raises leaves the object unchanged.

Differences from Dopamine
-------------------------

* **No drift.** Dopamine updates each ancestor by ``+= new - old``; rounding
  errors accumulate, so after many updates the root (and every internal node)
  differs from the sum of the leaves, and setting every leaf back to zero can
  leave a nonzero (even negative) root. Here the internal nodes are always
  recomputed from their children, so the tree is a function of its leaves
  alone: ``root`` stays within a few ulps of the exact sum forever and is
  exactly 0.0 when every leaf is. Sampling results therefore agree with
  Dopamine's except for targets within rounding of a boundary between two
  leaves, and except where Dopamine's drift would have mattered.
* **Summation order.** ``root`` sums 8 children at a time; ``nodes`` and
  ``to_state_dict()`` rebuild Dopamine's binary layout by pairwise sums of the
  leaves, so their root can differ from ``root`` in the last bits.
* **Boundaries.** A target that falls exactly on the total (``sample(1.0)``,
  or a uniform draw that rounds up to the total) returns the last leaf with a
  positive value; Dopamine walks to its rightmost leaf, which can be a zero
  or padding leaf past ``capacity``. A leaf whose value is zero is never
  returned. Ties elsewhere resolve as in Dopamine: the smallest index ``i``
  with ``target < leaf[0] + ... + leaf[i]``.
* **Duplicate indices in one ``set``.** The last occurrence wins, as if the
  pairs were set one by one (which is what Dopamine's NumPy tree and its
  buffer's ``set_priority`` do); Dopamine's JAX-side tree keeps the first.
* **Stricter input.** Values must be finite and at most
  ``fastper.SumTree.max_value`` (Dopamine stores ``nan`` / ``inf`` and
  corrupts its sums); indices must be integers in ``[0, capacity)``
  (Dopamine's NumPy tree wraps negative indices, and both of its trees write
  padding leaves past ``capacity`` without a word);
  indices and values must have the same shape (scalars, or arrays of any
  shape). Dopamine's int32-only check in ``set_priority`` / ``get_priority``
  is relaxed to any integer dtype (the indices must still be a 1-D array, and
  a scalar raises :class:`DopamineValueError` where Dopamine asserts).
* **Return types.** ``sample`` returns a Python ``int``, ``stratified_sample``
  a list of ``int`` (as Dopamine); ``get`` a ``float`` for a scalar index and a
  float64 array shaped like the indices otherwise; ``query`` an ``int`` for a
  scalar target (Dopamine's JAX-side tree returns a 1-element array) and an
  int64 array otherwise. ``max_recorded_priority`` is a ``float``.
* **State dicts.** ``to_state_dict()`` returns fresh arrays (Dopamine hands out
  its own array) and adds ``"max_recorded_priority"``, which Dopamine does not
  save; ``from_state_dict()`` copies, accepts a dict without that key
  (keeping the current value), rebuilds the internal nodes from the leaves
  (a Dopamine checkpoint's drifted sums are discarded) and refuses nonzero
  padding leaves. ``clear()`` zeroes the leaves and keeps
  ``max_recorded_priority``, as in Dopamine.
* **``nodes`` is a snapshot.** It is rebuilt on every access, O(capacity);
  writing into it does not change the tree.

Differences in the buffer:

* ``stack_size`` must be 1 and ``update_horizon`` must be 1: frame stacking and
  Dopamine's sample-time n-step returns are not supported yet (both are
  refused with a ``ValueError`` that says so). ``gamma`` is checked to lie in
  ``[0, 1]`` and kept, but with ``update_horizon=1`` it never enters a reward.
* ``add`` needs a priority, as Dopamine's prioritized buffer does: by keyword
  or as the last positional argument after the extras. Without one it raises
  ``ValueError("Add expects ...")`` like Dopamine; Dopamine's agents pass
  ``sum_tree.max_recorded_priority`` for a new transition (Schaul et al.).
* Values are cast into the column dtypes only where no value changes
  (fastper's storage rules: a float observation into a ``uint8`` column must
  hold whole numbers in range), where Dopamine casts silently; a cast that
  would change a value raises :class:`fastper.FieldTypeError`.
* ``sample_index_batch`` returns an int32 array (Dopamine: a list of ints) and
  only ever valid indices: when the ``max_sample_attempts`` redraws (shared by
  the batch, as in Dopamine) run out, it raises ``RuntimeError`` where Dopamine
  can return a batch that still holds an invalid index. Redraws of invalid
  indices are made from the whole tree and are not stratified, as in Dopamine.
  An empty buffer raises :class:`fastper.EmptyBufferError`, one with fewer
  than two transitions ``RuntimeError`` at once (no valid transition exists).
* ``sample_transition_batch(indices=...)`` checks the indices: each must be a
  valid transition (Dopamine reads whatever is there). With ``indices`` and no
  ``batch_size``, the batch size is ``len(indices)``.
* Validity, as in Dopamine with one-frame states and one-step returns: slot
  ``i`` is valid when its successor has been written, it is neither the newest
  slot nor (once the buffer is full) the slot at the cursor, and it is not the
  end of an episode cut short (``episode_end=True`` with ``terminal`` false),
  whose successor belongs to the next episode.
* ``add_count`` is a read-only ``int`` (Dopamine: a 0-d numpy array).
  ``save`` / ``load`` (Dopamine's gzip checkpoints) raise
  ``NotImplementedError``; the in-graph ``WrappedPrioritizedReplayBuffer`` and
  the TensorFlow ops are not provided.
* Not thread-safe (neither is Dopamine's): share one object between threads
  only behind a lock.

Costs (N = capacity, B = batch size, d = values per transition)
--------------------------------------------------------------

* :class:`SumTree`: ``set`` O(B log N), ``get`` O(B), ``query`` and
  ``stratified_sample`` O(B log N), ``sample`` O(log N), ``root`` and
  ``max_recorded_priority`` O(1); ``clear``, ``nodes``, ``to_state_dict`` O(N);
  ``from_state_dict`` O(N log N) at worst. Logarithms are base 8.
* Buffer: ``add`` O(log N + d); ``sample_index_batch`` O(B log N) plus
  O(log N) per redraw; ``sample_transition_batch`` O(B (log N + d));
  ``set_priority`` O(B log N); ``get_priority`` O(B).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._validation import as_index_array, check_int, check_real, show, to_numpy
from ..errors import EmptyBufferError, InvalidIndexError, ZeroPriorityError
from ..storage import Storage
from ..trees import SumTree as _FastSumTree

__all__ = [
    "DopamineTypeError",
    "DopamineValueError",
    "OutOfGraphPrioritizedReplayBuffer",
    "ReplayElement",
    "SumTree",
]

RngLike = np.random.Generator | int | None

_MAX_SHOW = 8
# Dopamine hands out indices as int32
_MAX_REPLAY_CAPACITY = int(np.iinfo(np.int32).max)


class DopamineValueError(ValueError, AssertionError):
    """A bad argument that Dopamine's NumPy tree rejects with ``ValueError`` and its JAX twin with ``assert``.

    Catching either ``ValueError`` or ``AssertionError`` catches it.
    """


class DopamineTypeError(TypeError, AssertionError):
    """An argument of the wrong type where Dopamine fails an ``assert``.

    Catching either ``TypeError`` or ``AssertionError`` catches it.
    """


def _make_rng(rng: Any) -> np.random.Generator:
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool) and int(rng) >= 0:
        return np.random.default_rng(int(rng))
    raise TypeError(
        f"`rng` must be a numpy Generator, a non-negative int seed or None, got rng={show(rng)}"
    )


def _one_of(what: str, a_name: str, a: Any, b_name: str, b: Any) -> Any:
    """The argument given under either of its two names (Dopamine's two trees differ)."""
    if a is not None and b is not None:
        raise TypeError(f"{what}: give `{a_name}` or `{b_name}`, not both")
    if a is None and b is None:
        raise TypeError(f"{what}: missing `{a_name}` (or `{b_name}`)")
    return a if a is not None else b


def _leaf_values(name: str, arr: np.ndarray, max_value: float) -> np.ndarray:
    """Float64 copy of ``arr`` (any shape), checked as sum tree leaves."""
    if arr.size and (arr.dtype == np.bool_ or arr.dtype.kind not in "iuf"):
        raise TypeError(f"`{name}` must hold real numbers, got {name} with dtype {arr.dtype}")
    out = np.array(arr, dtype=np.float64, copy=True)
    finite = np.isfinite(out)
    if not finite.all():
        raise ValueError(
            f"`{name}` must be finite, got non-finite {name}={show(out[~finite][:_MAX_SHOW])}"
        )
    out += 0.0  # -0.0 -> +0.0
    negative = out < 0.0
    if negative.any():
        raise DopamineValueError(
            f"sum tree values must be nonnegative, got negative {name}="
            f"{show(out[negative][:_MAX_SHOW])}"
        )
    big = out > max_value
    if big.any():
        raise ValueError(
            f"`{name}` must be <= {max_value:.3e} (so the total stays finite), "
            f"got {name}={show(out[big][:_MAX_SHOW])}"
        )
    return out


class SumTree:
    """Dopamine's sum tree (NumPy and JAX-side APIs in one class) on a fastper tree.

    Leaves ``0 .. capacity - 1`` hold nonnegative values, all 0 at first;
    sampling picks leaf ``i`` with probability ``value_i / root``. See the
    module docstring for every difference from Dopamine.

    Args:
        capacity: number of leaves, an integer >= 1.
        rng: generator for ``sample`` / ``stratified_sample``: a
            :class:`numpy.random.Generator` (used as is), an int seed, or
            ``None`` for fresh OS entropy.

    Raises:
        DopamineTypeError: ``capacity`` is not an integer.
        DopamineValueError: ``capacity`` is not positive.
        TypeError: ``rng`` is none of the above.
    """

    _capacity: int
    _rng: np.random.Generator
    _tree: _FastSumTree
    _max_recorded: float
    _levels: int

    def __init__(self, capacity: int, *, rng: RngLike = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
            raise DopamineTypeError(
                f"sum tree capacity must be an integer, got capacity={show(capacity)}"
            )
        if capacity <= 0:
            raise DopamineValueError(f"sum tree capacity must be positive, got capacity={capacity}")
        self._capacity = int(capacity)
        self._rng = _make_rng(rng)
        self._tree = _FastSumTree(self._capacity)
        self._max_recorded = 1.0
        # levels of Dopamine's binary layout below the root: ceil(log2(capacity))
        self._levels = (self._capacity - 1).bit_length()

    def __repr__(self) -> str:
        return f"SumTree(capacity={self._capacity}, root={self.root!r})"

    # -- introspection -----------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Number of leaves."""
        return self._capacity

    @property
    def rng(self) -> np.random.Generator:
        """The generator ``sample`` and ``stratified_sample`` draw from."""
        return self._rng

    @property
    def root(self) -> float:
        """Sum of all leaves (Dopamine's root node). O(1)."""
        return self._tree.total

    @property
    def max_recorded_priority(self) -> float:
        """Largest value ever given to ``set`` (1.0 before any larger one). O(1).

        May be assigned, as Dopamine's plain attribute may, with a finite
        number >= 0.
        """
        return self._max_recorded

    @max_recorded_priority.setter
    def max_recorded_priority(self, value: float) -> None:
        self._max_recorded = check_real("max_recorded_priority", value, minimum=0.0)

    @property
    def nodes(self) -> list[np.ndarray]:
        """Dopamine's NumPy-tree layout: the levels of a binary tree, root level first.

        The last level holds the leaves, padded with zeros to a power of two;
        each node above is the sum of its two children. A snapshot, rebuilt
        on every access: O(capacity).
        """
        level = np.zeros(1 << self._levels, dtype=np.float64)
        level[: self._capacity] = self._tree.leaves()
        levels = [level]
        while level.shape[0] > 1:
            level = level[0::2] + level[1::2]
            levels.append(level)
        levels.reverse()
        return levels

    # -- checks ------------------------------------------------------------------
    def _index_array(self, name: str, indices: Any) -> tuple[np.ndarray, tuple[int, ...]]:
        """Flat int64 indices in ``[0, capacity)`` and the shape they came in."""
        arr = to_numpy(indices)
        flat = as_index_array(name, arr.reshape(-1), self._capacity)
        return flat, arr.shape

    def _checked_values(self, name: str, values: Any) -> np.ndarray:
        return _leaf_values(name, to_numpy(values), self._tree.max_value)

    def _nonempty_root(self) -> float:
        root = self._tree.total
        if not root > 0.0:
            raise ZeroPriorityError(
                "cannot sample from an empty sum tree: every value is zero (root=0.0)"
            )
        return root

    # -- NumPy-tree and JAX-tree API ---------------------------------------------
    def set(
        self,
        node_index: Any = None,
        value: Any = None,
        *,
        indices: Any = None,
        values: Any = None,
    ) -> None:
        """Set leaf ``node_index`` to ``value``, or many leaves at once. O(B log N).

        Takes Dopamine's NumPy-tree names (``node_index``, ``value``) or its
        JAX-side names (``indices``, ``values``); positional arguments work for
        both. Indices and values must have the same shape (two scalars, or two
        arrays). A repeated index takes its last value. Raises
        ``max_recorded_priority`` to the largest value written.

        Raises:
            DopamineValueError: a negative value, or shapes that differ.
            ValueError: a value not finite or too large.
            TypeError: non-integer indices or non-real values.
            InvalidIndexError: an index outside ``[0, capacity)``.
        """
        idx_arg = _one_of("set()", "node_index", node_index, "indices", indices)
        val_arg = _one_of("set()", "value", value, "values", values)
        idx, shape = self._index_array("indices", idx_arg)
        val_arr = to_numpy(val_arg)
        if val_arr.shape != shape:
            raise DopamineValueError(
                f"indices and values must have the same shape, got indices of shape {shape} "
                f"and values of shape {val_arr.shape}"
            )
        vals = self._checked_values("values", val_arr).reshape(-1)
        if idx.shape[0] == 0:
            return
        self._tree.set(idx, vals)
        self._max_recorded = max(self._max_recorded, float(vals.max()))

    def get(self, node_index: Any = None, *, index: Any = None) -> Any:
        """Value of leaf ``node_index`` (a ``float``), or an array for an array of indices. O(B).

        ``index`` is the JAX-side tree's name for the argument.

        Raises:
            InvalidIndexError: an index outside ``[0, capacity)``.
            TypeError: non-integer indices.
        """
        arg = _one_of("get()", "node_index", node_index, "index", index)
        idx, shape = self._index_array("node_index", arg)
        out = self._tree.get(idx)
        if shape == ():
            return float(out[0])
        return out.reshape(shape)

    def query(self, targets: Any) -> Any:
        """Leaf of each absolute target: the smallest ``i`` with ``t < leaf[0] + ... + leaf[i]``.

        Inverse-CDF sampling with targets in ``[0, root)``. A scalar target
        gives an ``int``, an array an int64 array of the same shape.
        O(B log N).

        Raises:
            ZeroPriorityError: the tree is empty (root 0), so no target fits.
            ValueError: a target outside ``[0, root)`` (or not finite).
            TypeError: non-real targets.
        """
        arr = to_numpy(targets)
        if arr.size and (arr.dtype == np.bool_ or arr.dtype.kind not in "iuf"):
            raise TypeError(f"`targets` must hold real numbers, got targets with dtype {arr.dtype}")
        t = arr.astype(np.float64).reshape(-1)
        if t.shape[0] == 0:
            return np.empty(arr.shape, dtype=np.int64)
        root = self._tree.total
        if not root > 0.0:
            raise ZeroPriorityError(
                "cannot query an empty sum tree: targets must lie in [0.0, root) and root=0.0"
            )
        bad = ~((t >= 0.0) & (t < root))
        if bad.any():
            raise ValueError(
                f"targets must be in the interval [0.0, {root!r}), got targets="
                f"{show(t[bad][:_MAX_SHOW])}"
            )
        out = self._tree.find(t)
        if arr.ndim == 0:
            return int(out[0])
        return out.reshape(arr.shape)

    def sample(self, query_value: float | None = None) -> int:
        """One leaf, drawn with probability ``value_i / root``. O(log N).

        Args:
            query_value: a fraction in ``[0, 1]`` of the total to look up
                (the target is ``query_value * root``); ``None`` draws it
                uniformly from ``[0, 1)`` with :attr:`rng`.

        Raises:
            ZeroPriorityError: the tree is empty (every value is zero).
            ValueError: ``query_value`` outside ``[0, 1]`` or not finite.
            TypeError: ``query_value`` is not a real number.
        """
        root = self._nonempty_root()
        if query_value is None:
            q = float(self._rng.random())
        else:
            if isinstance(query_value, bool) or not isinstance(query_value, numbers.Real):
                raise TypeError(
                    f"`query_value` must be a real number in [0, 1] or None, "
                    f"got query_value={show(query_value)}"
                )
            q = float(query_value)
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"query_value must be in [0, 1], got query_value={q!r}")
        return int(self._tree.find(q * root))

    def stratified_sample(self, batch_size: int) -> list[int]:
        """``batch_size`` leaves, one drawn in each of ``batch_size`` equal slices of the total.

        Slice ``k`` covers fractions ``[k / B, (k + 1) / B]`` of the total; one
        uniform draw in each (with :attr:`rng`), looked up as in
        :meth:`sample`. Returned in slice order. O(B log N).

        Raises:
            ZeroPriorityError: the tree is empty (every value is zero).
            TypeError, ValueError: ``batch_size`` is not an integer >= 0.
        """
        root = self._nonempty_root()
        n = check_int("batch_size", batch_size, minimum=0)
        return [int(i) for i in self._stratified(n, root)]

    def clear(self) -> None:
        """Set every leaf to zero; ``max_recorded_priority`` is kept. O(N)."""
        self._tree = _FastSumTree(self._capacity)

    def to_state_dict(self) -> dict[str, Any]:
        """``{"nodes": ..., "max_recorded_priority": ...}``, nodes in the JAX-side tree's layout.

        ``nodes`` is a fresh float64 array of ``2 ** (ceil(log2 N) + 1) - 1``
        entries: a binary heap (root at 0, children of ``j`` at ``2j + 1`` and
        ``2j + 2``) whose last ``2 ** ceil(log2 N)`` entries are the leaves,
        zero-padded. O(N).
        """
        return {
            "nodes": np.concatenate(self.nodes),
            "max_recorded_priority": self._max_recorded,
        }

    def from_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the leaves of ``state_dict["nodes"]`` (this module's or Dopamine's JAX-side tree's).

        The internal nodes are rebuilt from the leaves (stored sums are not
        read). ``"max_recorded_priority"`` is taken when present. O(N log N)
        at worst.

        Raises:
            DopamineValueError: no ``"nodes"``, or nodes of the wrong shape for
                this capacity, or a negative leaf.
            ValueError: nonzero padding leaves, non-finite or too large leaves,
                or a bad ``max_recorded_priority``.
        """
        if not isinstance(state_dict, Mapping) or "nodes" not in state_dict:
            raise DopamineValueError(
                f"`state_dict` must be a mapping with a 'nodes' array, got {show(state_dict)}"
            )
        nodes = to_numpy(state_dict["nodes"])
        width = 1 << self._levels
        expected = (2 * width - 1,)
        if nodes.shape != expected:
            raise DopamineValueError(
                f"state_dict['nodes'] must have shape {expected} for capacity={self._capacity}, "
                f"got shape {nodes.shape}"
            )
        leaves = _leaf_values("state_dict['nodes'] leaves", nodes[width - 1 :], np.inf)
        padding = leaves[self._capacity :]
        if padding.any():
            raise ValueError(
                f"state_dict['nodes'] padding leaves (past capacity={self._capacity}) must be "
                f"zero, got {show(padding[padding != 0.0][:_MAX_SHOW])}"
            )
        vals = _leaf_values(
            "state_dict['nodes'] leaves", leaves[: self._capacity], self._tree.max_value
        )
        max_recorded = self._max_recorded
        if "max_recorded_priority" in state_dict:
            raw = to_numpy(state_dict["max_recorded_priority"])
            if raw.shape != ():
                raise ValueError(
                    f"state_dict['max_recorded_priority'] must be a scalar, got shape {raw.shape}"
                )
            max_recorded = check_real(
                "state_dict['max_recorded_priority']", raw.item(), minimum=0.0
            )
        tree = _FastSumTree(self._capacity)
        nonzero = np.flatnonzero(vals)
        tree.set(nonzero, vals[nonzero])
        self._tree = tree
        self._max_recorded = max_recorded

    # -- for the buffer ------------------------------------------------------------
    def _stratified(self, n: int, root: float) -> np.ndarray:
        if n == 0:
            return np.empty(0, dtype=np.int64)
        edges = np.linspace(0.0, 1.0, n + 1)
        q = edges[:-1] + (edges[1:] - edges[:-1]) * self._rng.random(n)
        np.minimum(q, 1.0, out=q)
        return np.asarray(self._tree.find(q * root), dtype=np.int64)

    def _draw(self, n: int, root: float) -> np.ndarray:
        """``n`` independent draws (not stratified)."""
        return np.asarray(self._tree.find(self._rng.random(n) * root), dtype=np.int64)


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
    """Dopamine's prioritized replay buffer, for vector observations (see the module docstring).

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
        p = float(self.sum_tree._checked_values("priority", prio))
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
        """Whether slot ``index`` can be sampled now (see the module docstring). O(1)."""
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
        root = self.sum_tree._nonempty_root()
        if self._add_count < 2:
            raise RuntimeError(
                "cannot sample with fewer than stack_size (1) + update_horizon (1) transitions "
                f"added, got add_count={self._add_count}"
            )
        gen = self.sum_tree.rng
        saved = gen.bit_generator.state
        try:
            idx = self.sum_tree._stratified(n, root)
            bad = np.flatnonzero(~self._valid(idx))
            attempts = self._max_sample_attempts
            while bad.shape[0]:
                if attempts == 0:
                    raise RuntimeError(
                        f"Max sample attempts: tried {self._max_sample_attempts} redraws but "
                        f"only {n - bad.shape[0]} of the {n} sampled indices are valid"
                    )
                k = min(bad.shape[0], attempts)
                idx[bad[:k]] = self.sum_tree._draw(k, root)
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
        batch.append(self.sum_tree._tree.get(idx).astype(np.float32))
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
        return self.sum_tree._tree.get(idx).astype(np.float32)

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
