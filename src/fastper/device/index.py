"""Where a device buffer keeps its priorities: two interchangeable back ends.

* :class:`TorchIndex` (any device; the default off the CPU): raw priorities
  and a :class:`~fastper.device.tree.DeviceSumTree` as tensors, every
  operation a fixed sequence of tensor operations with no host sync.
* :class:`NumbaIndex` (the CPU device only; its default): fastper's compiled
  kernels (:mod:`fastper._kernels.prioritized`) run on numpy views of the
  same memory the tensors use. On a CPU each tensor operation costs a few
  microseconds of dispatch, and a sample + update is a few hundred of them;
  the kernels do it in two calls.

Both draw the same targets from the same uniforms (the buffer's torch
generator) and apply the README's decisions; they differ only in the tree's
fan-out (64 vs 8), so the leaf found for a target differs only for targets
within rounding of a boundary between two leaves.

Contract (the buffer holds its lock around every call; tensors on the device):
    ``fill(lo, count, value)``: new slots ``lo .. lo+count-1`` (no wrap) get priority ``value`` (0-dim).
    ``write(lo, p)``: slots ``lo .. lo+len(p)-1`` (no wrap) get priorities ``p`` (checked by the caller).
    ``draw(u, n, beta, stratified, norm, key_base, added, perm)``: slots, P(i),
    weights (float32) and keys, in the order ``perm`` (if given).
    ``update(idx, td, keys, ...)``: validate, drop stale, last duplicate wins;
    returns (applied, largest applied priority, stale, invalid): 0-dim device
    tensors (torch), host numbers (numba).
    ``set_alpha(alpha, n)``: re-weigh every stored priority. O(N).
"""

from __future__ import annotations

import math

import numpy as np

from .._kernels import prioritized as _pk
from .._kernels import ring as _ring
from .._validation import as_index_array, as_value_array
from ..samplers import ProportionalSampler, UniformSampler
from ._torch import torch
from .tree import DeviceSumTree, max_leaf

NORMS = ("buffer", "batch", "none")
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
            self.tree._fill_run(lo, count, self.leaf(value))

    def write(self, lo: int, p: torch.Tensor) -> None:
        count = p.shape[0]
        self.raw[lo : lo + count] = p
        if self.prioritized:
            self.tree.leaves[lo : lo + count] = self.leaf(p)
            self.tree._fix_range(lo, lo + count - 1)

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
        k = torch.arange(b, dtype=torch.float64, device=self.device) if stratified else None
        if not self.prioritized:
            pos = (k + u) * (n / b) if k is not None else u * n
            idx = pos.to(torch.int64).clamp_(max=n - 1)
            prob = torch.full((b,), 1.0 / n, dtype=torch.float64, device=self.device)
            return idx, prob, torch.ones_like(prob)
        tree = self.tree
        total = tree.total
        idx = tree._find((k + u) * total / b if k is not None else u * total)
        leaf = tree.leaves.index_select(0, idx)
        if norm == "buffer":
            weights = (leaf / tree.min_positive).pow(-beta)
        elif norm == "batch":
            weights = (leaf / leaf.min()).pow(-beta)
        else:
            weights = (n * (leaf / total)).pow(-beta)
        return idx, leaf / total, weights

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
            self.tree._write(safe, self.leaf(new))
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


class NumbaIndex:
    """Priorities and trees of the CPU samplers, shared with CPU tensors (see the module docstring)."""

    def __init__(self, capacity: int, alpha: float, prioritized: bool, track_min: bool,
                 device: torch.device) -> None:  # fmt: skip
        if device.type != "cpu":
            raise ValueError(f"the numba back end runs on the CPU device only, got device={device}")
        self.capacity = capacity
        self.prioritized = prioritized
        self.device = device
        self.sampler: ProportionalSampler | UniformSampler = (
            ProportionalSampler(capacity, alpha, track_min=track_min)
            if prioritized
            else UniformSampler(capacity, alpha)
        )
        self.raw = torch.from_numpy(self.sampler.raw)  # the same memory
        self.max_value = max_leaf(capacity)  # as the torch index: the same limits on both
        self.limit = priority_limit(self.max_value, alpha)
        self._status = np.zeros(4, dtype=np.int64)
        self._scratch = np.empty(1024, dtype=np.int64)
        self._pscratch = np.empty(512, dtype=np.float64)

    @property
    def alpha(self) -> float:
        return self.sampler.alpha

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
            u.numpy(), n, beta, stratified, NORMS.index(norm), key_base, added
        )
        if perm is not None:
            p = perm.numpy()
            idx, prob, w, keys = idx[p], prob[p], w[p], keys[p]
        w32 = w.astype(np.float32)
        return tuple(torch.from_numpy(a) for a in (idx, prob, w32, keys))  # type: ignore[return-value]

    def update(
        self, idx: torch.Tensor, td: torch.Tensor, keys: torch.Tensor | None, eps: float,
        clip: float | None, n: int, key_base: int, added: int, validate: bool, noisy: bool,
    ) -> tuple[int, float, int, int]:  # fmt: skip
        idx_a, td_a = idx.numpy(), td.numpy()
        key_a = keys.numpy() if keys is not None else np.empty(0, dtype=np.int64)
        clip_v = math.inf if clip is None else clip
        invalid = 0
        pmax = self._kernel_update(
            idx_a, td_a, key_a, keys is not None, eps, clip_v, n, key_base, added
        )
        if self._status[0]:
            p = np.minimum(np.abs(td_a), clip_v) + eps
            if validate:
                raise update_error(idx, td, torch.from_numpy(p), keys, n, self.capacity,
                                   self.limit, added, noisy)  # fmt: skip
            with np.errstate(invalid="ignore"):
                ok = (idx_a >= 0) & (idx_a < n) & (p <= self.limit)
                if keys is not None:
                    ok &= (key_a >= 0) & (key_a < added)
            invalid = int((~ok).sum())
            sub_keys = key_a[ok] if keys is not None else key_a
            pmax = self._kernel_update(
                idx_a[ok], td_a[ok], sub_keys, keys is not None, eps, clip_v, n, key_base, added
            )
        st = self._status
        return int(st[2]), pmax, int(st[3]), invalid  # host numbers: the buffer skips no-ops

    def _kernel_update(
        self, idx: np.ndarray, td: np.ndarray, keys: np.ndarray, use_keys: bool, eps: float,
        clip: float, n: int, key_base: int, added: int,
    ) -> float:  # fmt: skip
        s = self.sampler
        b = idx.shape[0]
        if self._scratch.shape[0] < 2 * b:
            self._scratch = np.empty(2 * b, dtype=np.int64)
        if self._pscratch.shape[0] < b:
            self._pscratch = np.empty(b, dtype=np.float64)
        if isinstance(s, ProportionalSampler):
            return float(_pk.prop_update(
                s.raw, s.leaves, s.sinner, s.minner, s.offs, s.depth, idx, td, keys, use_keys,
                eps, clip, s.alpha, self.limit, n, key_base, added, self.capacity,
                self._pscratch, self._scratch, self._status, s.track_min,
            ))  # fmt: skip
        out_idx = self._scratch[:b]
        out_p = self._pscratch[:b]
        pmax = _ring.td_priorities(
            idx, td, keys, use_keys, eps, clip, self.limit, n, key_base, added, self.capacity,
            out_idx, out_p, self._status,
        )  # fmt: skip
        kept = int(self._status[2])
        if self._status[0] == 0 and kept:
            s.write(out_idx[:kept], out_p[:kept])
        return float(pmax)

    def set_alpha(self, alpha: float, n: int) -> None:
        self.limit = priority_limit(self.max_value, alpha)
        self.sampler.set_alpha(alpha, n)

    def load(self, p: np.ndarray, n: int, alpha: float) -> None:
        self.sampler.alpha = float(alpha)
        self.limit = priority_limit(self.max_value, alpha)
        self.sampler.reset_priorities(p, n)

    def clear(self) -> None:
        self.sampler.clear()

    def nbytes(self) -> int:
        seen = 0
        for a in vars(self.sampler).values():
            if isinstance(a, np.ndarray):
                seen += a.nbytes
        return int(seen)
