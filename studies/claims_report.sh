#!/usr/bin/env bash
# Results of the claims study (studies/claims.sh) into docs/results/claims/:
# per claim with finished runs, the runs' logs (config, summary, episodes and
# evaluations; no checkpoints) under runs/<claim>/<arm>/, compare_<claim>.md
# (`fastper compare` of the two arms: IQM with stratified bootstrap intervals,
# t-intervals, AUC) and curve_<claim>.png (evaluation returns); then
# verdicts.md (studies/claims_report.py: the primary metric per claim, Welch
# and Mann-Whitney tests, Holm over the claims, the verdict).
#
#   bash studies/claims_report.sh [CLAIM ...]   # default: every claim under runs/claims
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${OUT:-runs/claims}"
DOCS="${DOCS:-docs/results/claims}"
FASTPER="${FASTPER:-.venv/bin/fastper}"
PYTHON="${PYTHON:-.venv/bin/python}"
CLAIMS=("$@")
if [ ${#CLAIMS[@]} -eq 0 ]; then
  for d in "$RUNS"/*/; do CLAIMS+=("$(basename "$d")"); done
fi
for claim in "${CLAIMS[@]}"; do
  dest="$DOCS/runs/$claim"
  copied=0
  for run in "$RUNS/$claim"/*/*/seed-*; do
    [ -f "$run/summary.json" ] || continue  # unfinished: left out
    rel="${run#"$RUNS/$claim"/}"
    mkdir -p "$dest/$rel"
    cp "$run"/config.json "$run"/summary.json "$run"/episodes.csv "$run"/evaluations.csv "$dest/$rel/"
    copied=$((copied + 1))
  done
  echo "$claim: $copied finished run(s)"
  [ "$copied" -gt 0 ] || continue
  "$FASTPER" compare "$dest" --returns eval > "$DOCS/compare_${claim}.md"
  "$FASTPER" plot "$dest" --returns eval -o "$DOCS/curve_${claim}.png" --title "claim: $claim"
done
"$PYTHON" studies/claims_report.py "$DOCS/runs" > "$DOCS/verdicts.md"
