"""Held-out perplexity of the embedded demo model (`dsv3_jax/assets/demo`) in float32, bfloat16 and
block-wise fp8 (the hub layout: e4m3 `weight` + float32 `weight_scale_inv` per 128x128 block, made
here from the bf16 weights), with both GEMM paths and with ue8m0 (power-of-two) scales; against the
unigram baseline. Writes benchmarks/fidelity-demo.{json,md} (--write) or prints the table.

    python scripts/fidelity_demo.py [--windows 32] [--seq 2048] [--ckpt DIR] [--data DIR] [--write [--out-dir DIR]]

Evaluation set: `--windows` windows of --seq predicted tokens (seq + 1 tokens each), spread evenly
over the non-overlapping windows of the corpus' evaluation set (data/pycorpus/eval_texts.jsonl.gz,
both domains, tokenized by the checkpoint's tokenizer), each scored from position 0 (no earlier
context), as in training's evaluation. The MTP columns score
the MTP module on the same windows: its loss on token i+2 and its teacher-forced acceptance (its
top-1 guess for token i+2 equals the main model's greedy token for i+2 given the true prefix).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

DEMO = ROOT / "dsv3_jax" / "assets" / "demo"
DATA = ROOT / "data" / "pycorpus"
SEQ = 2048
BLOCK = 128
E4M3_MAX = 448.0

# (name, checkpoint: "bf16" | "fp8" | "fp8-ue8m0", run options)
CONFIGS = [
    ("float32", "bf16", dict(compute_dtype="float32")),
    ("bfloat16", "bf16", dict(compute_dtype="bfloat16")),
    ("fp8 weights, gemm bf16", "fp8", dict(compute_dtype="bfloat16", gemm_impl="bf16")),
    ("fp8 weights, gemm fp8", "fp8", dict(compute_dtype="bfloat16", gemm_impl="fp8")),
    ("fp8 ue8m0 scales, gemm bf16", "fp8-ue8m0", dict(compute_dtype="bfloat16", gemm_impl="bf16")),
    ("fp8 ue8m0 scales, gemm fp8", "fp8-ue8m0", dict(compute_dtype="bfloat16", gemm_impl="fp8")),
]


def quantize_block_wise(weight: np.ndarray, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(M, N) -> e4m3 (M, N), float32 scales (ceil(M/128), ceil(N/128)): scale = amax / 448 per block
    (ue8m0: rounded up to a power of two), as tests/fp8_checkpoints.py, float64 math."""
    rows, cols = weight.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = np.zeros((br * BLOCK, bc * BLOCK), np.float64)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(br, BLOCK, bc, BLOCK)
    scales = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-4) / E4M3_MAX
    if ue8m0:
        scales = 2.0 ** np.ceil(np.log2(scales))
    scales = scales.astype(np.float32)
    quantized = (blocks / scales[:, None, :, None].astype(np.float64)).reshape(padded.shape)[:rows, :cols]
    return quantized.astype(ml_dtypes.float8_e4m3fn), scales


def is_projection(name: str, array: np.ndarray) -> bool:
    """The weights real fp8 checkpoints quantise: 2-D projections, not embedding, head, norms or router."""
    return array.ndim == 2 and name.endswith(".weight") and not any(
        k in name for k in ("embed_tokens", "lm_head", "norm", "mlp.gate.", "shared_head.head"))


def write_fp8(source: Path, directory: Path, ue8m0: bool = False) -> Path:
    """The bf16 checkpoint `source` as a block-wise fp8 checkpoint in `directory` (one file)."""
    from dsv3_jax.checkpoint.safetensors import TensorIndex, save_file

    index = TensorIndex(source)
    tensors = {}
    for name in index.names():
        array = np.asarray(index.tensor(name))
        if is_projection(name, array):
            tensors[name], tensors[name + "_scale_inv"] = quantize_block_wise(array.astype(np.float64), ue8m0)
        else:
            tensors[name] = array
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK], **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def sibling_script(name: str):
    """scripts/<name>.py as a module (the scripts are no package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def heldout_windows(n: int, seq: int = SEQ, ckpt: Path = DEMO, data: Path = DATA) -> np.ndarray:
    """`n` windows (n, seq + 1) spread evenly over the evaluation set's non-overlapping windows."""
    from dsv3_jax.tokenizer import Tokenizer

    eval_demo = sibling_script("eval_demo")
    texts = eval_demo.read_eval_texts(data)
    tokenizer = Tokenizer.from_dir(ckpt)
    stream = np.concatenate([eval_demo.domain_stream(tokenizer, texts[d]) for d in eval_demo.DOMAINS if texts[d]])
    total = (len(stream) - 1) // seq
    if total < 1:
        raise SystemExit(f"the evaluation set of {data} holds {len(stream)} tokens, fewer than one window of {seq}")
    starts = np.linspace(0, total - 1, n).round().astype(np.int64) * seq
    return stream[starts[:, None] + np.arange(seq + 1)[None]].astype(np.int32)


def unigram_loss(windows: np.ndarray, data: Path = DATA) -> float:
    """-log p of the windows' targets under the train split's add-one unigram model."""
    counts = np.load(data / "train_counts.npy").astype(np.float64) + 1.0
    return float(-np.log(counts / counts.sum())[windows[:, 1:]].mean())


def evaluate(path: Path, windows: np.ndarray, options: dict, mtp: bool = True) -> dict:
    import jax.numpy as jnp

    import dsv3_jax
    from dsv3_jax import training
    from dsv3_jax.checkpoint.mtp import load_mtp

    start = time.perf_counter()
    model = dsv3_jax.load(path, max_seq_len=windows.shape[1] - 1, max_batch_size=len(windows), **options)
    module = load_mtp(path, model.args, param_dtype=model.options.jnp_dtype) if mtp else None
    out = training.sequence_nll(model, windows, mtp=module)
    loss = float(jnp.mean(out["nll"]))
    result = dict(loss=loss, ppl=math.exp(loss))
    if mtp:
        result.update(mtp_loss=float(jnp.mean(out["mtp_nll"])),
                      mtp_acceptance=float(jnp.mean(out["mtp_argmax"] == out["main_argmax"][:, 1:])),
                      mtp_accuracy=float(jnp.mean(out["mtp_argmax"] == windows[:, 2:])))
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def measure(n_windows: int, configs=CONFIGS, mtp: bool = True, seq: int = SEQ, ckpt: Path = DEMO,
            data: Path = DATA) -> dict:
    windows = heldout_windows(n_windows, seq, ckpt, data)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"bf16": ckpt}
        for name, checkpoint, options in configs:
            if checkpoint not in paths:
                paths[checkpoint] = write_fp8(ckpt, Path(tmp) / checkpoint, ue8m0=checkpoint == "fp8-ue8m0")
            rows.append(dict(name=name, checkpoint=checkpoint, **options,
                             **evaluate(paths[checkpoint], windows, options, mtp)))
    unigram = unigram_loss(windows, data)
    return dict(windows=n_windows, seq=seq, tokens=int(windows[:, 1:].size), unigram_loss=unigram,
                unigram_ppl=math.exp(unigram), rows=rows)


def markdown(result: dict) -> str:
    base = {r["name"]: r for r in result["rows"]}["bfloat16"]
    lines = ["# Demo model fidelity: held-out perplexity by precision", "",
             f"{result['windows']} windows x {result['seq']} predicted tokens ({result['tokens']} tokens), spread "
             "evenly over the corpus' evaluation set (held-out Python files of the stdlib and other packages, not "
             "trained on); "
             f"{result.get('host', 'CPU')}. Relative change against bfloat16. Unigram baseline (train-split "
             f"counts, add-one): loss {result['unigram_loss']:.3f}, perplexity {result['unigram_ppl']:.1f}.", "",
             "| precision | checkpoint | loss | perplexity | loss vs bf16 | ppl vs bf16 | MTP loss | MTP acceptance |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['checkpoint']} | {r['loss']:.4f} | {r['ppl']:.3f} | "
                     f"{100 * (r['loss'] / base['loss'] - 1):+.3f}% | {100 * (r['ppl'] / base['ppl'] - 1):+.3f}% | "
                     f"{r.get('mtp_loss', float('nan')):.4f} | {r.get('mtp_acceptance', float('nan')):.4f} |")
    lines += ["", "Made by `python scripts/fidelity_demo.py --write`; checked by tests/test_fidelity_demo.py."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    import jax

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seq", type=int, default=SEQ, help="predicted tokens per window")
    parser.add_argument("--ckpt", type=Path, default=DEMO, help=f"bf16 checkpoint ({DEMO})")
    parser.add_argument("--data", type=Path, default=DATA, help=f"corpus directory ({DATA})")
    parser.add_argument("--write", action="store_true", help="write fidelity-demo.{json,md} into --out-dir")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks")
    opts = parser.parse_args(argv)
    result = measure(opts.windows, seq=opts.seq, ckpt=opts.ckpt, data=opts.data)
    device = jax.devices()[0]
    result["host"] = (f"{device.device_kind}" if device.platform == "gpu" else f"CPU ({platform.machine()})") + \
        f", jax {jax.__version__}"
    text = markdown(result)
    print(text)
    if opts.write:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        (opts.out_dir / "fidelity-demo.json").write_text(json.dumps(result, indent=1) + "\n")
        (opts.out_dir / "fidelity-demo.md").write_text(text)


if __name__ == "__main__":
    main()
