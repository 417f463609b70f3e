#!/usr/bin/env bash
# Run the CPU test suite: builds .venv with the test extra first when it is missing or stale (torch and
# transformers are the tests' oracles, nbclient runs the example notebook). Extra arguments go to pytest.
# The test files run in parallel (pytest-xdist), one worker per core up to four, each file in one worker
# (its module-scoped models are built once); TEST_WORKERS=0 runs them in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
cores=$(nproc 2>/dev/null || echo 1)
workers=${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
