#!/usr/bin/env bash
# Double DQN on CartPole-v1: uniform vs proportional vs rank-based replay, 10 seeds each.
# Run from the repository root with the agents extra installed (pip install -e '.[agents]').
# 5-13 minutes per run (two at a time) on the 2-core reference machine, shared with other jobs.
# --include-unfinished: these runs were logged before runs wrote summary.json (all 30 finished).
set -euo pipefail
OUT=docs/results/cartpole_dqn
fastper train dqn --env CartPole-v1 --replay uniform per rank --seeds 10 --steps 50000 \
  --workers 2 --out "$OUT/runs"
fastper compare "$OUT/runs" --window 20 --include-unfinished > "$OUT/compare.md"
fastper plot "$OUT/runs" --window 20 --include-unfinished -o "$OUT/curve.png"
