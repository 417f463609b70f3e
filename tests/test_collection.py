"""`pytest -m gpu` (and `-m gpu_slow`) on a machine with only the runtime dependencies and pytest:
the test-only packages (the HF oracle's torch and transformers, the notebook runner) are absent,
and collection must still succeed, with the GPU tests that need none of them collected to run."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_ONLY = ("torch", "transformers", "nbformat", "nbclient", "ipykernel", "matplotlib")


def test_gpu_tests_collect_without_the_test_only_packages(tmp_path):
    for name in TEST_ONLY:  # each import fails as for a package that is not installed
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ModuleNotFoundError('no {name}', name={name!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu or gpu_slow",
               "-p", "no:cacheprovider"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "error" not in result.stdout.splitlines()[-1], result.stdout[-3000:]
    for test in ("tests/test_layouts.py::test_two_gpus_complete_like_one",
                 "tests/test_router.py::test_route_compiled_on_gpu",
                 "tests/test_float32_precision.py::test_float32_logits_match_a_float64_oracle[gpu]",
                 "tests/test_layer_mix_gpu.py::test_fused_decode_time[bf16]"):
        assert any(line.startswith(test) for line in result.stdout.splitlines()), test
