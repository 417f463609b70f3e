"""Bytes per device for a DeepSeek config split over N devices (TP + EP as dsv3-jax splits it):
weights, fp8 block scales, the absorbed-MLA cache and the largest activations of a prefill chunk.

    python scripts/memory_plan.py --config config_671B.json --devices 8 --batch 32 --seq-len 4096

--config takes a reference JSON or a Hugging Face config.json.

Counts come from the model's own parameter shapes and partition specs (an abstract model, no
memory is allocated), so the plan follows the code.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import jax

from dsv3_jax.cache import cache_shapes
from dsv3_jax.cli import ArgumentParser, run_cli
from dsv3_jax.config import ModelArgs
from dsv3_jax.schema import abstract_state
from dsv3_jax.sharding import parameter_bytes_per_device

GIB = 2**30


def activation_bytes(args: ModelArgs, devices: int, batch: int, chunk: int, kv_len: int, act_bytes: int) -> dict:
    """The largest live tensors of one prefill chunk of (batch, chunk) tokens on one device."""
    tokens = batch * chunk
    heads = args.n_heads // devices
    return {
        "hidden state (x2: residual + branch)": 2 * tokens * args.dim * act_bytes,
        "attention scores (float32)": batch * chunk * heads * kv_len * 4,
        "q in latent space": tokens * heads * args.kv_lora_rank * act_bytes,
        "routed rows + expert hidden (x3)": tokens * args.n_activated_experts * (args.dim + 3 * args.moe_inter_dim) * act_bytes,
        "logits (float32, full vocab)": batch * args.vocab_size * 4,
    }


def main(argv=None) -> None:
    parser = ArgumentParser(prog="memory_plan.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="model config: a reference JSON or a Hugging Face config.json")
    parser.add_argument("--devices", type=int, default=8, help="devices the model is split over")
    parser.add_argument("--batch", type=int, default=32, help="rows of the cache")
    parser.add_argument("--seq-len", type=int, default=4096, help="positions of the cache")
    parser.add_argument("--prefill-chunk", type=int, default=4096, help="tokens per row per prefill call")
    parser.add_argument("--device-gib", type=float, default=143771 / 1024, help="memory of one device (H200: 143771 MiB)")
    parser.add_argument("--out", help="write the plan as markdown here")
    opts = parser.parse_args(argv)
    for flag in ("devices", "batch", "seq_len", "prefill_chunk"):
        if getattr(opts, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(opts, flag)}")

    args = ModelArgs.from_file(opts.config).replace(max_batch_size=opts.batch, max_seq_len=opts.seq_len)
    if args.gate_bias is None:  # a Hugging Face config states it; the reference's rule otherwise
        args = args.replace(gate_bias=args.score_func == "sigmoid")
    weights = parameter_bytes_per_device(abstract_state(args, jax.numpy.bfloat16), opts.devices)
    cache = {name: math.prod(shape) * 2 for name, shape in cache_shapes(args, "absorb", opts.batch, opts.seq_len).items()}
    acts = activation_bytes(args, opts.devices, opts.batch, opts.prefill_chunk, opts.seq_len, 2)
    total = sum(weights.values()) + sum(cache.values()) + sum(acts.values())
    lines = [f"# Memory plan: {Path(opts.config).name}, {args.dtype} weights (fp8 block scales with their weights), {opts.devices} devices, "
             f"batch {opts.batch} x {opts.seq_len}", "",
             f"Per device (TP over heads/hidden/vocab, EP over {args.n_routed_experts} experts: "
             f"{args.n_routed_experts // opts.devices} each); absorbed-MLA cache replicated as in the reference.", "",
             "| item | GiB per device |", "|---|---|"]
    for name, value in {**weights, **{f"cache {k}": v for k, v in cache.items()}, **acts}.items():
        lines.append(f"| {name} | {value / GIB:.2f} |")
    lines += [f"| **total (all activations live at once: an upper bound)** | **{total / GIB:.1f}** |",
              f"| device memory | {opts.device_gib:.1f} |", "",
              f"Headroom: {opts.device_gib - total / GIB:.1f} GiB. A prefill chunk of {opts.prefill_chunk} tokens "
              f"per row for all {opts.batch} rows needs the attention-score buffer above; XLA frees "
              "activations layer by layer, so the live set is one layer's, as counted."]
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        Path(opts.out).write_text(text)


if __name__ == "__main__":
    sys.exit(run_cli("memory_plan.py", main))
