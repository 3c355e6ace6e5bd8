"""A uniformly random policy's return on a MinAtar game: the floor for the study's curves.

    python studies/minatar_random.py GAME [EPISODES]    # e.g. Asterix 100

Episodes seeded 0 .. EPISODES-1 (environment and actions), capped at 27,000
steps as the study's evaluations are; prints the mean return with its 95%
t-interval.
"""

from __future__ import annotations

import sys

import numpy as np
from scipy import stats

from fastper.agents._common import make_env


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    game, episodes = argv[0], int(argv[1]) if len(argv) > 1 else 100
    env = make_env(f"MinAtar/{game}-v0")
    returns = []
    for seed in range(episodes):
        env.reset(seed=seed)
        rng = np.random.default_rng(seed)
        total, done, t = 0.0, False, 0
        while not done and t < 27_000:
            _, r, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            total, done, t = total + float(r), term or trunc, t + 1
        returns.append(total)
    a = np.array(returns)
    half = stats.t.ppf(0.975, a.size - 1) * a.std(ddof=1) / np.sqrt(a.size)
    print(
        f"random policy, MinAtar/{game}-v0, {a.size} episodes (seeds 0-{a.size - 1}): "
        f"mean return {a.mean():.2f} [{a.mean() - half:.2f}, {a.mean() + half:.2f}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
