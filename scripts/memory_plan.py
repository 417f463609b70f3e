"""Bytes per device for a DeepSeek config split over N devices by each layout (dsv3_jax.sharding):
weights, fp8 block scales, the absorbed-MLA cache and the largest activations of a prefill chunk.

    python scripts/memory_plan.py --config config_671B.json --devices 8 --batch 32 --seq-len 4096
    python scripts/memory_plan.py --config config_671B.json --layouts tp,dp-attn

--config takes a reference JSON or a Hugging Face config.json; --layouts a comma list of the
layouts (default: all), one column each.

Counts come from the model's own parameter shapes and logical axes, split as each layout's rules
say (an abstract model, no memory is allocated), so the plan follows the code.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import jax

from dsv3_jax.model.cache import cache_shapes
from dsv3_jax.cli.common import ArgumentParser, run_cli
from dsv3_jax.config import ModelArgs
from dsv3_jax.checkpoint.schema import abstract_state
from dsv3_jax.sharding import DEFAULT_AXES, PRESETS, Layout, parameter_bytes_per_device

GIB = 2**30


def activation_bytes(args: ModelArgs, layout: Layout, batch: int, chunk: int, kv_len: int, act_bytes: int) -> dict:
    """The largest live tensors of one prefill chunk of (batch, chunk) tokens on one device."""
    rows = layout.padded_batch(batch) // layout.size("batch")  # this device's rows
    gathered, _ = layout.reduction("experts", "expert_ffn")
    moe_rows = rows * math.prod(layout.mesh_shape[layout.mesh_axes.index(a)] for a in gathered)
    heads = args.n_heads // layout.size("heads")
    return {
        "hidden state (x2: residual + branch)": 2 * rows * chunk * args.dim * act_bytes,
        "attention scores (float32)": rows * chunk * heads * kv_len * 4,
        "q in latent space": rows * chunk * heads * args.kv_lora_rank * act_bytes,
        "routed rows + expert hidden (x3)": moe_rows * chunk * args.n_activated_experts
        * (args.dim + 3 * args.moe_inter_dim) * act_bytes,
        "logits (float32, full vocab)": rows * args.vocab_size * 4,
    }


def cache_bytes(args: ModelArgs, layout: Layout, batch: int, seq_len: int) -> dict:
    """Bytes of the absorbed-MLA cache on one device (rows split as the layout splits the batch)."""
    shapes = cache_shapes(args, "absorb", layout.padded_batch(batch) // layout.size("batch"), seq_len)
    return {f"cache {name}": math.prod(shape) * 2 for name, shape in shapes.items()}


def plan(args: ModelArgs, layout: Layout, batch: int, seq_len: int, chunk: int) -> dict[str, float]:
    """item -> bytes on one device."""
    weights = parameter_bytes_per_device(abstract_state(args, jax.numpy.bfloat16), layout)
    return {**weights, **cache_bytes(args, layout, batch, seq_len),
            **activation_bytes(args, layout, batch, chunk, seq_len, 2)}


def main(argv=None) -> None:
    parser = ArgumentParser(prog="memory_plan.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="model config: a reference JSON or a Hugging Face config.json")
    parser.add_argument("--devices", type=int, default=8, help="devices the model is split over")
    parser.add_argument("--layouts", default=",".join(PRESETS), help=f"a comma list of {','.join(PRESETS)}")
    parser.add_argument("--batch", type=int, default=32, help="rows of the cache")
    parser.add_argument("--seq-len", type=int, default=4096, help="positions of the cache")
    parser.add_argument("--prefill-chunk", type=int, default=4096, help="tokens per row per prefill call")
    parser.add_argument("--device-gib", type=float, default=143771 / 1024,
                        help="memory of one device (H200: 143771 MiB)")
    parser.add_argument("--out", help="write the plan as markdown here")
    opts = parser.parse_args(argv)
    for flag in ("devices", "batch", "seq_len", "prefill_chunk"):
        if getattr(opts, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(opts, flag)}")
    names = [n for n in opts.layouts.split(",") if n]
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        parser.error(f"--layouts: {unknown[0] if unknown else opts.layouts!r} is not among {', '.join(PRESETS)}")

    args = ModelArgs.from_file(opts.config).replace(max_batch_size=opts.batch, max_seq_len=opts.seq_len)
    if args.gate_bias is None:  # a Hugging Face config states it; the reference's rule otherwise
        args = args.replace(gate_bias=args.score_func == "sigmoid")
    layouts = [Layout.preset(n, DEFAULT_AXES[1], (opts.devices,)) for n in names]
    plans = [plan(args, layout, opts.batch, opts.seq_len, opts.prefill_chunk) for layout in layouts]
    items = list(dict.fromkeys(item for p in plans for item in p))
    totals = [sum(p.values()) for p in plans]
    lines = [f"# Memory plan: {Path(opts.config).name}, {args.dtype} weights (fp8 block scales with their weights), "
             f"{opts.devices} devices, batch {opts.batch} x {opts.seq_len}", "",
             "GiB per device for each layout (dsv3_jax.sharding.PRESETS): "
             + "; ".join(f"{n}: " + ", ".join(f"{k} {getattr(lay, k)}" for k in ("attention", "experts", "mlp", "head"))
                         for n, lay in zip(names, layouts)) + ".", "",
             "| item | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for item in items:
        lines.append(f"| {item} | " + " | ".join(f"{p.get(item, 0.0) / GIB:.2f}" for p in plans) + " |")
    lines += ["| **total (all activations live at once: an upper bound)** | "
              + " | ".join(f"**{t / GIB:.1f}**" for t in totals) + " |",
              f"| headroom of {opts.device_gib:.1f} GiB | "
              + " | ".join(f"{opts.device_gib - t / GIB:.1f}" for t in totals) + " |", "",
              f"A prefill chunk of {opts.prefill_chunk} tokens per row for all {opts.batch} rows needs the "
              "attention-score buffer above; XLA frees activations layer by layer, so the live set is one layer's, "
              "as counted."]
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        Path(opts.out).write_text(text)


if __name__ == "__main__":
    sys.exit(run_cli("memory_plan.py", main))
