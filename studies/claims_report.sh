#!/usr/bin/env bash
# Results of the claims study (studies/claims.sh) into docs/results/claims/:
# per claim with finished runs, the runs' logs (config, summary, episodes and
# evaluations; no checkpoints) under runs/<claim>/<arm>/, compare_<claim>.md
# (`fastper compare` of the two arms: mean and IQM of the final return, AUC, each
# with a 95% bootstrap interval over seeds) and curve_<claim>.png (evaluation returns); then
# verdicts.md (studies/claims_report.py: the primary metric per claim, Welch
# and Mann-Whitney tests, Holm over the claims, the verdict), and once stage 2's
# seeds are there verdicts_stage2.md (seeds 0-9) and verdicts_stage2_fresh.md (5-9).
#
#   bash studies/claims_report.sh [CLAIM ...]   # default: every claim under runs/claims
#   OUT=runs/claims2 bash studies/claims_report.sh   # stage 2's runs (seeds 5-9) join them
#
# Without runs under OUT (a fresh checkout), the tables and figures are rebuilt
# from the logs already under docs/results/claims/runs/. The pages written name
# no path outside the repository (checked at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${OUT:-runs/claims}"
DOCS="${DOCS:-docs/results/claims}"
FASTPER="${FASTPER:-.venv/bin/fastper}"
PYTHON="${PYTHON:-.venv/bin/python}"
CLAIMS=("$@")
if [ ${#CLAIMS[@]} -eq 0 ]; then
  src="$RUNS"
  [ -d "$src" ] || src="$DOCS/runs"
  for d in "$src"/*/; do CLAIMS+=("$(basename "$d")"); done
fi
for claim in "${CLAIMS[@]}"; do
  dest="$DOCS/runs/$claim"
  if [ -d "$RUNS/$claim" ]; then
    copied=0
    for run in "$RUNS/$claim"/*/*/seed-*; do
      [ -f "$run/summary.json" ] || continue  # unfinished: left out
      rel="${run#"$RUNS/$claim"/}"
      mkdir -p "$dest/$rel"
      cp "$run"/config.json "$run"/summary.json "$run"/episodes.csv "$run"/evaluations.csv "$dest/$rel/"
      copied=$((copied + 1))
    done
    echo "$claim: $copied finished run(s) copied"
  fi
  [ -d "$dest" ] || { echo "$claim: no runs under $RUNS/$claim or $dest" >&2; continue; }
  "$FASTPER" compare "$dest" --returns eval > "$DOCS/compare_${claim}.md"
  what="$("$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]));
print({"dqn": "Double DQN", "sac": "SAC"}.get(r["algo"], r["algo"]), "on", r["env_id"])' \
    "$(find "$dest" -name config.json | sort | head -1)")"
  arms="$(find "$dest" -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | sort | paste -sd, | sed 's/,/ vs /g')"
  "$FASTPER" plot "$dest" --returns eval -o "$DOCS/curve_${claim}.png" \
    --title "Claim $claim ($arms): $what"
done
# stage 1: seeds 0-4, the design's metrics; stage 2: seeds 0-9 pooled and 5-9 alone,
# AUC where stage 1's final return sat at CartPole's ceiling (docs/results/claims/README.md)
"$PYTHON" studies/claims_report.py "$DOCS/runs" --stage 1 --seeds 0-4 > "$DOCS/verdicts.md"
if [ -n "$(find "$DOCS/runs" -maxdepth 5 -type d -name 'seed-[5-9]' -print -quit)" ]; then
  "$PYTHON" studies/claims_report.py "$DOCS/runs" --stage 2 --seeds 0-9 > "$DOCS/verdicts_stage2.md"
  "$PYTHON" studies/claims_report.py "$DOCS/runs" --stage 2 --seeds 5-9 > "$DOCS/verdicts_stage2_fresh.md"
fi
# the pages give paths relative to the repository only
if grep -rEn '(^|[^A-Za-z0-9_.~-])/(work|tmp|home|root|Users|mnt|scratch)/' "$DOCS" --include='*.md'; then
  echo "claims_report.sh: the lines above name a machine path; write it relative to the repository" >&2
  exit 1
fi
