#!/usr/bin/env bash
# Run the CPU test suite (builds .venv first when it is missing or stale). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
