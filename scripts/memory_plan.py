"""Bytes per device for a DeepSeek config split over N devices by each layout (dsv3_jax.sharding):
weights, the cache and the working set of a prefill chunk, as `dsv3_jax.memory` plans them.

    python scripts/memory_plan.py --config config_671B.json --devices 8 --batch 32 --seq-len 4096
    python scripts/memory_plan.py --config config_671B.json --layouts tp,dp-attn --batch 1,8 --seq-len 131072

--config takes a reference JSON or a Hugging Face config.json; --layouts a comma list of the
layouts (default: all), one column each; --batch a comma list of batch sizes (one table each).

Counts come from the model's own parameter shapes and logical axes, split as each layout's rules
say (an abstract model, no memory is allocated): the same plan `dsv3_jax.load` and `dsv3_jax.build`
check before they allocate anything.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dsv3_jax.cli.common import ArgumentParser, run_cli
from dsv3_jax.config import ModelArgs
from dsv3_jax.memory import GIB, fitting, largest, peak_bytes, plan, weight_bytes
from dsv3_jax.options import RunOptions, choices
from dsv3_jax.sharding import DEFAULT_AXES, PRESETS, Layout

LONGEST = 1 << 22  # the largest max_seq_len searched for
WIDEST = 1 << 12  # the largest max_batch_size searched for


def parse_args(argv):
    parser = ArgumentParser(prog="memory_plan.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="model config: a reference JSON or a Hugging Face config.json")
    parser.add_argument("--devices", type=int, default=8, help="devices the model is split over")
    parser.add_argument("--layouts", default=",".join(PRESETS), help=f"a comma list of {','.join(PRESETS)}")
    parser.add_argument("--batch", default="32", help="rows of the cache (max_batch_size); a comma list: a table each")
    parser.add_argument("--seq-len", type=int, default=4096, help="positions of the cache (max_seq_len)")
    parser.add_argument("--prefill-chunk", type=int, default=RunOptions.prefill_chunk, choices=choices("prefill_chunk"),
                        help="tokens per row per prefill step (RunOptions.prefill_chunk)")
    parser.add_argument("--attn-impl", default=RunOptions.attn_impl, choices=choices("attn_impl"),
                        help="MLA: the absorbed latent cache or per-head keys and values (RunOptions.attn_impl)")
    parser.add_argument("--dtype", default=RunOptions.compute_dtype, choices=choices("compute_dtype"),
                        help="activations, cache and non-fp8 weights (RunOptions.compute_dtype)")
    parser.add_argument("--mtp", action="store_true", help="with the multi-token-prediction layer and its cache")
    parser.add_argument("--device-gib", type=float, default=143771 / 1024,
                        help="memory of one device (H200: 143771 MiB)")
    parser.add_argument("--out", help="write the plan as markdown here")
    opts = parser.parse_args(argv)
    try:
        opts.batches = [int(b) for b in opts.batch.split(",") if b]
    except ValueError:
        parser.error(f"--batch must be a comma list of integers, got {opts.batch!r}")
    for flag, values in (("devices", [opts.devices]), ("batch", opts.batches or [0]), ("seq-len", [opts.seq_len])):
        if min(values) < 1:
            parser.error(f"--{flag} must be at least 1, got {min(values)}")
    opts.names = [n for n in opts.layouts.split(",") if n]
    unknown = [n for n in opts.names if n not in PRESETS]
    if unknown or not opts.names:
        parser.error(f"--layouts: {unknown[0] if unknown else opts.layouts!r} is not among {', '.join(PRESETS)}")
    return opts


def table(args: ModelArgs, layouts: dict[str, Layout], options: RunOptions, batch: int, opts) -> list[str]:
    """One markdown table: GiB per device of every item, for each layout, at (batch, opts.seq_len)."""
    capacity = opts.device_gib * GIB
    plans, peaks, longest, widest = [], [], [], []
    for layout in layouts.values():
        weights = sum(weight_bytes(args, layout, options, opts.mtp).values())
        plans.append(plan(args, layout, options, batch, opts.seq_len, mtp=opts.mtp))
        peaks.append(peak_bytes(weights, args, layout, options, batch, opts.seq_len, opts.mtp))
        fits = fitting(args, layout, options, capacity, opts.mtp, weights)
        longest.append(largest(lambda s: fits(batch, s), LONGEST))
        widest.append(largest(lambda b: fits(b, opts.seq_len), WIDEST))
    items = list(dict.fromkeys(item for p in plans for item in p))
    lines = [f"## batch {batch} x {opts.seq_len}", "", "| item | " + " | ".join(layouts) + " |",
             "|---|" + "---|" * len(layouts)]
    lines += [f"| {item} | " + " | ".join(f"{p.get(item, 0.0) / GIB:.2f}" for p in plans) + " |" for item in items]
    lines += ["| **planned peak** | " + " | ".join(f"**{t / GIB:.1f}**" for t in peaks) + " |",
              f"| headroom of {opts.device_gib:.1f} GiB | "
              + " | ".join(f"{opts.device_gib - t / GIB:.1f}" for t in peaks) + " |",
              f"| largest max_seq_len at batch {batch} | " + " | ".join(_count(n, LONGEST) for n in longest) + " |",
              f"| largest batch at max_seq_len {opts.seq_len} | "
              + " | ".join(_count(n, WIDEST) for n in widest) + " |", ""]
    return lines


def _count(n: int, searched: int) -> str:
    return "none" if n == 0 else f">= {n}" if n == searched else str(n)


def main(argv=None) -> None:
    opts = parse_args(argv)
    args = ModelArgs.from_file(opts.config).replace(max_batch_size=max(opts.batches), max_seq_len=opts.seq_len)
    options = RunOptions(compute_dtype=opts.dtype, attn_impl=opts.attn_impl, prefill_chunk=opts.prefill_chunk)
    layouts = {n: Layout.preset(n, DEFAULT_AXES[1], (opts.devices,)) for n in opts.names}
    chunk = min(opts.prefill_chunk, opts.seq_len)
    lines = [f"# Memory plan: {Path(opts.config).name}, {args.dtype} weights (fp8 block scales with their weights), "
             f"{opts.devices} devices, {opts.attn_impl} cache{' + MTP layer' if opts.mtp else ''}, "
             f"max_seq_len {opts.seq_len}, prefill chunk {chunk}", "",
             "GiB per device for each layout (dsv3_jax.sharding.PRESETS): "
             + "; ".join(f"{n}: " + ", ".join(f"{k} {getattr(lay, k)}" for k in ("attention", "experts", "mlp", "head"))
                         for n, lay in layouts.items()) + ".", "",
             f"The step planned is a prefill chunk of {chunk} tokens in every row attending to all {opts.seq_len} "
             "positions, with flash attention (no score buffer). The planned peak is the weights, the cache, the "
             "step's hidden states and new cache entries, and the largest of one layer's attention, one dense "
             "layer's MLP, one layer's routed experts up to their w1 and w3 products, the rest of them (the grouped "
             "GEMMs' products are float32) and the output head (XLA frees each before the next). The largest "
             f"max_seq_len and batch are those whose planned peak fits in {opts.device_gib:.1f} GiB (--device-gib). "
             "On a GPU, `dsv3_jax.load` and `build` check against XLA's share of the device instead "
             "(`memory_stats()[\"bytes_limit\"]`, set by XLA_PYTHON_CLIENT_MEM_FRACTION, 75 % by default).", ""]
    for batch in opts.batches:
        lines += table(args, layouts, options, batch, opts)
    flags = list(sys.argv[1:] if argv is None else argv)
    if "--out" in flags:
        del flags[flags.index("--out"):flags.index("--out") + 2]
    lines += [f"Made by `python scripts/memory_plan.py {' '.join(flags)}`.", ""]
    text = "\n".join(lines)
    print(text)
    if opts.out:
        Path(opts.out).write_text(text)


if __name__ == "__main__":
    sys.exit(run_cli("memory_plan.py", main))
