#!/usr/bin/env bash
# Tests: install fastper with the dev, agents, minatar, sb3, stats, ray, tiers, torchrl and docs
# extras into ./.venv (first run only), then pytest.
# Extra arguments go to pytest (e.g. -k trees -x).
set -euo pipefail
EXTRAS=dev,agents,minatar,sb3,stats,ray,tiers,torchrl,docs
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
