# Sourced by scripts/test and scripts/demo: make sure .venv exists and matches requirements.lock.
# Needs only Python 3.11+ with venv and pip; every dependency is pinned with hashes in the lock.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CODA_MEMORY_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.lock-stamp"
# cksum, not sha256sum: POSIX has it, and macOS has no sha256sum.
want="$(cksum "$ROOT/requirements.lock" "$ROOT/pyproject.toml" | cksum)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "coda-memory: preparing $VENV from requirements.lock" >&2
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "coda-memory needs Python 3.11 or newer (found $("$PY" --version))" >&2; exit 1; }
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --require-hashes --only-binary=:all: -r "$ROOT/requirements.lock"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-deps --no-build-isolation -e "$ROOT"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
