#!/usr/bin/env bash
# Build .venv from nothing (finding a Python >= 3.12) and install dsv3-jax with its runtime dependencies
# only (no torch: enough for the chat demo, the notebook API and the converters). `scripts/setup.sh test`
# adds the test extra (torch + transformers as oracles, the notebook runner); scripts/test.sh does that.
# `scripts/setup.sh serve` adds the serve extra (Starlette, uvicorn: dsv3-serve).
# Idempotent: each install has a stamp of pyproject.toml and the package set, and is redone only when stale.
set -euo pipefail
cd "$(dirname "$0")/.."
# the test extra brings torch with its CUDA wheels (several GB); a pip cache would hold them a second time
export PIP_NO_CACHE_DIR="${PIP_NO_CACHE_DIR:-1}"

is_py312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local candidate
  for candidate in python3.14 python3.13 python3.12 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && is_py312 "$(command -v "$candidate")"; then
      command -v "$candidate"; return 0
    fi
  done
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  command -v pyenv >/dev/null 2>&1 && pyenv_root="$(pyenv root)"
  for candidate in $(ls -d "$pyenv_root"/versions/3.1[2-9]* 2>/dev/null | sort -rV); do
    for exe in "$candidate"/bin/python3.1[2-9]; do
      if [ -x "$exe" ] && is_py312 "$exe"; then echo "$exe"; return 0; fi
    done
  done
  return 1
}

# pyproject.toml and the set of packages: an editable install maps only the packages present when it ran
stamp_of() { { cat pyproject.toml; ls -d */__init__.py 2>/dev/null; } | sha256sum | cut -c1-16; }

case "${1:-}" in
  "") target="." stamp=.venv/.dsv3-stamp ;;
  test) target=".[test]" stamp=.venv/.dsv3-test-stamp ;;
  serve) target=".[serve]" stamp=.venv/.dsv3-serve-stamp ;;
  *) echo "usage: scripts/setup.sh [test|serve]" >&2; exit 2 ;;
esac

if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$(stamp_of)" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  PYTHON="$(find_python)" || { echo "setup: no Python >= 3.12 found on PATH or under pyenv" >&2; exit 1; }
  echo "setup: using $PYTHON" >&2
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
echo "setup: installing dsv3-jax ($target) into .venv" >&2
.venv/bin/python -m pip install -q -e "$target"
stamp_of > "$stamp"
[ "$target" = "." ] || stamp_of > .venv/.dsv3-stamp  # the test extra includes the runtime
