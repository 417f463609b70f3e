#!/usr/bin/env bash
# Run the CPU test suite: builds .venv with the test extra first when it is missing or stale (torch and
# transformers are the tests' oracles, nbclient runs the example notebook). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
