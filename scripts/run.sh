#!/usr/bin/env bash
# Main job: install fastper into ./.venv (first run only) and run `fastper bench`.
# Extra arguments go to `fastper bench` (e.g. --capacity 65536 --batch-size 32).
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
exec "$VENV/bin/fastper" bench "$@"
