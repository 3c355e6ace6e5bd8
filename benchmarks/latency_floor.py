"""The memory-latency floor of a learner step, measured beside it by `peers.py`.

A learner step (sample B draws with their rows, then update their priorities)
on a large buffer is bound by cache misses at random addresses: each draw
reads one cache line per tree level on its way down, its slot's row (one
record for small rows, else a line in every field column), then its raw
priority and the min tree's path on the way
back up. The probe here reads exactly that many lines, from regions as large
as fastper's (same tree layout, same row layout), with nothing else: no
arithmetic beyond the address, no Python between the regions, one compiled
call. It runs B independent chains, one region at a time across the batch
(a level-synchronous walk), each read's address depending on the chain's
previous read, so the CPU overlaps the misses of different chains as a
batched descent allows, and no more.

Regions are read in the step's order and each read falls uniformly in its
region: small regions (the tree's top levels) stay in cache exactly as the
tree's top levels do. The priority writes are not modelled (a write to a line
the step has just read costs no second miss). ``fastper / floor`` is then how
far the step is from the time its memory traffic alone takes on this machine.
"""

from __future__ import annotations

import time

import numpy as np
from adapters import FIELDS
from numba import njit

LINE_FLOATS = 8  # float64 per 64-byte cache line
OP = "floor"  #: the op name of the probe's rows in peers.csv (one per batch size)


def step_regions(capacity: int) -> list[tuple[str, int]]:
    """``(name, lines)`` of every region one draw of a fastper learner step reads, in order.

    Sum tree levels from the root down, the leaves, the row (one record, or
    each field column, as fastper's storage lays out these fields), the raw
    priorities, then the min tree's levels from the bottom up (it shares the
    sum tree's leaves).
    """
    from fastper._kernels.tree import layout
    from fastper.storage import default_layout, make_fields

    n_leaves, offs, depth = layout(capacity)  # every level is padded to whole lines
    inner = [
        (level, int(offs[level + 1] - offs[level]) // LINE_FLOATS) for level in range(1, depth + 1)
    ]
    regions = [(f"sum level {lv}", n) for lv, n in reversed(inner)]
    regions.append(("leaves", n_leaves // LINE_FLOATS))
    fields = make_fields(FIELDS)
    if default_layout(fields) == "records":  # a row is one record: its first line
        row = sum(f.nbytes_per_item for f in fields.values())
        regions.append(("records", -(-capacity * row // 64)))
    else:
        for name, f in fields.items():
            regions.append((f"column {name}", -(-capacity * f.nbytes_per_item // 64)))
    regions.append(("raw priorities", -(-capacity // LINE_FLOATS)))
    regions += [(f"min level {lv}", n) for lv, n in inner]
    return regions


@njit(nogil=True, cache=True)
def _chains(arena, starts, offsets, out):  # pragma: no cover - compiled
    """One read per region per chain, region by region across all chains.

    ``offsets[r, k]``: where chain ``k`` reads in region ``r`` (float64 units,
    a multiple of a line). The arena holds zeros, so adding the chain's last
    value changes no address but makes each read wait for the previous one.
    """
    b = offsets.shape[1]
    for k in range(b):
        out[k] = 0.0
    for r in range(starts.shape[0]):
        base = starts[r]
        for k in range(b):
            out[k] += arena[base + offsets[r, k] + np.int64(out[k])]


class Floor:
    """The probe's arena (the step's regions, written once so every page is mapped)."""

    def __init__(self, capacity: int) -> None:
        self.regions = step_regions(capacity)
        records = any(name == "records" for name, _ in self.regions)
        self.rows = "one record" if records else f"{len(FIELDS)} columns"
        lines = np.array([n for _, n in self.regions], dtype=np.int64)
        self.lines = lines
        self.starts = np.concatenate(([0], np.cumsum(lines)[:-1])) * LINE_FLOATS
        self.arena = np.empty(int(lines.sum()) * LINE_FLOATS)
        self.arena[:] = 0.0  # real pages, not the shared zero page of a fresh np.zeros

    @property
    def reads_per_draw(self) -> int:
        """Cache lines each chain reads (one per region)."""
        return len(self.regions)

    @property
    def nbytes(self) -> int:
        return int(self.arena.nbytes)

    def time_calls(self, batch: int, calls: int, warmup: int, seed: int = 0) -> np.ndarray:
        """Microseconds of each of ``calls`` probe calls (fresh random lines each call)."""
        rng = np.random.default_rng(seed)
        out = np.empty(batch)
        per_call = np.empty(calls)
        clock = time.perf_counter_ns
        for i in range(warmup + calls):
            offsets = rng.integers(0, self.lines[:, None], (len(self.lines), batch))
            offsets *= LINE_FLOATS
            t0 = clock()
            _chains(self.arena, self.starts, offsets, out)
            dt = (clock() - t0) / 1e3
            if i >= warmup:
                per_call[i - warmup] = dt
        return per_call

    def describe(self) -> str:
        """One line for the report's notes."""
        return (
            f"{self.reads_per_draw} dependent random line reads per draw (sum tree levels, "
            f"leaves, the row ({self.rows}), raw priorities, min tree levels) over "
            f"{self.nbytes / 2**20:.0f} MiB, B chains level-synchronous, one compiled call"
        )
