#!/usr/bin/env bash
# SB3's DQN against fastper's PERDQN with the same hyper-parameters (SB3's
# defaults, the RL Zoo's CartPole-v1 and Acrobot-v1 settings), then the report:
#
#   bash studies/sb3_defaults.sh            # every run, then summary.md + curves.png
#   SEEDS="0 1 2" bash studies/sb3_defaults.sh
#
# Writes docs/results/sb3/runs/<setting>/<algo>_seed<k>.csv, summary.md and
# curves.png (OUT sets another folder). Runs two at a time (WORKERS), one torch
# thread each, niced; a run whose CSV exists is skipped, so the same command
# resumes an interrupted study. Seeds go in the outer loop: stopped early, the
# study has the same seeds for every setting. SETTINGS picks settings;
# ACROBOT_SEEDS (default: SEEDS) bounds the Acrobot runs, the longest ones.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-docs/results/sb3}"
WORKERS="${WORKERS:-2}"
SEEDS="${SEEDS:-0 1 2 3 4}"
ACROBOT_SEEDS="${ACROBOT_SEEDS:-$SEEDS}"
SETTINGS="${SETTINGS:-sb3-defaults zoo-cartpole zoo-acrobot}"
jobs=()
for seed in $SEEDS; do
  for setting in $SETTINGS; do
    if [ "$setting" = zoo-acrobot ] && ! [[ " $ACROBOT_SEEDS " == *" $seed "* ]]; then
      continue
    fi
    algos="dqn perdqn"
    # the PER paper's normalisation of the IS weights, against the default, on SB3's defaults
    if [ "$setting" = sb3-defaults ]; then algos="dqn perdqn perdqn-buffer"; fi
    for algo in $algos; do
      if [ ! -f "$OUT/runs/$setting/${algo}_seed${seed}.csv" ]; then
        jobs+=("$setting $algo $seed")
      fi
    done
  done
done
running=0
for job in "${jobs[@]+"${jobs[@]}"}"; do
  read -r setting algo seed <<<"$job"
  if [ "$running" -ge "$WORKERS" ]; then
    wait -n || echo "a run failed (its CSV is missing: run the command again)"
    running=$((running - 1))
  fi
  echo "$(date +%T) start $setting $algo seed $seed"
  nice -n 10 "$PY" studies/sb3_defaults.py run --setting "$setting" --algo "$algo" \
    --seed "$seed" --out "$OUT" &
  running=$((running + 1))
done
wait || true
"$PY" studies/sb3_defaults.py report --out "$OUT"
