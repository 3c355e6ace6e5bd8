#!/usr/bin/env bash
# Proposed PER variants, each tested at small scale: two arms per
# claim, the same seeds, everything else equal.
#
#   bash studies/claims.sh [CLAIM ...]     # default: all six, one after another
#   OUT=runs/claims2 SEED_OFFSET=5 bash studies/claims.sh   # stage 2: seeds 5-9
#
# CLAIM is one of: cosine_beta batch_norm adaptive_alpha hybrid grad_clip
# new_priority. Runs go to runs/claims/<claim>/<arm>/ (OUT overrides
# runs/claims); each arm's runs under <arm>/<algo>-<env>-<replay>/seed-<k>/.
#
# Resumable: every run checkpoints itself (DQN every 10,000 steps, SAC every
# 5,000); run the same command again and it continues where it stopped
# (finished runs are skipped), bit for bit. Two worker processes, one torch
# thread each (both cores).
#
# Budgets (2 cores, shared with the MinAtar study): DQN on CartPole-v1, 50,000
# env steps per run (the CartPole study's budget, docs/results/cartpole_dqn:
# 70-110 s per run on an idle core), 5 seeds x 2 arms = 10 runs, 8-15 min
# per claim; SAC on Pendulum-v1, 15,000 steps (the Pendulum study's budget,
# about 80 s per run on an idle core), 10 runs, 8-15 min. Earlier runs on
# a busier machine saw 5-13 min per run. SEEDS (default 5), SEED_OFFSET (the
# first seed, default 0) and STEPS_DQN / STEPS_SAC change them for every claim;
# WORKERS (default 2) sets the processes per arm: two claims can run side by
# side with WORKERS=1 each, so no core idles while an arm's last seed runs.
#
# Every other setting is the agents' defaults (DQNConfig tuned for CartPole,
# SACConfig for Pendulum) with proportional replay ("per"), the paper's
# alpha 0.6 and beta 0.4 -> 1; the baseline arm is that recipe and the other
# arm changes only what its claim is about. Evaluation: 10 greedy
# (deterministic) episodes every 2,500 steps (SAC: every 1,500, 5 episodes).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/claims}"
FASTPER="${FASTPER:-.venv/bin/fastper}"
SEEDS="${SEEDS:-5}"
STEPS_DQN="${STEPS_DQN:-50000}"
STEPS_SAC="${STEPS_SAC:-15000}"
WORKERS="${WORKERS:-2}"
SEED_OFFSET="${SEED_OFFSET:-0}"

# arm DIR ALGO ENV REPLAY STEPS [--set NAME=VALUE ...]: the runs of one arm,
# --resume once any of its runs has a checkpoint (a fresh start otherwise).
arm() {
  local dir="$1" algo="$2" env="$3" replay="$4" steps="$5"
  shift 5
  local args=(train "$algo" --env "$env" --replay "$replay" --seeds "$SEEDS"
              --seed-offset "$SEED_OFFSET" --steps "$steps" --workers "$WORKERS"
              --threads 1 --out "$dir" "$@")
  if [ -n "$(find "$dir" -maxdepth 4 -path '*/checkpoints/step-*' -print -quit 2>/dev/null)" ]; then
    "$FASTPER" "${args[@]}" --resume
  else
    "$FASTPER" "${args[@]}"
  fi
}

DQN_EVAL=(--set eval_every=2500 --set eval_episodes=10 --set checkpoint_every=10000)
SAC_EVAL=(--set eval_every=1500 --set eval_episodes=5 --set checkpoint_every=5000)

# "cosine annealing of beta beats linear by ~12% final return" (seed: MuJoCo
# Ant; here SAC on Pendulum-v1). beta 0.4 -> 1 over the run, linear vs cosine.
cosine_beta() {
  local d="$OUT/cosine_beta"
  arm "$d/linear" sac Pendulum-v1 per "$STEPS_SAC" "${SAC_EVAL[@]}" --set beta_schedule=linear
  arm "$d/cosine" sac Pendulum-v1 per "$STEPS_SAC" "${SAC_EVAL[@]}" --set beta_schedule=cosine
}

# "normalising IS weights by the batch max instead of the buffer max gives ~15%
# better sample efficiency early" (read: the early evaluations, area under the
# curve over the first half).
batch_norm() {
  local d="$OUT/batch_norm"
  arm "$d/buffer" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" --set weight_norm=buffer
  arm "$d/batch" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" --set weight_norm=batch
}

# "an adaptive alpha schedule (lower early, higher late) gains ~14%": alpha
# 0.6 throughout vs 0.4 -> 0.8 linearly over the run (the same mean alpha).
adaptive_alpha() {
  local d="$OUT/adaptive_alpha"
  arm "$d/constant" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" --set alpha=0.6
  arm "$d/adaptive" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" \
    --set alpha=0.4 --set alpha_end=0.8
}

# "rank-based early, proportional later, Gaussian noise on priorities late":
# proportional throughout vs rank-based (alpha 0.7) for the first half, then
# proportional (alpha 0.6) with priorities |td| * exp(0.2 z) (our sigma: the
# seed gives none). beta: each scheme's paper start (0.4 / 0.5) -> 1.
hybrid() {
  local d="$OUT/hybrid"
  arm "$d/proportional" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}"
  arm "$d/hybrid" dqn CartPole-v1 rank "$STEPS_DQN" "${DQN_EVAL[@]}" \
    --set switch_at=0.5 --set priority_noise_late=0.2
}

# "clip gradients at 0.5 x max IS weight": the default clip (norm 10) vs also
# clipping at 0.5 x the batch's largest IS weight (the smaller clip wins).
grad_clip() {
  local d="$OUT/grad_clip"
  arm "$d/norm10" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" --set grad_clip_is=0
  arm "$d/is_half" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" --set grad_clip_is=0.5
}

# "new priority = max TD error + 1e-5" vs the paper's max priority ever seen.
# All arms p = |td| + 1e-5, so only the new transitions' priority differs:
# the largest ever recorded vs the largest held now (max_td: stage 1 only; it
# trained bit for bit as ever does, since new transitions pass the top priority
# on) vs the largest of the latest learning batch (last_td: the claim's arm).
new_priority() {
  local d="$OUT/new_priority"
  arm "$d/ever" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" \
    --set priority_eps=1e-5 --set new_priority=ever
  if [ "$SEED_OFFSET" -eq 0 ]; then
    arm "$d/max_td" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" \
      --set priority_eps=1e-5 --set new_priority=max_td
  fi
  arm "$d/last_td" dqn CartPole-v1 per "$STEPS_DQN" "${DQN_EVAL[@]}" \
    --set priority_eps=1e-5 --set new_priority=last_td
}

CLAIMS=("$@")
if [ ${#CLAIMS[@]} -eq 0 ]; then
  CLAIMS=(cosine_beta batch_norm adaptive_alpha hybrid grad_clip new_priority)
fi
for claim in "${CLAIMS[@]}"; do
  case "$claim" in
    cosine_beta|batch_norm|adaptive_alpha|hybrid|grad_clip|new_priority) "$claim" ;;
    *) echo "studies/claims.sh: unknown claim '$claim' (one of: cosine_beta batch_norm" \
            "adaptive_alpha hybrid grad_clip new_priority)" >&2; exit 2 ;;
  esac
done
