#!/usr/bin/env bash
# The GPU test suite in parallel on one GPU: one pytest process per test file that holds GPU tests,
# JOBS (default 6) at a time, largest file first. Compiling is most of the suite's time and each
# process compiles on its own cores, so the files overlap; the GPU is shared (no preallocation).
#
#   scripts/gpu_tests.sh                 # the fast GPU suite (pytest -m gpu)
#   scripts/gpu_tests.sh -m gpu_slow     # the slower sweeps; other arguments go to every pytest
#
# Prints each file's summary line, then the full log of every file that failed; exit 1 if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-m gpu)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
grep -l "pytest.mark.gpu" tests/test_*.py | xargs ls -S |
  xargs -P "${JOBS:-6}" -I{} sh -c '"$0" -m pytest -q -p no:cacheprovider "$@" {} > "'"$logs"'/$(basename {}).log" 2>&1; \
    echo $? > "'"$logs"'/$(basename {}).rc"' "$python" "${args[@]}"
failed=0
for rc_file in "$logs"/*.rc; do
  name=$(basename "$rc_file" .rc)
  rc=$(cat "$rc_file")
  printf '%-40s %s\n' "$name" "$(tail -1 "$logs/$name.log")"
  # 5: no test in this file has the selected marks
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then failed=1; fi
done
for rc_file in "$logs"/*.rc; do
  name=$(basename "$rc_file" .rc)
  rc=$(cat "$rc_file")
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then echo "==== $name (exit $rc)"; cat "$logs/$name.log"; fi
done
echo "GPU suite: $(( $(date +%s) - start )) s"
exit $failed
