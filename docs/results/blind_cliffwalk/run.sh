#!/usr/bin/env bash
# Reproduces docs/results/blind_cliffwalk/ (main experiment) and its sweep/.
# Run from the repository root with a Python that has fastper (and matplotlib
# for the plots): PYTHON=/path/to/python bash docs/results/blind_cliffwalk/run.sh
set -euo pipefail
PY=${PYTHON:-python}
OUT=docs/results/blind_cliffwalk
CW="nice -n 10 $PY -m fastper.agents.cliffwalk"

# Main experiment: n = 2..16, 10 paired runs per (n, scheme), all five schemes,
# defaults: proportional alpha=1, rank alpha=0.7, beta=0 (no IS), eps=1e-6,
# initial priorities 1.0 (max).
time $CW --n 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 --runs 10 --jobs 2 --out $OUT

# Sensitivity: alpha, IS correction (beta) and initial priorities.
S=$OUT/sweep
T="Blind Cliffwalk sensitivity (alpha, beta, initial priorities)"
time $CW --n 6 8 10 12 --runs 10 --jobs 2 --out $S --no-plot \
  --schemes uniform proportional:0.4 proportional:0.6 proportional:0.8 proportional:1 \
            rank:0.4 rank:0.7 rank:1 rank:1.5 greedy
time $CW --n 6 8 10 --runs 10 --jobs 2 --out $S --append --no-plot --beta 0.4 --schemes proportional rank
time $CW --n 6 8 10 --runs 10 --jobs 2 --out $S --append --no-plot --beta 1 --schemes proportional rank
time $CW --n 6 8 10 12 --runs 10 --jobs 2 --out $S --append --no-plot --init td \
  --schemes proportional rank greedy

# Tables and plots from the CSVs (rerunnable alone; needs matplotlib).
$CW --out $OUT --plot-only
$CW --out $S --plot-only --title "$T"

# Share of memory slots replayed before the threshold (README, "What was found").
time nice -n 10 $PY $OUT/replay_coverage.py 12 10
