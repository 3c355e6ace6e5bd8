# Sourced by run.sh / test.sh: make (once) and activate the project's venv.
# FASTPER_VENV overrides the location; EXTRAS picks the pip extras to install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FASTPER_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$VENV/.fastper-installed-${EXTRAS:-none}"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  case ",${EXTRAS:-}," in
    *,agents,*|*,bench,*|*,torch,*)
      # the extras accept torch >= 2.1; the project's own machines install exactly
      # this CPU build first (a local wheel), so pip never downloads another
      "$VENV/bin/python" -m pip install -q "torch==${FASTPER_TORCH:-2.13.0}" ;;
  esac
  if [ -n "${EXTRAS:-}" ]; then
    "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
  else
    "$VENV/bin/python" -m pip install -q -e "$ROOT"
  fi
  touch "$stamp"
fi
