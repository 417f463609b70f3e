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

import ml_dtypes
import numpy as np
import pytest

from dsv3_jax.checkpoint.safetensors import TensorIndex
from hf_models import V3_TINY, torch, transformers
from test_convert import BF16, BLOCK, LINEAR, make_source, mtp_tensors, write_sharded, write_tokenizer

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


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """bf16 values drawn as bits: a random sign and mantissa, and an exponent in [2**-8, 2**2), about as
    many distinct bit patterns as standard normal values have (a tenth of the time to draw)."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16) & 0x807F  # sign, mantissa
    bits |= rng.integers(127 - 8, 127 + 2, shape, dtype=np.uint16) << 7  # biased exponent
    return bits.view(BF16)


def random_e4m3(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Every finite e4m3 value about equally often (the NaN pattern 0x7f is drawn as -448, 0xfe)."""
    bits = rng.integers(0, 0xFE, shape, dtype=np.uint8)
    bits[bits == 0x7F] = 0xFE
    return bits.view(ml_dtypes.float8_e4m3fn)


def saved_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors `save_pretrained` writes for a DeepseekV3ForCausalLM of
    `config`: its parameters (on the meta device: no storage), the fused experts as one tensor each."""
    with torch.device("meta"):
        params = {name: tuple(t.shape) for name, t in transformers.DeepseekV3ForCausalLM(config).state_dict().items()}
    shapes = {}
    for name, shape in params.items():
        prefix = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        if not prefix.endswith(".mlp.experts."):
            shapes[name] = shape
        elif name.endswith("gate_up_proj"):  # (experts, 2 * inner, dim): gate rows, then up rows
            for e in range(shape[0]):
                for part in ("gate_proj", "up_proj"):
                    shapes[f"{prefix}{e}.{part}.weight"] = (shape[1] // 2, shape[2])
        else:  # down_proj (experts, dim, inner)
            for e in range(shape[0]):
                shapes[f"{prefix}{e}.down_proj.weight"] = shape[1:]
    return shapes


def make_big_source(directory: Path, *, fp8: bool, files: int, **overrides) -> Path:
    """`make_source`'s checkpoint (its tensor names, shapes and dtypes, files, MTP layer, config and
    tokenizer) with random values drawn directly: what the tools hold depends on the tensors' sizes,
    not on their values, and no Hugging Face model is initialised (seconds of CPU at these sizes)."""
    config = transformers.DeepseekV3Config(**{**V3_TINY, **overrides})
    rng = np.random.default_rng(3)
    tensors = {}
    for name, shape in saved_shapes(config).items():
        if fp8 and LINEAR.search(name):
            blocks = tuple(-(-n // BLOCK) for n in shape)
            tensors[name] = random_e4m3(rng, shape)
            tensors[name + "_scale_inv"] = rng.uniform(1e-4, 1e-2, blocks).astype(np.float32)
        else:
            tensors[name] = random_bf16(rng, shape)
    tensors.update(mtp_tensors(tensors, config.num_hidden_layers, fp8))
    directory.mkdir(parents=True)
    write_sharded(tensors, directory, files)
    config.architectures, config.dtype = ["DeepseekV3ForCausalLM"], torch.float32  # as save_pretrained writes them
    config.num_nextn_predict_layers = 1
    if fp8:
        config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK]}
    config.to_json_file(directory / "config.json")
    transformers.GenerationConfig.from_model_config(config).save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def sizes(directory: Path) -> tuple[int, int]:
    index = TensorIndex(directory)
    nbytes = [index.tensor(n).nbytes for n in index.names()]
    return sum(nbytes), max(nbytes)


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    return make_big_source(tmp_path_factory.mktemp("big") / "source", fp8=False, files=5, **BIG)


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
    source = make_big_source(tmp_path_factory.mktemp("big_fp8") / "source", fp8=True, files=5, **BIG_FP8)
    total, largest = sizes(source)
    assert total > 24 * largest
    args = lambda src, dst: ["--input-fp8-hf-path", src, "--output-bf16-hf-path", dst]  # noqa: E731
    peak = measure("fp8_cast_bf16", args, tiny_sources["fp8"], source, tmp_path)
    report(capsys, "fp8_cast_bf16", total, largest, peak, tmp_path)
    assert peak["traced_peak"] < 3 * largest + 2 * MIB
    assert peak["rss_growth"] < RSS_BOUND * total


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_big_sources_are_laid_out_as_make_source_writes(tiny_sources, tmp_path, kind):
    """make_big_source at make_source's sizes: the same files, config, tensors (name, shape, dtype) and files' index."""
    made, drawn = tiny_sources[kind], make_big_source(tmp_path / "source", fp8=kind == "fp8", files=2)
    assert sorted(p.name for p in drawn.iterdir()) == sorted(p.name for p in made.iterdir())
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        assert json.loads((drawn / name).read_text()) == json.loads((made / name).read_text()), name
    made_index, drawn_index = TensorIndex(made), TensorIndex(drawn)
    assert sorted(drawn_index.names()) == sorted(made_index.names())
    for name in made_index.names():
        a, b = made_index.tensor(name), drawn_index.tensor(name)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        assert np.isfinite(np.asarray(b, np.float32)).all(), name
