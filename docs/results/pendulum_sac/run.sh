#!/usr/bin/env bash
# SAC on Pendulum-v1: uniform vs proportional replay, 3 seeds each, one run after another.
# Run from the repository root with the agents extra installed (pip install -e '.[agents]').
# --include-unfinished: these runs were logged before runs wrote summary.json (all finished).
set -euo pipefail
OUT=docs/results/pendulum_sac
fastper train sac --env Pendulum-v1 --replay uniform per --seeds 3 --steps 15000 --threads 1 \
  --workers 1 --out "$OUT/runs"
fastper compare "$OUT/runs" --window 10 --threshold -200 --include-unfinished > "$OUT/compare.md"
fastper plot "$OUT/runs" --window 10 --include-unfinished -o "$OUT/curve.png"
# The MuJoCo trial (needs: pip install "gymnasium[mujoco]"); these runs wrote summary.json.
if python -c "import mujoco" 2>/dev/null; then
  fastper train sac --env InvertedPendulum-v5 --replay uniform per --seeds 2 --steps 10000 \
    --threads 1 --workers 1 --out "$OUT/mujoco_runs"
  fastper compare "$OUT/mujoco_runs" --window 10 > "$OUT/compare_inverted_pendulum.md"
  fastper plot "$OUT/mujoco_runs" --window 10 -o "$OUT/curve_inverted_pendulum.png"
fi
