#!/usr/bin/env bash
# The GPU test suite in parallel on one GPU: one pytest process per test file that holds GPU tests,
# the files in SPLIT as several processes of an equal share of the file's tests each (DSV3_TEST_SHARD),
# JOBS (default 12) at a time, those first. Compiling is most of the suite's time and each process
# compiles on its own cores, so the processes overlap; the GPU is shared (no preallocation).
#
#   scripts/gpu_tests.sh                 # the fast GPU suite (pytest -m gpu)
#   scripts/gpu_tests.sh -m gpu_slow     # the slower sweeps; other arguments go to every pytest
#
# Prints each process's summary line, then the full log of every one that failed; exit 1 if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-m gpu)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# the files whose GPU tests take minutes in one process (each builds and compiles several models), each with
# its process count
SPLIT=(tests/test_layer_mix_gpu.py:3 tests/test_auto_paths_gpu.py:5 tests/test_grouped_gemm.py:3)

run_one() {  # a test file and its shard ("i/n", or "" for the whole file)
  local name
  name=$(basename "$1" .py)${2:+.${2%/*}}
  DSV3_TEST_SHARD=$2 "$python" -m pytest -q -p no:cacheprovider "${args[@]}" "$1" > "$logs/$name.log" 2>&1
  echo $? > "$logs/$name.rc"
  printf 'done %-35s %s\n' "$name" "$(tail -1 "$logs/$name.log")"  # as it ends: a run cut short still says these
}

start=$(date +%s)
for entry in "${SPLIT[@]}"; do
  for ((shard = 0; shard < ${entry#*:}; shard++)); do
    while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-12}" ]; do wait -n; done
    run_one "${entry%:*}" "$shard/${entry#*:}" &
  done
done
for file in $(grep -l "pytest.mark.gpu" tests/test_*.py | xargs ls -S); do
  [[ " ${SPLIT[*]} " == *" $file:"* ]] && continue
  while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-12}" ]; do wait -n; done
  run_one "$file" "" &
done
wait
failed=0
for rc_file in "$logs"/*.rc; do
  name=$(basename "$rc_file" .rc)
  rc=$(cat "$rc_file")
  printf '%-40s %s\n' "$name" "$(tail -1 "$logs/$name.log")"
  # 5: no test in this file (or shard) has the selected marks
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then failed=1; fi
done
for rc_file in "$logs"/*.rc; do
  name=$(basename "$rc_file" .rc)
  rc=$(cat "$rc_file")
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then echo "==== $name (exit $rc)"; cat "$logs/$name.log"; fi
done
echo "GPU suite: $(( $(date +%s) - start )) s"
exit $failed
