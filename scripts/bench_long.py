"""Long-context benchmark: time to first token of one long prompt and decode ms/step with that context
in the cache, each beside its floor, for a DeepSeek model with random weights made on the device.

    python scripts/bench_long.py --config configs/config_16B.json --contexts 8192,32768,131072
    python scripts/bench_long.py --config configs/config_671B.json --layers 4 --dense-layers 1 \
        --weights fp8 --gemm-impl fp8 --contexts 32768,131072

Prefill goes through `Model.forward` (chunked by `--prefill-chunk`); its floor is the matmul FLOPs of
the weights (over the fp8 peak with --gemm-impl fp8, else the bf16 peak) plus the causal attention
FLOPs over the bf16 peak. Decode feeds device-resident tokens and positions to `Model.step`; its floor
is the bytes it must read (weights, the selected experts, the cache attended) over 4.3 TB/s. Writes
<out-dir>/long-<gpu>-<config>[-tag].json and .md after every row.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dsv3_jax
from bench_model import HBM_BYTES_PER_S, decode_bytes, prefill_flops
from dsv3_jax.config import ModelArgs
from dsv3_jax.options import add_flags, from_flags

BF16_PEAK, FP8_PEAK = 790e12, 1400e12  # one H200, dense matmul, measured (bf16) and published (fp8)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a reference JSON config")
    parser.add_argument("--layers", type=int, help="cut the model to this many layers (dense first)")
    parser.add_argument("--dense-layers", type=int, help="with --layers: how many of them are dense")
    parser.add_argument("--weights", choices=("bf16", "fp8"), help="weight storage (default: the config's dtype)")
    parser.add_argument("--contexts", default="8192,32768,131072", help="prompt lengths, a comma list")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed at each context")
    parser.add_argument("--repeats", type=int, default=1, help="timed prefills per context (after one warm-up)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out-dir", default="benchmarks")
    add_flags(parser)
    opts = parser.parse_args()
    opts.contexts = [int(c) for c in opts.contexts.split(",") if c]
    return opts


def model_args(opts) -> ModelArgs:
    args = ModelArgs.from_reference_json(opts.config)
    changes = dict(max_batch_size=1, max_seq_len=max(opts.contexts) + opts.steps + 8)
    if opts.layers:
        dense = args.n_dense_layers if opts.dense_layers is None else opts.dense_layers
        changes.update(n_layers=opts.layers, n_dense_layers=min(dense, opts.layers))
    if opts.weights:
        changes["dtype"] = opts.weights
    return args.replace(**changes)


def prefill_floor_s(args: ModelArgs, length: int, gemm_impl: str) -> float:
    attention = 2 * length * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * length / 2
    weights = prefill_flops(args, 1, length) - attention
    return weights / (FP8_PEAK if gemm_impl == "fp8" else BF16_PEAK) + attention / BF16_PEAK


def time_prefill(model, tokens: np.ndarray, repeats: int) -> tuple[float, float]:
    """(seconds of the first call, compile included; median seconds of the next `repeats`)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(model.forward(tokens, 0))
        times.append(time.perf_counter() - start)
    return times[0], float(np.median(times[1:]))


def time_decode(model, context: int, steps: int) -> float:
    """ms per decode step at `context` cached tokens (the prefill just run), inputs on the device."""
    window = dsv3_jax.cache_window(context + steps + 1, model.args.max_seq_len)
    token = jnp.zeros((1, 1), jnp.int32)
    last = jnp.zeros((1,), jnp.int32)

    def run(n: int, position):
        nonlocal token
        for _ in range(n):
            logits, model.cache = model.step(model.state, model.cache, token, position, last, kv_len=window)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
            position = position + 1
        jax.block_until_ready(token)
        return position

    position = run(3, jnp.full((1,), context, jnp.int32))  # compiles
    start = time.perf_counter()
    run(steps, position)
    return (time.perf_counter() - start) / steps * 1e3


def measure(model, args: ModelArgs, opts, length: int) -> dict:
    tokens = np.random.default_rng(length).integers(0, args.vocab_size, (1, length)).astype(np.int32)
    first_s, prefill_s = time_prefill(model, tokens, opts.repeats)
    floor_s = prefill_floor_s(args, length, model.options.gemm_impl)
    decode_ms = time_decode(model, length, opts.steps)
    decode_floor_ms = decode_bytes(args, 1, length + opts.steps // 2, 2) / HBM_BYTES_PER_S * 1e3
    return {"context": length, "ttft_s": prefill_s, "prefill_tok_per_s": length / prefill_s,
            "prefill_floor_s": floor_s, "prefill_pct_of_floor": 100 * floor_s / prefill_s,
            "first_call_s": first_s, "decode_ms": decode_ms, "decode_floor_ms": decode_floor_ms,
            "decode_pct_of_floor": 100 * decode_floor_ms / decode_ms}


def write(out: Path, stem: str, header: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({**header, "rows": rows}, indent=2))
    lines = [f"# {stem}", "", ", ".join(f"{k} {v}" for k, v in header.items()), "",
             "| context | TTFT | prefill tok/s | prefill floor | % | decode ms/step (b=1) | floor | % |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context']:,} | {r['ttft_s']:.3f} s | {r['prefill_tok_per_s']:,.0f} | "
                     f"{r['prefill_floor_s']:.3f} s | {r['prefill_pct_of_floor']:.0f}% | {r['decode_ms']:.3f} | "
                     f"{r['decode_floor_ms']:.3f} | {r['decode_pct_of_floor']:.0f}% |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    opts = parse_args()
    args = model_args(opts)
    model = dsv3_jax.build(args, seed=0, options=from_flags(opts))
    device = jax.local_devices()[0]
    gpu = device.device_kind.lower().replace("nvidia ", "").replace(" ", "-")
    stem = f"long-{gpu}-{Path(opts.config).stem.replace('config_', '')}" + (f"-{opts.tag}" if opts.tag else "")
    header = {"gpu": device.device_kind, "layers": args.n_layers, "dense_layers": args.n_dense_layers,
              "weights": args.dtype, "gemm_impl": model.options.gemm_impl, "prefill_attn": model.options.prefill_attn,
              "prefill_chunk": model.options.prefill_chunk, "jax": jax.__version__}
    rows = []
    for length in opts.contexts:
        rows.append(measure(model, args, opts, length))
        stats = device.memory_stats() or {}
        rows[-1]["peak_device_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
        write(Path(opts.out_dir), stem, header, rows)


if __name__ == "__main__":
    main()
