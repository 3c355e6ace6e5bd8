"""Dopamine's replay API on fastper's trees: a drop-in for code written against Dopamine.

Two classes, each with the call shape of its Dopamine counterpart (module
paths relative to ``dopamine``):

* ``replay_memory.sum_tree.SumTree`` and ``jax.replay_memory.sum_tree.SumTree``
  -> :class:`SumTree` (one class with both APIs);
* ``replay_memory.prioritized_replay_buffer.OutOfGraphPrioritizedReplayBuffer``
  -> :class:`OutOfGraphPrioritizedReplayBuffer` (stacked frames and n-step
  returns included; not the TensorFlow wrapper);
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
``is_valid_transition``, ``get_observation_stack``, ``get_terminal_stack``,
``is_empty``, ``is_full``, ``cursor``, ``add_count``, ``invalid_range``,
``episode_end_indices``, ``save`` and ``load``, with Dopamine's semantics:

* **Slots.** Each ``add`` writes one observation (one frame) at slot
  ``add_count % replay_capacity``; the first ``add`` of an episode first
  writes ``stack_size - 1`` zero slots (zero observation, action, reward,
  terminal and extras, priority 0), so a state is always the frames of the
  ``stack_size`` slots ending at its index. Memory is one observation per
  slot whatever ``stack_size`` is: 84x84 Atari frames with ``stack_size=4``
  take 7 KB a slot, not 28.
* **Validity** (``is_valid_transition``): a slot is sampled only when it is
  written with its ``update_horizon`` successors (and, before the ring is
  full, is at least ``stack_size - 1``), is not in ``invalid_range``
  (``cursor - update_horizon .. cursor + stack_size - 1``), has no terminal
  among the ``stack_size - 1`` slots before it (its stack would reach into
  the previous episode) and no episode cut short (``episode_end`` without
  ``terminal``) among its ``update_horizon`` slots.
* **Batches.** ``sample_transition_batch`` returns Dopamine's tuple, in
  Dopamine's order: ``state, action, reward, next_state, next_action,
  next_reward, terminal, indices``, then one array per extra storage element,
  then ``sampling_probabilities``. States are ``(batch, *observation_shape,
  stack_size)``, oldest frame first. For index ``i`` the n-step window is
  slots ``i .. i + update_horizon - 1``, cut after its first terminal (length
  ``L``): ``reward`` is ``sum_j gamma**j reward[i + j]`` over it (float32
  discounts, summed in order), ``terminal`` says whether it holds a terminal,
  and ``next_state``, ``next_action``, ``next_reward`` are those of slot
  ``i + L``. ``indices`` is int32 and ``sampling_probabilities`` holds the raw
  priorities (float32), which is what Dopamine puts under that name; divide
  by ``sum_tree.root`` for probabilities.
* **Priorities** are used as given (no exponent, no epsilon):
  ``P(i) = p_i / sum_j p_j`` over the valid transitions, exactly as in
  Dopamine, where the agent applies the exponent before ``set_priority``.
  ``set_priority`` and ``get_priority`` take int32 index arrays, as in
  Dopamine (the batch's ``indices`` are int32).

The buffer is tested against a reference that restates Dopamine's NumPy
code step by step, on random episodes that wrap the ring.

Randomness
----------

Dopamine's NumPy tree draws from Python's global ``random`` module. Here each
tree draws from the source given as ``rng=``:

* a :class:`numpy.random.Generator` (used as is and shared), an int seed, or
  ``None`` (the default: fresh OS entropy). The draws differ from
  Dopamine's; ``random`` and ``numpy.random``'s global state are untouched.
* Python's ``random`` module itself (``rng=random``), Dopamine's source: the
  tree then makes Dopamine's calls in Dopamine's order (one ``random()`` per
  draw; ``random.uniform(lo, hi)`` per slice in ``stratified_sample``), so
  after ``random.seed(s)`` it returns the indices Dopamine's tree returns on
  the same values, and the buffer's ``sample_index_batch`` the indices
  Dopamine's buffer returns, redraws of invalid indices included. A
  :class:`random.Random` instance works the same way with its own state.

The buffer passes its ``rng=`` to its tree and draws only from it. A call
that raises leaves the source where it was (Python's ``random`` included).

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
  shape). The buffer's ``set_priority`` / ``get_priority`` refuse indices
  that are not an int32 array with :class:`DopamineTypeError` (Dopamine
  asserts), and a scalar with :class:`DopamineValueError`.
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

* ``gamma`` must lie in ``[0, 1]``. Rewards of ``reward_shape`` other than
  ``()`` are discounted along the window (Dopamine multiplies the discount
  vector into the reward's last axis, which fails or mixes dimensions when
  ``update_horizon > 1``). The n-step sum is made in order, which is numpy's
  order for ``update_horizon`` below 8; above, the last bits can differ.
* A stacked observation given to ``add`` (shape ``(*observation_shape,
  stack_size)``) is refused with a message that says one frame is expected.
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
  indices are made one at a time, in batch order, from the whole tree (not
  stratified), as in Dopamine. An empty buffer raises
  :class:`fastper.EmptyBufferError`, one with fewer than ``stack_size +
  update_horizon`` slots written ``RuntimeError`` at once (no valid
  transition exists).
* ``sample_transition_batch(indices=...)`` checks the indices: each must be a
  valid transition (Dopamine reads whatever is there). With ``indices`` and no
  ``batch_size``, the batch size is ``len(indices)``. ``get_observation_stack``
  refuses a slot not written yet (Dopamine reads uninitialised memory).
* ``add_count`` is a read-only ``int`` (Dopamine: a 0-d numpy array);
  ``invalid_range`` and ``episode_end_indices`` are computed on access.
* ``save(checkpoint_dir, iteration_number)`` / ``load(checkpoint_dir,
  suffix)`` keep Dopamine's call shape but write one fastper checkpoint file
  (pickle-free, checksummed, atomic: ``fastper_replay_ckpt.<n>.fpk``) instead
  of Dopamine's gzip files with pickled attributes, which they neither write
  nor read; ``save`` into a missing directory raises ``FileNotFoundError``
  (Dopamine skips the save). ``state_dict`` / ``load_state_dict`` do the same
  in memory. The in-graph ``WrappedPrioritizedReplayBuffer`` and the
  TensorFlow ops are not provided.
* Not thread-safe (neither is Dopamine's): share one object between threads
  only behind a lock.

Costs (N = capacity, B = batch size, d = values per transition)
--------------------------------------------------------------

* :class:`SumTree`: ``set`` O(B log N), ``get`` O(B), ``query`` and
  ``stratified_sample`` O(B log N), ``sample`` O(log N), ``root`` and
  ``max_recorded_priority`` O(1); ``clear``, ``nodes``, ``to_state_dict`` O(N);
  ``from_state_dict`` O(N log N) at worst. Logarithms are base 8.
* Buffer (K = stack_size, n = update_horizon): ``add`` O(K (log N + d));
  ``sample_index_batch`` O(B (log N + K + n)) plus O(log N + K + n) per
  redraw; ``sample_transition_batch`` O(B (log N + K d + n)); ``set_priority``
  O(B log N); ``get_priority`` O(B); ``save`` / ``load`` O(N d). With
  ``rng=random``, each draw is one Python call (as in Dopamine).
"""

from __future__ import annotations

from .dopamine_elements import ReplayElement
from .dopamine_replay import OutOfGraphPrioritizedReplayBuffer
from .dopamine_sum_tree import DopamineTypeError, DopamineValueError, SumTree
from .dopamine_sum_tree import RngLike as RngLike  # the ``rng=`` argument's type

__all__ = [
    "DopamineTypeError",
    "DopamineValueError",
    "OutOfGraphPrioritizedReplayBuffer",
    "ReplayElement",
    "SumTree",
]
