"""Where a device buffer keeps its priorities: two interchangeable back ends.

* :class:`TorchIndex` (any device; the default off the CPU): priorities,
  masses, keys and a :class:`~fastper.device.tree.DeviceSumTree` as tensors.
  ``draw`` and ``update`` are each a fixed sequence of tensor operations
  whatever the capacity (about 18 and 20 at the defaults, see
  ``docs/guides/gpu.md``), with no host sync: on a GPU every operation is a
  kernel launch, so a learner step costs a few dozen launches at any size.
* :class:`NumbaIndex` (the CPU device only; its default): the CPU buffers'
  samplers (:mod:`fastper.samplers`, compiled kernels) run on numpy views of
  the same memory the tensors use. On a CPU each tensor operation costs a few
  microseconds of dispatch; the kernels do a step in two calls.

Both draw the same targets from the same uniforms (the buffer's torch
generator) and apply the decisions of ``docs/concepts.md``, with the rules every front end
shares (:mod:`fastper.policy`: stratified targets, P(i), IS weights). They
differ in how the tree adds up (blocks of 64 vs an 8-ary tree), so the leaf
found for a target differs only for targets within rounding of a boundary
between two leaves, and in ``pow``: the numba back end computes
``p ** alpha`` and the weights with the C library's ``pow``, as the CPU
buffers do (the same bits), while torch's vectorised ``pow`` on a CPU may
differ from it in the last bit.

Contract (the buffer holds its lock around every call; tensors on the device):
    ``ensure(n)``: slots ``0 .. n-1`` may be written (lazily initialised storage).
    ``set_sizes(n, added)``: the stored count and the key counter after a change.
    ``fill(lo, count, value, key0)``: new slots ``lo .. lo+count-1`` (no wrap) get
    priority ``value`` (0-dim) and keys ``key0, key0 + 1, ...``.
    ``write(lo, p, key0)``: slots ``lo .. lo+len(p)-1`` (no wrap) get priorities ``p``
    (checked by the caller) and keys from ``key0``.
    ``draw(u, n, beta, stratified, norm, key_base, added, perm)``: slots, P(i),
    weights (float32) and keys, in the order ``perm`` (if given).
    ``probabilities(idx, n)``: P(i) of one draw for written slots ``idx``.
    ``update(idx, td, keys, ...)``: validate, drop stale, last duplicate wins;
    returns (applied, counts): ``counts`` are device tallies (torch, see
    :data:`TALLIES`) or host numbers (stale, invalid) (numba).
    ``set_alpha(alpha, n)``: re-weigh every stored priority. O(N).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from .. import policy
from .._validation import as_index_array, as_value_array
from ..policy import NORM_CODES, NORMS
from ..samplers import ProportionalSampler, UniformSampler
from ._torch import torch
from .tree import DeviceSumTree, K, max_leaf, num_blocks

__all__ = [
    "KEY_LIMIT", "NORMS", "TALLIES", "NumbaIndex", "TorchIndex", "exact_pow", "key_top",
    "priority_limit", "slot_keys",
]  # fmt: skip
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


#: rows of :attr:`TorchIndex.table`: raw priority and mass (float64 bits), key, slot
RAW, MASS, KEY, SLOT = range(4)
#: what the tallies of :meth:`TorchIndex.update` count, in order: entries with a key
#: issued by the buffer, an index of a written slot, a usable priority, a fresh key,
#: all three checks passed (``ok``), and applied (``ok`` and fresh)
TALLIES = ("key_issued", "slot_written", "priority_ok", "fresh", "ok", "applied")
#: smallest mass the fused paths count as positive (margin under the float64 range)
MASS_FLOOR = 1e-300


def finish_weights(base: torch.Tensor | None, beta: float, like: torch.Tensor) -> torch.Tensor:
    """IS weights from their base (:func:`fastper.policy.weights_from_base`) as float32
    (``base`` None: ones shaped as ``like``). 2 ops."""
    if base is None:
        return torch.ones_like(like, dtype=torch.float32)
    return policy.weights_from_base(base, beta).to(torch.float32)


#: the largest float64: times 255 it overflows to inf, times 0 it is 0
HUGE = float(np.finfo(np.float64).max)
#: the largest key counter a :class:`TorchIndex` takes from a saved state: keys stay
#: below 2^56 (:func:`key_top` 0) for 2^55 more adds, about 10^9 years at 10^6 a second
KEY_LIMIT = 2**55


def key_top(keys: torch.Tensor) -> torch.Tensor:
    """The most significant byte of each key (int64, last dimension contiguous), as a
    uint8 view: 255 for the key -1 of an empty slot, 0 for any key issued (below
    2^56). ``x + HUGE * key_top(k)`` is then ``x`` for a written slot and ``inf`` for
    an empty one, in one operation (no boolean mask, no ``where``). No operation."""
    return keys.view(torch.uint8).view(*keys.shape, 8)[..., _TOP_BYTE]


#: where an int64's most significant byte lies among its 8
_TOP_BYTE = 7 if sys.byteorder == "little" else 0


def pow2(n: int) -> bool:
    """Whether ``n`` is a power of two (then ``x / n`` is exact)."""
    return n > 0 and n & (n - 1) == 0


@dataclass
class _UpdateScratch:
    """Per batch size: the fixed buffers one :meth:`TorchIndex.update` writes into."""

    ints: torch.Tensor  # (3, B + 1) int64: clamped keys, clamped slots, priority bits
    flags: torch.Tensor  # (6, B + 1) bool: TALLIES; flags[5, B] stays False
    chosen: torch.Tensor  # (2, B + 1) int64: target slot, priority (or max) bits
    values: torch.Tensor  # (2, B rounded up to 64) float64: raw priority, mass
    summary: torch.Tensor  # (B, 65) float64: running sums of a block, then its min
    positions: torch.Tensor  # (B,) int32: 0 .. B-1


class TorchIndex:
    """Priorities, masses, keys and the block tree as tensors on ``device``; sync-free.

    Layout (``S = (capacity / 64 + 1) * 64`` slots, the last 64 a spare block):

    * :attr:`table`, int64 (4, S): rows ``RAW`` and ``MASS`` hold the raw
      priority ``p`` and ``p ** alpha`` (float64, viewed as int64), ``KEY`` the
      key of each slot's occupant, ``SLOT`` the slot's own index. One gather
      of a column gives all four: a draw reads its slot, mass and key at once.
    * :attr:`scratch`, int32 (2, S): a per-slot scratch for "last duplicate
      wins" (row 0) and each slot's block (row 1).
    * :attr:`tree`: the block summaries, over the ``MASS`` row.

    Both are allocated uninitialised and a block is initialised when the
    buffer first reaches it (:meth:`ensure`): on a CPU a large buffer commits
    memory as it fills. Nothing ever reads a slot past the ones written.
    40 bytes per slot in all.
    """

    def __init__(self, capacity: int, alpha: float, prioritized: bool, track_min: bool,
                 device: torch.device) -> None:  # fmt: skip
        self.capacity = capacity
        self.alpha = float(alpha)
        self.prioritized = prioritized
        self.device = device
        nb = num_blocks(capacity)
        size = (nb + 1) * K
        self.table = torch.empty(4, size, dtype=torch.int64, device=device)
        self.values = self.table.view(torch.float64)  # rows RAW and MASS as float64
        self.scratch = torch.empty(2, size, dtype=torch.int32, device=device)
        self.tree = DeviceSumTree(capacity, device=device, track_min=True, leaves=self.values[MASS])
        self.spare = self.tree.spare
        self._ready = 0  # blocks initialised
        self._init_blocks(nb, nb + 1)  # the spare block
        self.max_value = max_leaf(capacity)
        self.limit = priority_limit(self.max_value, self.alpha)
        #: True when every stored mass is known positive (the buffer decides): the fused
        #: paths then skip the zero-leaf guards
        self.positive = False
        # the "else" of the update's select: entries not applied go to the spare
        # slot, with the largest priority ever recorded, which lives here
        self._other = torch.tensor([[self.spare], [0]], dtype=torch.int64, device=device)
        #: largest priority ever recorded (0-dim float64 view; the buffer sets it)
        self.max_seen = self._other[1, 0].view(torch.float64)
        self.max_seen.fill_(1.0)
        # bounds of the checks: [[0], [0]] and [[added - 1], [n - 1]] (keys, slots)
        self._lo = torch.zeros(2, 1, dtype=torch.int64, device=device)
        self._hi = torch.full((2, 1), -1, dtype=torch.int64, device=device)
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self._inf = torch.full((), math.inf, dtype=torch.float64, device=device)
        self._neg_inf = torch.full((), -math.inf, dtype=torch.float64, device=device)
        self._eps: dict[float, torch.Tensor] = {}
        self._upd: dict[tuple[int, bool], _UpdateScratch] = {}
        self._pos: dict[int, torch.Tensor] = {}

    # -- storage -----------------------------------------------------------------------
    @property
    def raw(self) -> torch.Tensor:
        """Raw priorities of slots ``0 .. capacity-1`` (a float64 view; only written
        slots hold values)."""
        return self.values[RAW, : self.capacity]

    def _init_blocks(self, b0: int, b1: int) -> None:
        lo, hi = b0 * K, b1 * K
        t = self.table[:, lo:hi]
        t[RAW:KEY].zero_()  # raw 0.0 and mass 0.0
        t[KEY].fill_(-1)
        torch.arange(lo, hi, out=t[SLOT])
        self.scratch[1, lo:hi] = torch.div(t[SLOT], K, rounding_mode="floor")
        self.tree.blocks[0, b0:b1] = 0.0
        self.tree.blocks[1, b0:b1] = math.inf

    def ensure(self, n: int) -> None:
        """Initialise the blocks holding slots ``0 .. n-1`` not yet initialised. O(new slots)."""
        need = num_blocks(max(n, 1))
        if need > self._ready:
            self._init_blocks(self._ready, need)
            self._ready = need

    def set_sizes(self, n: int, added: int) -> None:
        """The bounds of an update's checks: keys in [0, added), slots in [0, n). O(1)."""
        self._hi[0].fill_(added - 1)
        self._hi[1].fill_(n - 1)

    def leaf(self, p: torch.Tensor) -> torch.Tensor:
        """``p ** alpha``, 0 for p = 0 (0 ** 0 would be 1): the same bits for a
        priority whatever the batch it comes in (see :func:`exact_pow`)."""
        return torch.where(p > 0, exact_pow(p, self.alpha), 0.0)

    def total_for(self, n: int) -> torch.Tensor:
        """Total mass of slots ``0 .. n-1`` (0-dim tensor). O(n / 64), no sync."""
        return self.tree.total_of(num_blocks(max(n, 1))).clone()

    def fill(self, lo: int, count: int, value: torch.Tensor, key0: int) -> None:
        self.values[RAW, lo : lo + count].copy_(value.expand(count))
        torch.arange(key0, key0 + count, out=self.table[KEY, lo : lo + count])
        if self.prioritized:
            self.tree.fill_run(lo, count, self.leaf(value))

    def write(self, lo: int, p: torch.Tensor, key0: int) -> None:
        count = p.shape[0]
        self.values[RAW, lo : lo + count] = p
        torch.arange(key0, key0 + count, out=self.table[KEY, lo : lo + count])
        if self.prioritized:
            self.values[MASS, lo : lo + count] = self.leaf(p)
            self.tree.fix_range(lo, lo + count - 1)

    # -- draw --------------------------------------------------------------------------
    def _positions(self, b: int) -> torch.Tensor:
        """0 .. B-1 as float64, divided by B when B is a power of two (exactly)."""
        pos = self._pos.get(b)
        if pos is None:
            pos = torch.arange(b, dtype=torch.float64, device=self.device)
            if pow2(b):
                pos /= b
            self._pos[b] = pos
        return pos

    def _targets(
        self, u: torch.Tensor, total: torch.Tensor, stratified: bool, perm: torch.Tensor | None
    ) -> torch.Tensor:
        """:func:`fastper.policy.stratified_targets`, in the order ``perm``: 2 to 4 ops."""
        b = u.shape[0]
        x = policy.stratified_targets(
            u, total, self._positions(b) if stratified else None, scaled=pow2(b)
        )
        return x if perm is None else x.index_select(0, perm)

    def draw(
        self, u: torch.Tensor, n: int, beta: float, stratified: bool, norm: str,
        key_base: int, added: int, perm: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Slots, P(i), weights (float32) and keys of ``len(u)`` draws, in the order ``perm``."""
        idx, prob, base, keys = self.draw_base(u, n, stratified, norm, perm)
        return idx, prob, finish_weights(base, beta, prob), keys

    def draw_base(
        self, u: torch.Tensor, n: int, stratified: bool, norm: str, perm: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """:meth:`draw` but the weights' base, to the power -beta (None: all 1).

        The fused path (every stored mass positive): the block of each target
        is the count of block prefix sums below it (searched among the written
        blocks but the last, so it is one of them), its slot is searched among
        the block's first 63 running sums (so it is one of the block's 64) and
        capped at the block's last written slot (``n`` not a multiple of 64:
        the last block is partly written; one operation more, see
        :func:`key_top`), and one gather of the
        block's columns gives the slot, its mass and its key: every draw is a
        written slot of positive mass, on any device. Otherwise the caps of
        :meth:`DeviceSumTree.find_unchecked` guard the zero leaves and the
        slot is clamped to the written ones.
        """
        if not self.prioritized:
            return self._draw_uniform(u, n, stratified, perm)
        tree = self.tree
        last = (n - 1) // K  # the last written block
        total = tree.total_of(last + 1)
        t = self._targets(u, total, stratified, perm)
        prefix = tree.prefix
        if self.positive:
            blk = torch.searchsorted(prefix[1 : last + 1], t, right=True)
            tile = self.table[MASS:].view(3, -1, K).index_select(1, blk)  # mass, key, slot
            run = torch.cumsum(tile[0, :, : K - 1].view(torch.float64), 1)
            run += prefix.index_select(0, blk).unsqueeze(1)
            if n % K:  # the last block is partly written: a running sum followed by an
                # empty slot counts as infinite, so a target past the block's written
                # slots takes its last one (blocks before the last have no empty slot)
                run.add_(key_top(tile[1])[:, 1:], alpha=HUGE)
            col = torch.searchsorted(run, t.unsqueeze(1), right=True)
            rec = tile.gather(2, col.unsqueeze(0).expand(3, -1, -1))[:, :, 0]
            mass, keys, idx = rec[0].view(torch.float64), rec[1], rec[2]
        else:
            rec = self.table.index_select(1, tree.find_unchecked(t, n, summed=True))
            mass, keys, idx = rec[MASS].view(torch.float64), rec[KEY], rec[SLOT]
        prob, base = self._weights(mass, n, norm, last)
        return idx, prob, base, keys

    def _weights(
        self, mass: torch.Tensor, n: int, norm: str, last: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """P(i) and the base of the IS weights (:func:`fastper.policy.weight_base`,
        the same expressions; buffer norm: both ratios in one division)."""
        prefix, total = self.tree.prefix, self.tree.prefix[last + 1]
        if norm != "buffer":
            prob = policy.probabilities(mass, total)
            base = mass / mass.min() if norm == "batch" else n * prob
            return prob, base
        # every block's summary holds its smallest positive mass, empty slots not counted
        # (the updates' fused path counts no zero only where the blocks are full)
        slot = prefix[last + 2]  # the smallest mass goes next to the total
        torch.amin(self.tree.blocks[1, : last + 1], 0, out=slot)
        ratio = mass.unsqueeze(0) / prefix[last + 1 : last + 3].unsqueeze(1)
        return ratio[0], ratio[1]  # mass / total, mass / min

    def _draw_uniform(
        self, u: torch.Tensor, n: int, stratified: bool, perm: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
        """Unit mass per slot: the total mass is n, a point's slot its integer part."""
        b = u.shape[0]
        positions = torch.arange(b, dtype=torch.float64, device=self.device) if stratified else None
        t = policy.stratified_targets(u, float(n), positions)
        if perm is not None:
            t = t.index_select(0, perm)
        idx = t.to(torch.int64).clamp_(max=n - 1)
        prob = torch.full((b,), 1.0 / n, dtype=torch.float64, device=self.device)
        return idx, prob, None, self.table[KEY].index_select(0, idx)  # every weight is 1

    def probabilities(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        """P(i) of one draw for written slots ``idx`` (unchecked). O(B + n / 64), no sync."""
        if not self.prioritized:
            return torch.full(idx.shape, 1.0 / n, dtype=torch.float64, device=self.device)
        total = self.tree.total_of(num_blocks(n))
        return policy.probabilities(self.values[MASS].index_select(0, idx), total)

    # -- update ------------------------------------------------------------------------
    def _update_scratch(self, b: int, keyed: bool) -> _UpdateScratch:
        sc = self._upd.get((b, keyed))
        if sc is None:
            dev = self.device
            flags = torch.ones(6, b + 1, dtype=torch.bool, device=dev)  # unkeyed: rows 0, 3 stay
            flags[5, b] = False
            sc = _UpdateScratch(
                ints=torch.zeros(3, b + 1, dtype=torch.int64, device=dev),
                flags=flags,
                chosen=torch.empty(2, b + 1, dtype=torch.int64, device=dev),
                values=torch.zeros(2, -(-b // 64) * 64, dtype=torch.float64, device=dev),
                summary=torch.empty(b, K + 1, dtype=torch.float64, device=dev),
                positions=torch.arange(b, dtype=torch.int32, device=dev),
            )
            self._upd[(b, keyed)] = sc
        return sc

    def _eps_tensor(self, eps: float) -> torch.Tensor:
        """``eps`` (or clip) as a 1-element float64 tensor: ``|td| + eps`` is then float64
        for any td."""
        t = self._eps.get(eps)
        if t is None:
            t = self._eps[eps] = torch.full((1,), eps, dtype=torch.float64, device=self.device)
        return t

    def _pow(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst = src ** alpha`` with :func:`exact_pow`'s guarantee (``src``: a multiple
        of 64 elements)."""
        if self.device.type == "cpu" and src.shape[0] > _POW_BLOCK:
            for lo in range(0, src.shape[0], _POW_BLOCK):
                torch.pow(src[lo : lo + _POW_BLOCK], self.alpha, out=dst[lo : lo + _POW_BLOCK])
        else:
            torch.pow(src, self.alpha, out=dst)
        if self.alpha == 0.0:  # 0 ** 0 is 1: a zero priority keeps a zero mass
            torch.where(src > 0, dst, self._zero, out=dst)

    def update(
        self, idx: torch.Tensor, td: torch.Tensor, keys: torch.Tensor | None, eps: float,
        clip: float | None, n: int, key_base: int, added: int, validate: bool, noisy: bool,
        stacked: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Apply ``p = min(|td|, clip) + eps`` to the checked, fresh entries; the last of
        duplicate slots wins. Returns (applied: 0-dim int64, tallies: (6,) int64 of
        :data:`TALLIES`). No sync; about 20 tensor operations whatever B and N.

        ``stacked``: ``keys`` and ``idx`` as the two rows of one tensor, when the
        caller has them so (a :class:`DeviceBatch`'s are), else they are stacked here.

        The checks (the bounds come from :meth:`set_sizes`): a key in
        ``[0, added)``, a slot in ``[0, n)`` (both by clamping and comparing),
        ``p <= limit`` (false for NaN); fresh: the slot's key is the entry's.
        An entry passes if all three checks do, and applies if it also is
        fresh. The entries that do not apply are redirected to the spare slot
        (with a harmless priority), so every write is unconditional. Of the
        entries that apply, the last one of each slot wins: their positions
        are reduced per slot with ``amax`` into the scratch row, every entry
        then writes its slot's winner's priority (duplicates agree). The
        touched blocks are summarised again, and the largest applied
        priority raises the record.
        """
        b = idx.shape[0]
        sc = self._update_scratch(b, keys is not None)
        ints, flags, chosen = sc.ints, sc.flags, sc.chosen
        p = ints[2, :b].view(torch.float64)
        mag = td.abs()
        if clip is not None:  # in float64 whatever td's dtype, as the CPU buffers
            mag = torch.clamp(mag, max=self._eps_tensor(clip))
        torch.add(mag, self._eps_tensor(eps), out=p)
        if keys is not None:
            ki = stacked if stacked is not None else torch.stack([keys, idx])
            torch.clamp(ki, self._lo, self._hi, out=ints[:2, :b])
            torch.eq(ints[:2, :b], ki, out=flags[:2, :b])  # key issued, slot written
            seen = self.table[KEY].index_select(0, ints[1, :b])
            torch.eq(seen, keys, out=flags[3, :b])  # fresh
        else:
            torch.clamp(idx, self._lo[1], self._hi[1], out=ints[1, :b])
            torch.eq(ints[1, :b], idx, out=flags[1, :b])
        torch.le(p, self.limit, out=flags[2, :b])  # NaN compares false
        # ok = issued & written & usable, applied = written & usable & fresh
        torch.all(flags[:4, :b].unfold(0, 3, 1), -1, out=flags[4:, :b])
        tallies = flags[:, :b].sum(1)
        # applied entries keep (slot, p); the others get (spare, max ever)
        torch.where(flags[5], ints[1:], self._other, out=chosen)
        target = chosen[0, :b]
        self.scratch[0].scatter_reduce_(0, target, sc.positions, "amax", include_self=False)
        won = self.scratch.index_select(1, target)  # winner's position, block
        vals = sc.values
        torch.index_select(chosen[1].view(torch.float64), 0, won[0], out=vals[0, :b])
        if self.prioritized:
            self._pow(vals[0], vals[1])
            self.values[RAW : MASS + 1, target] = vals[:, :b]
            summary = sc.summary
            partial = self.positive and n % K != 0  # the last block is partly written:
            # its empty slots (key -1, mass 0) are not its smallest mass (one operation more)
            if partial:
                pair = self.table[MASS : KEY + 1].view(2, -1, K).index_select(1, won[1])
                tile = pair[0].view(torch.float64)
            else:
                tile = self.values[MASS].view(-1, K).index_select(0, won[1])
            torch.cumsum(tile, 1, out=summary[:, :K])
            if partial:
                tile = torch.add(tile, key_top(pair[1]), alpha=HUGE)
            elif not self.positive:  # a zero mass is not a block's smallest
                tile = torch.where(tile > 0, tile, self._inf)
            torch.amin(tile, 1, out=summary[:, K])
            self.tree.blocks[:, won[1]] = summary[:, K - 1 :].t()
        else:
            self.values[RAW, target] = vals[0, :b]
        torch.amax(chosen[1].view(torch.float64), 0, out=self.max_seen)
        return tallies[5], tallies

    def set_alpha(self, alpha: float, n: int) -> None:
        self.alpha = float(alpha)
        self.limit = priority_limit(self.max_value, self.alpha)
        if self.prioritized and n:
            self.values[MASS, :n] = self.leaf(self.values[RAW, :n])
            self.tree.rebuild(n)

    def load(self, p: np.ndarray, n: int, alpha: float, key_base: int, added: int) -> None:
        self._ready = 0
        self.ensure(n)
        if n:
            self.values[RAW, :n] = torch.from_numpy(p.copy()).to(self.device)
            slots = torch.arange(n, dtype=torch.int64, device=self.device)
            self.table[KEY, :n] = slot_keys(slots, key_base, added, self.capacity)
        self.set_alpha(alpha, n)
        self.set_sizes(n, added)

    def clear(self) -> None:
        self._ready = 0  # blocks are initialised again as the buffer refills
        self.tree.blocks[0].zero_()
        self.tree.blocks[1].fill_(math.inf)
        self.set_sizes(0, 0)

    def snapshot(self, n: int) -> dict[str, np.ndarray]:
        """Host copies of everything that holds state for slots ``0 .. n-1``: raw
        priorities, masses, keys and the summaries of their blocks (syncs). For tests
        and debugging: two indexes fed the same calls hold equal snapshots."""
        nb = num_blocks(max(n, 1)) if n else 0
        return {
            "raw": self.values[RAW, :n].cpu().numpy().copy(),
            "mass": self.values[MASS, :n].cpu().numpy().copy(),
            "keys": self.table[KEY, :n].cpu().numpy().copy(),
            "blocks": self.tree.blocks[:, :nb].cpu().numpy().copy(),
        }

    def nbytes(self) -> int:
        tree = self.tree
        tensors = [self.table, self.scratch, tree.blocks, tree.prefix]
        return int(sum(t.numel() * t.element_size() for t in tensors))


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
        self._max_seen = torch.ones((), dtype=torch.float64)
        self.positive = False  # unused: the kernels need no hint

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

    def total_for(self, n: int) -> torch.Tensor:
        """Total mass of the stored slots (0-dim tensor). O(1)."""
        return self.total

    @property
    def max_seen(self) -> torch.Tensor:
        """Largest priority ever recorded (0-dim float64 tensor; the buffer sets it)."""
        return self._max_seen

    def ensure(self, n: int) -> None:
        """Nothing to do: the samplers' arrays are allocated at once."""

    def set_sizes(self, n: int, added: int) -> None:
        """Nothing to do: the kernels take the sizes at each call."""

    def fill(self, lo: int, count: int, value: torch.Tensor, key0: int) -> None:
        self.sampler.write_run(lo, count, float(value))

    def write(self, lo: int, p: torch.Tensor, key0: int) -> None:
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
        stacked: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[int, int]]:  # fmt: skip
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
        if pmax > float(self._max_seen):
            self._max_seen.fill_(pmax)
        return torch.tensor(int(st[2])), (int(st[3]), invalid)  # host numbers

    def _update(
        self, idx: np.ndarray, td: np.ndarray, keys: np.ndarray, use_keys: bool, eps: float,
        clip: float, n: int, key_base: int, added: int,
    ) -> float:  # fmt: skip
        return self.sampler.update_from_td(
            idx, td, keys, use_keys, eps, clip, n, key_base, added, self._status
        )

    def set_alpha(self, alpha: float, n: int) -> None:
        self.sampler.set_alpha(alpha, n)

    def load(self, p: np.ndarray, n: int, alpha: float, key_base: int, added: int) -> None:
        self.sampler.load_state_dict({"alpha": float(alpha), "priorities": p}, n)

    def clear(self) -> None:
        self.sampler.clear()

    def nbytes(self) -> int:
        s = self.sampler
        tree = s.tree.nbytes if isinstance(s, ProportionalSampler) else 0
        return int(s.raw_leaves.nbytes + tree)
