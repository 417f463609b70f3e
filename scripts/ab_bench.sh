#!/usr/bin/env bash
# Time a baseline revision and the working tree in ONE device call, so that every speed claim has
# its baseline from the same run (same GPU, clocks, drivers).
#
# Here:   scripts/ab_bench.sh prepare REV          # REV's code (no data, assets, tests, docs) into .device-data/baseline
# Device: scripts/ab_bench.sh run [bench_model.py arguments...]   (carry .device-data; PYTHON=python3)
#         -> writes <out-dir>/model-*-baseline.* and model-*-current.* and prints both tables
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    rev="${2:?usage: scripts/ab_bench.sh prepare REV}"
    rm -rf .device-data/baseline && mkdir -p .device-data/baseline
    # what bench_model.py runs, small enough to travel with the working tree (a call carries 64 MiB at most)
    git archive "$rev" -- dsv3_jax pallas_kernels scripts configs pyproject.toml ':(exclude)dsv3_jax/assets' \
      | tar -x -C .device-data/baseline
    echo "baseline $(git rev-parse --short "$rev") in .device-data/baseline"
    ;;
  run)
    shift
    [ -d .device-data/baseline ] || { echo "ab_bench: no .device-data/baseline (run 'prepare REV' first)" >&2; exit 1; }
    for side in baseline current; do
      root=$([ "$side" = baseline ] && echo .device-data/baseline || echo .)
      echo "== $side"
      (cd "$root" && PYTHONPATH=. "${PYTHON:-python3}" scripts/bench_model.py "$@" --tag "$side") 2>&1 | grep -v Warning
    done
    ;;
  *) echo "usage: scripts/ab_bench.sh prepare REV | run [bench_model.py arguments...]" >&2; exit 2 ;;
esac
