"""Where a device buffer keeps its priorities: two interchangeable back ends.

* :class:`TorchIndex` (any device; the default off the CPU): raw priorities
  and a :class:`~fastper.device.tree.DeviceSumTree` as tensors, every
  operation a fixed sequence of tensor operations with no host sync.
* :class:`NumbaIndex` (the CPU device only; its default): the CPU buffers'
  samplers (:mod:`fastper.samplers`, compiled kernels) run on numpy views of
  the same memory the tensors use. On a CPU each tensor operation costs a few
  microseconds of dispatch, and a sample + update is a few hundred of them;
  the kernels do it in two calls.

Both draw the same targets from the same uniforms (the buffer's torch
generator) and apply the decisions of ``docs/concepts.md``, with the rules every front end
shares (:mod:`fastper.policy`: stratified targets, P(i), IS weights). They
differ in the tree's fan-out (64 vs 8), so the leaf found for a target
differs only for targets within rounding of a boundary between two leaves,
and in ``pow``: the numba back end computes ``p ** alpha`` and the weights
with the C library's ``pow``, as the CPU buffers do (the same bits), while
torch's vectorised ``pow`` on a CPU may differ from it in the last bit.

Contract (the buffer holds its lock around every call; tensors on the device):
    ``fill(lo, count, value)``: new slots ``lo .. lo+count-1`` (no wrap) get priority ``value`` (0-dim).
    ``write(lo, p)``: slots ``lo .. lo+len(p)-1`` (no wrap) get priorities ``p`` (checked by the caller).
    ``draw(u, n, beta, stratified, norm, key_base, added, perm)``: slots, P(i),
    weights (float32) and keys, in the order ``perm`` (if given).
    ``probabilities(idx, n)``: P(i) of one draw for written slots ``idx``.
    ``update(idx, td, keys, ...)``: validate, drop stale, last duplicate wins;
    returns (applied, largest applied priority, stale, invalid): 0-dim device
    tensors (torch), host numbers (numba).
    ``set_alpha(alpha, n)``: re-weigh every stored priority. O(N).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import policy
from .._validation import as_index_array, as_value_array
from ..policy import NORM_CODES, NORMS
from ..samplers import ProportionalSampler, UniformSampler
from ._torch import torch
from .tree import DeviceSumTree, max_leaf

__all__ = ["NORMS", "NumbaIndex", "TorchIndex", "exact_pow", "priority_limit", "slot_keys"]
#: elements per call of :func:`exact_pow` on the CPU: at most ATen's grain size
#: (32768), so one thread runs it, and a multiple of every SIMD width
_POW_BLOCK = 1 << 15


def exact_pow(p: torch.Tensor, alpha: float) -> torch.Tensor:
    """``p ** alpha`` elementwise, each element's bits independent of its
    position and of the tensor's length.

    On the CPU, torch computes whole SIMD vectors with its vectorised ``pow``
    and the elements left over at the end of a run (of the tensor, or of a
    thread's share) with the scalar one, which can differ in the last bit: a
    priority's mass would then depend on the batch it was written in, and a
    buffer rebuilt from a checkpoint would not sample the exact probabilities
    of the original. Here every element goes through the vector path: the
    input is padded to a multiple of 64 and cut into single-thread blocks.
    Other devices compute every element alike already. O(len(p)).
    """
    if p.device.type != "cpu":
        return p.pow(alpha)
    n = p.numel()
    padded = torch.ones(-(-n // 64) * 64, dtype=p.dtype)
    padded[:n] = p.reshape(-1)
    for lo in range(0, padded.shape[0], _POW_BLOCK):
        padded[lo : lo + _POW_BLOCK].pow_(alpha)
    return padded[:n].reshape(p.shape)


def priority_limit(max_value: float, alpha: float) -> float:
    """Largest priority p whose p ** alpha the tree can hold, for this and any smaller alpha <= 1."""
    return math.exp(math.log(max_value) / max(alpha, 1.0))


def update_error(
    idx: torch.Tensor, td: torch.Tensor, p: torch.Tensor, keys: torch.Tensor | None,
    n: int, capacity: int, limit: float, added: int, noisy: bool,
) -> Exception:  # fmt: skip
    """The exception for an update with a bad entry (reads the device: syncs).

    Indices and td errors go through the CPU buffers' own validators, so both
    raise the same errors with the same messages.
    """
    try:
        as_index_array("indices", idx.cpu().numpy(), capacity, written=n)
        if not noisy:  # noise is applied first: a non-finite td shows as a bad priority
            as_value_array("td_errors", td.cpu().numpy(), idx.shape[0], nonnegative=False)
    except ValueError as exc:  # InvalidIndexError is a ValueError too
        return exc
    big = ~torch.isfinite(p) | (p > limit)
    if bool(big.any()):
        if noisy:
            return ValueError(
                "`priority_noise` made a priority non-finite or too large for the sum tree "
                "(or a td error is not finite); use a smaller sigma"
            )
        return ValueError(
            f"`td_errors` must give priorities <= {limit:.3e} (so the sum tree stays finite), "
            f"got td_errors={td[big][:8].tolist()}"
        )
    if keys is not None:
        bad = (keys < 0) | (keys >= added)
        if bool(bad.any()):
            return ValueError(
                f"`keys` must be keys issued by this buffer, in [0, {added}), "
                f"got {keys[bad][:8].tolist()}"
            )
    return ValueError("invalid priority update")  # pragma: no cover - every case is above


class TorchIndex:
    """Priorities and trees as tensors on ``device``; sync-free (see the module docstring)."""

    def __init__(self, capacity: int, alpha: float, prioritized: bool, track_min: bool,
                 device: torch.device) -> None:  # fmt: skip
        self.capacity = capacity
        self.alpha = float(alpha)
        self.prioritized = prioritized
        self.device = device
        self.raw = torch.zeros(capacity, dtype=torch.float64, device=device)
        # a uniform buffer keeps priorities only; the tree's scratch serves last_wins
        self.tree = DeviceSumTree(capacity, device=device, track_min=track_min and prioritized)
        self.max_value = max_leaf(capacity)
        self.limit = priority_limit(self.max_value, self.alpha)

    def leaf(self, p: torch.Tensor) -> torch.Tensor:
        """``p ** alpha``, 0 for p = 0 (0 ** 0 would be 1): the same bits for a
        priority whatever the batch it comes in (see :func:`exact_pow`)."""
        return torch.where(p > 0, exact_pow(p, self.alpha), 0.0)

    @property
    def total(self) -> torch.Tensor:
        return self.tree.total

    def fill(self, lo: int, count: int, value: torch.Tensor) -> None:
        self.raw[lo : lo + count].copy_(value.expand(count))
        if self.prioritized:
            self.tree.fill_run(lo, count, self.leaf(value))

    def write(self, lo: int, p: torch.Tensor) -> None:
        count = p.shape[0]
        self.raw[lo : lo + count] = p
        if self.prioritized:
            self.tree.leaves[lo : lo + count] = self.leaf(p)
            self.tree.fix_range(lo, lo + count - 1)

    def draw(
        self, u: torch.Tensor, n: int, beta: float, stratified: bool, norm: str,
        key_base: int, added: int, perm: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        idx, prob, weights = self._draw(u, n, beta, stratified, norm)
        if perm is not None:
            idx, prob, weights = idx[perm], prob[perm], weights[perm]
        return idx, prob, weights.to(torch.float32), slot_keys(idx, key_base, added, self.capacity)

    def _draw(
        self, u: torch.Tensor, n: int, beta: float, stratified: bool, norm: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = u.shape[0]
        f64, dev = torch.float64, self.device
        positions = torch.arange(b, dtype=f64, device=dev) if stratified else None
        if not self.prioritized:
            # unit mass per slot: the total mass is n, a point's slot its integer part
            pos = policy.stratified_targets(u, float(n), positions)
            idx = pos.to(torch.int64).clamp_(max=n - 1)
            prob = policy.probabilities(torch.ones(b, dtype=f64, device=dev), float(n))
            return idx, prob, torch.ones_like(prob)  # uniform: every weight is 1
        tree = self.tree
        total: Any = tree.total  # a 0-dim tensor: the rules' arithmetic keeps it on the device
        idx = tree.find_unchecked(policy.stratified_targets(u, total, positions))
        leaf = tree.leaves.index_select(0, idx)
        min_mass: Any = tree.min_positive if norm == "buffer" else total  # read for "buffer" only
        weights = policy.is_weights(leaf, total, min_mass, n, beta, norm)
        return idx, policy.probabilities(leaf, total), weights

    def probabilities(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        """P(i) of one draw for written slots ``idx`` (unchecked). O(B), no sync."""
        if not self.prioritized:
            ones = torch.ones(idx.shape[0], dtype=torch.float64, device=self.device)
            return policy.probabilities(ones, float(n))
        total: Any = self.tree.total
        return policy.probabilities(self.tree.leaves.index_select(0, idx), total)

    def update(
        self, idx: torch.Tensor, td: torch.Tensor, keys: torch.Tensor | None, eps: float,
        clip: float | None, n: int, key_base: int, added: int, validate: bool, noisy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        mag = td.abs()
        if clip is not None:
            mag = mag.clamp(max=clip)
        p = mag + eps
        inside = (idx >= 0) & (idx < n)
        safe = torch.where(inside, idx, 0)
        ok = inside & (p <= self.limit)  # NaN compares false
        if keys is not None:
            ok = ok & (keys >= 0) & (keys < added)
        bad = ~ok
        if validate and bool(bad.any()):  # the one sync of a validated update
            raise update_error(idx, td, p, keys, n, self.capacity, self.limit, added, noisy)
        keep = ok
        stale = torch.zeros((), dtype=torch.int64, device=self.device)
        if keys is not None:
            fresh = keys == slot_keys(safe, key_base, added, self.capacity)
            stale = (ok & ~fresh).sum()
            keep = ok & fresh
        win = self.tree.last_wins(safe, keep)
        # every entry of a slot writes its winner's value (or the old one): duplicates agree
        new = torch.where(win >= 0, p.index_select(0, win.clamp(min=0)),
                          self.raw.index_select(0, safe))  # fmt: skip
        self.raw.index_put_((safe,), new)
        if self.prioritized:
            self.tree.write_unchecked(safe, self.leaf(new))
        pmax = torch.where(keep, p, 0.0).max()
        return keep.sum(), pmax, stale, bad.sum()

    def set_alpha(self, alpha: float, n: int) -> None:
        self.alpha = float(alpha)
        self.limit = priority_limit(self.max_value, self.alpha)
        if self.prioritized:
            self.tree.leaves[:n] = self.leaf(self.raw[:n])
            self.tree.rebuild()

    def load(self, p: np.ndarray, n: int, alpha: float) -> None:
        self.raw.zero_()
        self.raw[:n] = torch.from_numpy(p.copy()).to(self.device)
        self.tree.clear()
        self.set_alpha(alpha, n)

    def clear(self) -> None:
        self.raw.zero_()
        self.tree.clear()

    def nbytes(self) -> int:
        return int(self.raw.numel() * 8 + self.tree.nbytes)


def slot_keys(idx: torch.Tensor, key_base: int, added: int, capacity: int) -> torch.Tensor:
    """Key of each slot's occupant (see :mod:`fastper.writer`), as tensor arithmetic."""
    since = added - key_base
    return key_base + idx + capacity * torch.div(since - 1 - idx, capacity, rounding_mode="floor")


class _DeviceLimit:
    """Mixin: the device tree's priority limit, so both back ends refuse the same priorities.

    The CPU samplers bound ``p ** alpha`` by their own tree's size; the device
    index bounds ``p`` by :func:`priority_limit` of the device tree (whatever
    alpha <= 1 is set later: changing it never needs a check on the device).
    """

    alpha: float
    max_value: float = math.inf

    def priority_limit(self, alpha: float | None = None) -> float:
        return priority_limit(self.max_value, self.alpha if alpha is None else alpha)


class _Proportional(_DeviceLimit, ProportionalSampler):
    pass


class _Uniform(_DeviceLimit, UniformSampler):
    pass


class NumbaIndex:
    """Priorities and trees of the CPU samplers, shared with CPU tensors (see the module docstring).

    Every operation goes through the samplers' public methods (the same
    compiled kernels as the CPU buffers); tensors and numpy arrays share memory.
    """

    def __init__(self, capacity: int, alpha: float, prioritized: bool, track_min: bool,
                 device: torch.device) -> None:  # fmt: skip
        if device.type != "cpu":
            raise ValueError(f"the numba back end runs on the CPU device only, got device={device}")
        self.capacity = capacity
        self.prioritized = prioritized
        self.device = device
        self.max_value = max_leaf(capacity)  # as the torch index: the same limits on both
        sampler: _Proportional | _Uniform = (
            _Proportional(capacity, alpha, track_min=track_min)
            if prioritized
            else _Uniform(capacity, alpha)
        )
        sampler.max_value = self.max_value
        self.sampler = sampler
        self.raw = torch.from_numpy(sampler.raw)  # the same memory
        self._status = np.zeros(4, dtype=np.int64)

    @property
    def alpha(self) -> float:
        return self.sampler.alpha

    @property
    def limit(self) -> float:
        """Largest priority an update may write under the alpha in force."""
        return self.sampler.priority_limit()

    @property
    def total(self) -> torch.Tensor:
        s = self.sampler
        value = s.total if isinstance(s, ProportionalSampler) else 1.0
        return torch.tensor(value, dtype=torch.float64)

    def fill(self, lo: int, count: int, value: torch.Tensor) -> None:
        self.sampler.write_run(lo, count, float(value))

    def write(self, lo: int, p: torch.Tensor) -> None:
        slots = np.arange(lo, lo + p.shape[0], dtype=np.int64)
        self.sampler.write(slots, p.numpy(), new=True)

    def draw(
        self, u: torch.Tensor, n: int, beta: float, stratified: bool, norm: str,
        key_base: int, added: int, perm: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        idx, prob, w, keys = self.sampler.sample(
            u.numpy(), n, beta, stratified, NORM_CODES[norm], key_base, added
        )
        if perm is not None:
            p = perm.numpy()
            idx, prob, w, keys = idx[p], prob[p], w[p], keys[p]
        w32 = w.astype(np.float32)
        return tuple(torch.from_numpy(a) for a in (idx, prob, w32, keys))  # type: ignore[return-value]

    def probabilities(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        """P(i) of one draw for written slots ``idx`` (unchecked). O(B)."""
        return torch.from_numpy(self.sampler.probabilities(idx.numpy(), n))

    def update(
        self, idx: torch.Tensor, td: torch.Tensor, keys: torch.Tensor | None, eps: float,
        clip: float | None, n: int, key_base: int, added: int, validate: bool, noisy: bool,
    ) -> tuple[int, float, int, int]:  # fmt: skip
        idx_a, td_a = idx.numpy(), td.numpy()
        key_a = keys.numpy() if keys is not None else np.empty(0, dtype=np.int64)
        clip_v = math.inf if clip is None else clip
        invalid = 0
        pmax = self._update(idx_a, td_a, key_a, keys is not None, eps, clip_v, n, key_base, added)
        if self._status[0]:
            limit = self.limit
            p = np.minimum(np.abs(td_a), clip_v) + eps
            if validate:
                raise update_error(idx, td, torch.from_numpy(p), keys, n, self.capacity,
                                   limit, added, noisy)  # fmt: skip
            with np.errstate(invalid="ignore"):
                ok = (idx_a >= 0) & (idx_a < n) & (p <= limit)
                if keys is not None:
                    ok &= (key_a >= 0) & (key_a < added)
            invalid = int((~ok).sum())
            sub_keys = key_a[ok] if keys is not None else key_a
            pmax = self._update(
                idx_a[ok], td_a[ok], sub_keys, keys is not None, eps, clip_v, n, key_base, added
            )
        st = self._status
        return int(st[2]), pmax, int(st[3]), invalid  # host numbers: the buffer skips no-ops

    def _update(
        self, idx: np.ndarray, td: np.ndarray, keys: np.ndarray, use_keys: bool, eps: float,
        clip: float, n: int, key_base: int, added: int,
    ) -> float:  # fmt: skip
        return self.sampler.update_from_td(
            idx, td, keys, use_keys, eps, clip, n, key_base, added, self._status
        )

    def set_alpha(self, alpha: float, n: int) -> None:
        self.sampler.set_alpha(alpha, n)

    def load(self, p: np.ndarray, n: int, alpha: float) -> None:
        self.sampler.load_state_dict({"alpha": float(alpha), "priorities": p}, n)

    def clear(self) -> None:
        self.sampler.clear()

    def nbytes(self) -> int:
        s = self.sampler
        tree = s.tree.nbytes if isinstance(s, ProportionalSampler) else 0
        return int(s.raw_leaves.nbytes + tree)
