#!/usr/bin/env bash
# Main job (a demo of 5-10 minutes on 2 cores): install fastper with the agents
# extra into ./.venv (first run only), train Double DQN on CartPole-v1 with
# prioritized and with uniform replay (2 seeds each, 2 processes), then print
# the comparison and write the learning-curve plot to runs/demo/curve.png.
# Override the budget with STEPS=... SEEDS=... WORKERS=...
set -euo pipefail
EXTRAS=agents
source "$(dirname "$0")/_venv.sh"
OUT="${OUT:-$ROOT/runs/demo}"
rm -rf "$OUT"
"$VENV/bin/fastper" train dqn --env CartPole-v1 --replay uniform per \
  --seeds "${SEEDS:-2}" --steps "${STEPS:-30000}" --workers "${WORKERS:-2}" --out "$OUT"
"$VENV/bin/fastper" compare "$OUT"
"$VENV/bin/fastper" plot "$OUT" -o "$OUT/curve.png"
