#!/usr/bin/env bash
# Results of the MinAtar study (studies/minatar.sh) into docs/results/minatar/:
# per game with finished runs, the runs' logs (config, summary, episodes and
# evaluations; no checkpoints) under runs/<game>/, then compare_<game>.md
# (`fastper compare`: IQM with stratified bootstrap intervals, t-intervals,
# AUC), tests_<game>.md (per-seed figures, mean curve, Welch and Mann-Whitney
# tests against uniform: studies/minatar_tests.py), curve_<game>.png
# (evaluation returns, bootstrap bands from 5 seeds) and profile_<game>.png
# (performance profile of the final returns); then across_games.md
# (studies/minatar_across.py: IQM over games of scores relative to uniform).
#
#   bash studies/minatar_report.sh [GAME ...]   # default: every game under runs/minatar
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${OUT:-runs/minatar}"
DOCS=docs/results/minatar
FASTPER="${FASTPER:-.venv/bin/fastper}"
PYTHON="${PYTHON:-.venv/bin/python}"
GAMES=("$@")
if [ ${#GAMES[@]} -eq 0 ]; then
  for d in "$RUNS"/*/; do GAMES+=("$(basename "$d")"); done
fi
for game in "${GAMES[@]}"; do
  dest="$DOCS/runs/$game"
  copied=0
  for run in "$RUNS/$game"/*/seed-*; do
    [ -f "$run/summary.json" ] || continue  # unfinished: left out
    rel="${run#"$RUNS/$game"/}"
    mkdir -p "$dest/$rel"
    cp "$run"/config.json "$run"/summary.json "$run"/episodes.csv "$run"/evaluations.csv "$dest/$rel/"
    copied=$((copied + 1))
  done
  echo "$game: $copied finished run(s)"
  [ "$copied" -gt 0 ] || continue
  "$FASTPER" compare "$dest" --returns eval > "$DOCS/compare_${game}.md"
  "$PYTHON" studies/minatar_tests.py "$dest" > "$DOCS/tests_${game}.md"
  "$FASTPER" plot "$dest" --returns eval -o "$DOCS/curve_${game}.png" \
    --profile "$DOCS/profile_${game}.png" --title "MinAtar $game (v0), Double DQN, 100k steps"
done
# across the games with all three schemes: IQM of scores relative to uniform
"$PYTHON" studies/minatar_across.py "$DOCS/runs" > "$DOCS/across_games.md"
