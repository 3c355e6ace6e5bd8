"""Why prioritized replay needs about one update per memory slot here.

For each prioritized scheme, replays exactly as ``fastper.agents.cliffwalk.run``
does (same seeds, buffers and updates) and reports, at the moment the Q error
falls under the threshold: the updates taken, and the share of memory slots
replayed at least once. Usage (from the repository root):

    python docs/results/blind_cliffwalk/replay_coverage.py 12 10   # n, runs
"""

from __future__ import annotations

import sys

import numpy as np

import fastper
from fastper.agents import cliffwalk as cw


def coverage(n: int, scheme: str, seed: int, init: str) -> tuple[int, float]:
    mem_rng, init_rng, buf_seed = cw._streams(n, seed)
    memory = cw.make_memory(n, mem_rng)
    learner = cw.TabularQ(n, init_rng)
    cls = (
        fastper.PrioritizedReplayBuffer
        if scheme == "proportional"
        else fastper.RankBasedReplayBuffer
    )
    buf = cls(
        len(memory), cw._FIELDS, alpha=cw.DEFAULT_ALPHA[scheme], beta=0.0, eps=1e-6, seed=buf_seed
    )
    p0 = cw._initial_td(learner, memory) + 1e-6 if init == "td" else None
    buf.add(memory.columns(), priorities=p0)
    seen = np.zeros(len(memory), dtype=bool)
    limit = cw.THRESHOLD * 2 * n
    td = np.empty(1)
    for t in range(1, cw.default_max_updates(n) + 1):
        b = buf.sample(1)
        d = b.data
        seen[b.indices[0]] = True
        td[0] = learner.update(
            int(d["obs"][0]), int(d["action"][0]), float(d["reward"][0]),
            int(d["next_obs"][0]), bool(d["terminated"][0]),
        )  # fmt: skip
        buf.update_priorities(b.indices, td, keys=b.keys)
        if learner.exact_sse() < limit:
            return t, float(seen.mean())
    raise RuntimeError("budget exhausted")


def main() -> None:
    n, runs = int(sys.argv[1]), int(sys.argv[2])
    print(
        f"n={n}, memory {2 ** (n + 1) - 2}, {runs} runs: median updates / memory, "
        "median share of slots replayed at least once"
    )
    for scheme in ("proportional", "rank"):
        for init in ("max", "td"):
            res = [coverage(n, scheme, seed, init) for seed in range(runs)]
            ups = np.median([r[0] for r in res]) / (2 ** (n + 1) - 2)
            share = np.median([r[1] for r in res])
            print(
                f"  {scheme:12s} init={init}: {ups:.2f} updates per slot, {share:.1%} of slots replayed"
            )


if __name__ == "__main__":
    main()
