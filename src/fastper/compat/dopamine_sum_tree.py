"""Dopamine's sum tree on a fastper tree, and the errors shared by the Dopamine adapters.

:class:`SumTree` has the call shapes of both of Dopamine's sum trees (the
NumPy one and the vectorised one of its JAX code) and keeps its leaves in a
:class:`fastper.SumTree`. It is separate from the replay buffer
(:mod:`fastper.compat.dopamine_replay`) because it stands alone: Dopamine's
agents and user code use the tree without the buffer. The buffer reaches the
tree only through its public methods. Users import both from
:mod:`fastper.compat.dopamine`, whose docstring describes what maps to what
and every difference from Dopamine.
"""

from __future__ import annotations

import numbers
import random
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from .._validation import as_index_array, check_int, check_real, show, to_numpy
from ..errors import ZeroPriorityError
from ..trees import SumTree as _FastSumTree

__all__ = [
    "DopamineTypeError",
    "DopamineValueError",
    "DrawSource",
    "RngLike",
    "SumTree",
]

#: What ``rng=`` takes: a numpy Generator, an int seed, ``None`` (fresh OS
#: entropy), Python's ``random`` module or a ``random.Random`` instance.
RngLike = np.random.Generator | random.Random | ModuleType | int | None
#: Where the draws come from: a numpy Generator, or Python's ``random``
#: (the module itself, whose global state Dopamine's NumPy tree uses, or an instance).
DrawSource = np.random.Generator | random.Random | ModuleType

_MAX_SHOW = 8


class DopamineValueError(ValueError, AssertionError):
    """A bad argument that Dopamine's NumPy tree rejects with ``ValueError`` and its JAX twin with ``assert``.

    Catching either ``ValueError`` or ``AssertionError`` catches it.
    """


class DopamineTypeError(TypeError, AssertionError):
    """An argument of the wrong type where Dopamine fails an ``assert``.

    Catching either ``TypeError`` or ``AssertionError`` catches it.
    """


def _make_rng(rng: Any) -> DrawSource:
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, np.random.Generator | random.Random) or rng is random:
        return rng
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool) and int(rng) >= 0:
        return np.random.default_rng(int(rng))
    raise TypeError(
        "`rng` must be a numpy Generator, a non-negative int seed, None, Python's `random` "
        f"module or a random.Random instance, got rng={show(rng)}"
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
    sampling picks leaf ``i`` with probability ``value_i / root``. See
    :mod:`fastper.compat.dopamine` for every difference from Dopamine.

    Args:
        capacity: number of leaves, an integer >= 1.
        rng: where ``sample`` / ``stratified_sample`` draw from: a
            :class:`numpy.random.Generator` (used as is), an int seed, or
            ``None`` for fresh OS entropy; or Python's ``random`` module
            (Dopamine's source: ``random.seed(s)`` then gives the indices
            Dopamine's NumPy tree gives on the same values) or a
            :class:`random.Random` instance, drawn from as Dopamine draws.

    Raises:
        DopamineTypeError: ``capacity`` is not an integer.
        DopamineValueError: ``capacity`` is not positive.
        TypeError: ``rng`` is none of the above.
    """

    _capacity: int
    _rng: DrawSource
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
    def rng(self) -> DrawSource:
        """What ``sample`` and ``stratified_sample`` draw from (the ``rng`` given, or its Generator)."""
        return self._rng

    def uniforms(self, n: int) -> np.ndarray:
        """``n`` uniform draws in ``[0, 1)`` from :attr:`rng`, as float64. O(n).

        From Python's ``random``, one ``random()`` call per draw, in order
        (the calls Dopamine makes); from a numpy Generator, one ``random(n)``.

        Raises:
            TypeError, ValueError: ``n`` is not an integer >= 0.
        """
        n = check_int("n", n, minimum=0)
        src = self._rng
        if isinstance(src, np.random.Generator):
            return src.random(n)
        return np.fromiter((src.random() for _ in range(n)), dtype=np.float64, count=n)

    def rng_state(self) -> Any:
        """A snapshot of :attr:`rng`'s state, for :meth:`set_rng_state`. O(1) (Python's: O(625))."""
        src = self._rng
        if isinstance(src, np.random.Generator):
            return src.bit_generator.state
        return src.getstate()

    def set_rng_state(self, state: Any) -> None:
        """Put :attr:`rng` back to a state from :meth:`rng_state` (undoes draws)."""
        src = self._rng
        if isinstance(src, np.random.Generator):
            src.bit_generator.state = state
        else:
            src.setstate(state)

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

    def checked_values(self, name: str, values: Any) -> np.ndarray:
        """Float64 copy of ``values`` (any shape), checked as :meth:`set` checks leaf values. O(B).

        Args:
            name: the argument's name, for the error messages.
            values: numbers (a scalar or an array of any shape).

        Raises:
            DopamineValueError: a negative value.
            ValueError: a value not finite or above ``fastper.SumTree.max_value``.
            TypeError: values that are not real numbers.
        """
        return _leaf_values(name, to_numpy(values), self._tree.max_value)

    def nonempty_root(self) -> float:
        """:attr:`root`, checked to be positive (so that the tree can be sampled). O(1).

        Raises:
            ZeroPriorityError: the tree is empty (every value is zero).
        """
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
        vals = self.checked_values("values", val_arr).reshape(-1)
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
        root = self.nonempty_root()
        if query_value is None:
            q = float(self.uniforms(1)[0])
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
        return self.stratified_indices(batch_size).tolist()

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

    # -- vectorised draws -----------------------------------------------------------
    def stratified_indices(self, batch_size: int) -> np.ndarray:
        """:meth:`stratified_sample` as an int64 array (no list of ints). O(B log N).

        Raises:
            ZeroPriorityError: the tree is empty (every value is zero).
            TypeError, ValueError: ``batch_size`` is not an integer >= 0.
        """
        root = self.nonempty_root()
        n = check_int("batch_size", batch_size, minimum=0)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        # Dopamine's arithmetic: random.uniform(lo, hi) is lo + (hi - lo) * random()
        edges = np.linspace(0.0, 1.0, n + 1)
        q = edges[:-1] + (edges[1:] - edges[:-1]) * self.uniforms(n)
        np.minimum(q, 1.0, out=q)
        return np.asarray(self._tree.find(q * root), dtype=np.int64)

    def sample_indices(self, batch_size: int) -> np.ndarray:
        """``batch_size`` independent draws, as :meth:`sample` makes one: an int64 array. O(B log N).

        Not stratified: each leaf is drawn with probability ``value_i / root``
        from a uniform of its own (with :attr:`rng`).

        Raises:
            ZeroPriorityError: the tree is empty (every value is zero).
            TypeError, ValueError: ``batch_size`` is not an integer >= 0.
        """
        root = self.nonempty_root()
        n = check_int("batch_size", batch_size, minimum=0)
        return np.asarray(self._tree.find(self.uniforms(n) * root), dtype=np.int64)
