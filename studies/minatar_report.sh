#!/usr/bin/env bash
# Results of the MinAtar study (studies/minatar.sh) into docs/results/minatar/:
# per game with finished runs, the runs' logs (config, summary, episodes and
# evaluations; no checkpoints) under runs/<game>/, then compare_<game>.md
# (`fastper compare`: mean and IQM of the final return, AUC, each with a 95%
# bootstrap interval over seeds), tests_<game>.md (per-seed figures, mean curve, Welch and Mann-Whitney
# tests against uniform: studies/minatar_tests.py), curve_<game>.png
# (evaluation returns, bootstrap bands from 5 seeds) and profile_<game>.png
# (performance profile of the final returns); then across_games.md
# (studies/minatar_across.py: IQM over games of scores relative to uniform).
#
#   bash studies/minatar_report.sh [GAME ...]   # default: every game under runs/minatar
#
# Without runs under OUT (a fresh checkout), the tables and figures are rebuilt
# from the logs already under docs/results/minatar/runs/. The pages written name
# no path outside the repository (checked at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${OUT:-runs/minatar}"
DOCS=docs/results/minatar
FASTPER="${FASTPER:-.venv/bin/fastper}"
PYTHON="${PYTHON:-.venv/bin/python}"
GAMES=("$@")
if [ ${#GAMES[@]} -eq 0 ]; then
  src="$RUNS"
  [ -d "$src" ] || src="$DOCS/runs"
  for d in "$src"/*/; do GAMES+=("$(basename "$d")"); done
fi
for game in "${GAMES[@]}"; do
  dest="$DOCS/runs/$game"
  if [ -d "$RUNS/$game" ]; then
    copied=0
    for run in "$RUNS/$game"/*/seed-*; do
      [ -f "$run/summary.json" ] || continue  # unfinished: left out
      rel="${run#"$RUNS/$game"/}"
      mkdir -p "$dest/$rel"
      cp "$run"/config.json "$run"/summary.json "$run"/episodes.csv "$run"/evaluations.csv "$dest/$rel/"
      copied=$((copied + 1))
    done
    echo "$game: $copied finished run(s) copied"
  fi
  [ -d "$dest" ] || { echo "$game: no runs under $RUNS/$game or $dest" >&2; continue; }
  "$FASTPER" compare "$dest" --returns eval > "$DOCS/compare_${game}.md"
  "$PYTHON" studies/minatar_tests.py "$dest" > "$DOCS/tests_${game}.md"
  "$FASTPER" plot "$dest" --returns eval -o "$DOCS/curve_${game}.png" \
    --profile "$DOCS/profile_${game}.png" --title "MinAtar $game (v0), Double DQN, 100k steps"
done
# across the games with all three schemes: IQM of scores relative to uniform
"$PYTHON" studies/minatar_across.py "$DOCS/runs" > "$DOCS/across_games.md"
# the pages give paths relative to the repository only
if grep -rEn '(^|[^A-Za-z0-9_.~-])/(work|tmp|home|root|Users|mnt|scratch)/' "$DOCS" --include='*.md'; then
  echo "minatar_report.sh: the lines above name a machine path; write it relative to the repository" >&2
  exit 1
fi
