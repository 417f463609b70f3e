"""Test set-up: four forced host devices (so 1-vs-N device parity runs on a CPU), float64 oracles,
a compilation cache for the session, the seeded `rng` fixture, and the `gpu` and `gpu_slow`
markers, whose tests are skipped unless a GPU is present."""
import os
import shutil
import tempfile
import zlib

# Four host devices for 1-vs-N parity; backend optimisation off halves XLA:CPU compile time (tests only).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread for torch (the HF oracles) and OpenBLAS (numpy's float64 oracles), here and in the
# subprocesses: their operands are tiny, and where the cores are busy (xdist workers, XLA compiling) a
# second thread spends its time spin-waiting, several times the work itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One compilation cache for the session, new and empty each run, shared with the subprocesses (the
# CLI and tools compile the same tiny models' steps run after run): a program compiled once, keyed
# by its HLO and the compiler's options, is not compiled again. Removed when the session ends.
SESSION_COMPILE_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    SESSION_COMPILE_CACHE = tempfile.mkdtemp(prefix="dsv3-jax-test-compile-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=SESSION_COMPILE_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

from pathlib import Path

# Imported before anything is traced: the first Pallas kernel run in interpret mode imports this
# module, whose config option joins every jitted function's trace context, so each function traced
# before it would be traced (and looked up in the compilation cache) once more after it.
import jax.experimental.pallas.fuser  # noqa: F401
import numpy as np
import pytest

# Subprocesses (the CLI, the converters, scripts, examples) import this checkout's packages, whatever
# an installed (e.g. editable) copy elsewhere points at.
ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

FIXTURES = ROOT / "tests" / "fixtures"  # the real DeepSeek-V3 tokenizer (MIT, LICENSE beside it), HF configs
CONFIGS = ROOT / "configs"  # the reference implementation's JSON configs


def _has_gpu() -> bool:
    import jax

    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def pytest_sessionfinish(session, exitstatus):
    if SESSION_COMPILE_CACHE is not None:
        shutil.rmtree(SESSION_COMPILE_CACHE, ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(config, items):
    _keep_shard(config, items)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the device with `pytest -m gpu` or `-m gpu_slow`)")
    for item in items:
        if "gpu" in item.keywords or "gpu_slow" in item.keywords:
            item.add_marker(skip)


def _keep_shard(config, items):
    """DSV3_TEST_SHARD="i/n" keeps every n-th selected test from the i-th (scripts/gpu_tests.sh runs a
    slow file's GPU tests as n processes side by side)."""
    shard = os.environ.get("DSV3_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"DSV3_TEST_SHARD={shard!r}: expected i/n with 0 <= i < n")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
    items[:] = [item for i, item in enumerate(items) if i % count == index]


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def configs_dir() -> Path:
    return CONFIGS


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded by the test's id (file, name, parameters): the same numbers every run and
    on every machine (crc32, not the per-process salted hash())."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
