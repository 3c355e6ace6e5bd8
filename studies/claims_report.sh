#!/usr/bin/env bash
# Results of the claims study (studies/claims.sh) into docs/results/claims/:
# per claim with finished runs, the runs' logs (config, summary, episodes and
# evaluations; no checkpoints) under runs/<claim>/<arm>/, compare_<claim>.md
# (`fastper compare` of the two arms: IQM with stratified bootstrap intervals,
# t-intervals, AUC) and curve_<claim>.png (evaluation returns); then
# verdicts.md (studies/claims_report.py: the primary metric per claim, Welch
# and Mann-Whitney tests, Holm over the claims, the verdict), and once stage 2's
# seeds are there verdicts_stage2.md (seeds 0-9) and verdicts_stage2_fresh.md (5-9).
#
#   bash studies/claims_report.sh [CLAIM ...]   # default: every claim under runs/claims
#   OUT=runs/claims2 bash studies/claims_report.sh   # stage 2's runs (seeds 5-9) join them
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
# stage 1: seeds 0-4, the design's metrics; stage 2: seeds 0-9 pooled and 5-9 alone,
# AUC where stage 1's final return sat at CartPole's ceiling (docs/results/claims/README.md)
"$PYTHON" studies/claims_report.py "$DOCS/runs" --stage 1 --seeds 0-4 > "$DOCS/verdicts.md"
if [ -n "$(find "$DOCS/runs" -maxdepth 5 -type d -name 'seed-[5-9]' -print -quit)" ]; then
  "$PYTHON" studies/claims_report.py "$DOCS/runs" --stage 2 --seeds 0-9 > "$DOCS/verdicts_stage2.md"
  "$PYTHON" studies/claims_report.py "$DOCS/runs" --stage 2 --seeds 5-9 > "$DOCS/verdicts_stage2_fresh.md"
fi
