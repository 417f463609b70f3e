"""Peak host memory of the checkpoint tools: about the largest tensor (plus an output shard at most),
never the model. Each tool runs in a fresh subprocess that reports the peak of traced (numpy/Python)
allocations and the growth of its peak resident set (VmHWM, reset after the imports) over the
resident set at that point. Linux only (/proc)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3_jax.checkpoint.safetensors import TensorIndex
from test_convert import make_source

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
# A bf16 model of ~270 MiB in 5 files whose largest tensors (embedding, head) are 4 MiB each, and an fp8
# one of ~125 MiB (fp8 experts), so that the model dwarfs the largest tensor and the tools' fixed overheads.
BIG = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=32,
           num_hidden_layers=40, n_group=4, topk_group=2, num_experts_per_tok=3)
BIG_FP8 = dict(BIG, vocab_size=4096, hidden_size=512, moe_intermediate_size=256, qk_nope_head_dim=64,
               qk_rope_head_dim=64, v_head_dim=64, kv_lora_rank=128, q_lora_rank=128, n_routed_experts=16,
               num_hidden_layers=16)
# The resident set also holds what the traced peak does not see: the writers' native buffers
# (TensorStore's, for orbax), measured 7-68 MiB whatever the model's size (to_orbax: 29 MiB at 170 MiB
# and 33 MiB at 320 MiB on an idle CPU; 25-68 MiB at 170-220 MiB under load). Its bound is half the model:
# a tool holding the whole model (or its output) grows by at least the model, twice the bound.
RSS_BOUND = 1 / 2

MEASURE = """
import json, sys, tracemalloc, importlib
tool, warm_up, rss_run, traced_run = sys.argv[1], *map(json.loads, sys.argv[2:])
module = importlib.import_module("dsv3_jax.convert." + tool)
module.main(warm_up)  # pays the one-off costs (imports, thread pools, allocator arenas, compiles)
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident set size (VmHWM) to the current one
before = status("VmRSS")
module.main(rss_run)
rss_growth = status("VmHWM") - before
tracemalloc.start()  # a second run, traced (tracemalloc's own bookkeeping would inflate the RSS)
module.main(traced_run)
print(json.dumps({"traced_peak": tracemalloc.get_traced_memory()[1], "rss_growth": rss_growth}))
"""


def measure(tool: str, make_argv, warm_source: Path, source: Path, directory: Path) -> dict:
    """Peak memory of `tool` converting `source`, after a warm-up run on `warm_source`, in one process."""
    as_json = lambda args: json.dumps([str(a) for a in args])  # noqa: E731
    runs = [make_argv(warm_source, directory / "warm"), make_argv(source, directory / "out"),
            make_argv(source, directory / "traced")]
    # XLA's default optimisation (not the suite's faster-compiling level 0): the cast's dequantising
    # kernel runs over the whole model
    env = {**os.environ, "XLA_FLAGS": ""}
    result = subprocess.run([sys.executable, "-c", MEASURE, tool, *map(as_json, runs)], cwd=REPO,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def sizes(directory: Path) -> tuple[int, int]:
    index = TensorIndex(directory)
    nbytes = [index.tensor(n).nbytes for n in index.names()]
    return sum(nbytes), max(nbytes)


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("big"), "v3", fp8=False, files=5, **BIG)


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"bf16": make_source(root / "bf16", "v3", fp8=False, files=2),
            "fp8": make_source(root / "fp8", "v3", fp8=True, files=2)}


def report(capsys, tool, total, largest, peak, tmp_path) -> None:
    """Print the measured figures and check that both measured runs wrote their output."""
    with capsys.disabled():
        print(f"\n{tool}: model {total / MIB:.1f} MiB, largest tensor {largest / MIB:.1f} MiB, traced peak "
              f"{peak['traced_peak'] / MIB:.1f} MiB, RSS growth {peak['rss_growth'] / MIB:.1f} MiB")
    assert (tmp_path / "out").is_dir() and (tmp_path / "traced").is_dir()


@pytest.mark.parametrize("tool", ["convert", "to_orbax"])
def test_peak_memory_is_about_the_largest_tensor(big_source, tiny_sources, tmp_path, tool, capsys):
    total, largest = sizes(big_source)
    assert total > 40 * largest  # the model is clearly bigger than what the tools may hold
    args = lambda src, dst: ["--hf-ckpt-path", src, "--save-path", dst] + (  # noqa: E731
        ["--n-experts", 8 if src != big_source else 32, "--model-parallel", 4] if tool == "convert" else [])
    peak = measure(tool, args, tiny_sources["bf16"], big_source, tmp_path)
    report(capsys, tool, total, largest, peak, tmp_path)
    assert peak["traced_peak"] < 2 * largest + 2 * MIB
    assert peak["rss_growth"] < RSS_BOUND * total


def test_cast_peak_memory(tiny_sources, tmp_path_factory, tmp_path, capsys):
    source = make_source(tmp_path_factory.mktemp("big_fp8"), "v3", fp8=True, files=5, **BIG_FP8)
    total, largest = sizes(source)
    assert total > 24 * largest
    args = lambda src, dst: ["--input-fp8-hf-path", src, "--output-bf16-hf-path", dst]  # noqa: E731
    peak = measure("fp8_cast_bf16", args, tiny_sources["fp8"], source, tmp_path)
    report(capsys, "fp8_cast_bf16", total, largest, peak, tmp_path)
    assert peak["traced_peak"] < 3 * largest + 2 * MIB
    assert peak["rss_growth"] < RSS_BOUND * total
