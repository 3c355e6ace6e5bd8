#!/usr/bin/env bash
# MinAtar study: Double DQN with MinAtar's CNN on the five games,
# uniform vs proportional vs rank-based replay, 5 seeds each.
#
#   bash studies/minatar.sh [GAME ...]     # default: all five, one after another
#
# Resumable: every run checkpoints itself every 10,000 steps; run the same
# command again and it continues where it stopped (finished runs are skipped),
# bit for bit. Two worker processes, one torch thread each (both cores);
# WORKERS sets another count. OUT (default runs/minatar) may lie outside the
# work tree, so that a fresh checkout can resume the same runs.
#
# Hyperparameters follow MinAtar's DQN (Young & Tian, 2019) where the budget
# allows: replay 100k, batch 32, lr 2.5e-4 (Adam here, RMSProp there), one
# gradient step per env step after 5,000 steps, hard target copy every 1,000
# gradient steps, epsilon 1 -> 0.1 over the first 100k steps (MinAtar: 100k
# frames), gamma 0.99. Budget: STEPS env steps per run (MinAtar's runs: 5M
# frames; MinAtar has no frame skip, so a frame is a step). The -v0 ids: the
# full 6-action set, as in the MinAtar paper's runs (-v1 is the minimal set);
# MinAtar's defaults otherwise (sticky actions 0.1, difficulty ramping).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-100000}"
OUT="${OUT:-runs/minatar}"
FASTPER="${FASTPER:-.venv/bin/fastper}"
WORKERS="${WORKERS:-2}"
GAMES=("$@")
if [ ${#GAMES[@]} -eq 0 ]; then
  GAMES=(Breakout Asterix SpaceInvaders Freeway Seaquest)
fi
for game in "${GAMES[@]}"; do
  args=(train dqn --env "MinAtar/${game}-v0" --replay uniform per rank --seeds 5
        --steps "$STEPS" --workers "$WORKERS" --threads 1 --out "$OUT/$game"
        --set buffer_size=100000 --set batch_size=32 --set lr=2.5e-4
        --set learning_starts=5000 --set train_freq=1 --set target_update=1000
        --set tau=1 --set eps_end=0.1 --set eps_fraction="$(python3 -c "print(min(1.0, 100000 / $STEPS))")"
        --set eval_every=10000 --set eval_episodes=10 --set checkpoint_every=10000)
  # --resume once any run of this game has a checkpoint (a fresh start otherwise)
  if [ -n "$(find "$OUT/$game" -maxdepth 4 -path '*/checkpoints/step-*' -print -quit 2>/dev/null)" ]; then
    "$FASTPER" "${args[@]}" --resume
  else
    "$FASTPER" "${args[@]}"
  fi
done
