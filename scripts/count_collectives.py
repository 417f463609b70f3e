"""Collectives per layer of a decode step, per layout, counted in the step's HLO.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python scripts/count_collectives.py --num-devices 2

A tiny random V3-shaped model (`--config` for another) is built with its layer scans unrolled
for three depths: (1 dense, 1 MoE), (2, 1) and (1, 2) layers; the differences of their counts
are the collectives of one dense layer and of one MoE layer, the rest those of the step (the
embedding, the head, moving rows in and out). Counts come from the lowered program (StableHLO:
what the model asks for) and from the compiled one (HLO after XLA's passes, on this backend).
"""
from __future__ import annotations

import argparse
import collections
import json
import re

import jax
import numpy as np

import dsv3_jax
from dsv3_jax.api import _abstract
from dsv3_jax.config import ModelArgs
from dsv3_jax.sharding import PRESETS, make_mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COMPILED = re.compile(r"\b(" + "|".join(KINDS) + r")(?:-start)?\(")
_LOWERED = re.compile(r"\bstablehlo\.(" + "|".join(k.replace("-", "_") for k in KINDS) + r")\b")

TINY = dict(vocab_size=256, dim=128, inter_dim=256, moe_inter_dim=64, n_heads=4, n_routed_experts=8,
            n_shared_experts=1, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1, score_func="sigmoid",
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            max_batch_size=8, max_seq_len=64)


def collective_counts(text: str) -> dict[str, int]:
    """Collective ops of each kind (`KINDS`) in an HLO or StableHLO module's text (an async
    collective's start counted once, its done not)."""
    found = collections.Counter(m.replace("_", "-") for m in _COMPILED.findall(text) + _LOWERED.findall(text))
    return {kind: found.get(kind, 0) for kind in KINDS}


def zero_model(args: ModelArgs, layout: str, num_devices: int) -> dsv3_jax.Model:
    """The model of `args` with its layer scans unrolled and every weight zero: the program of
    `dsv3_jax.build`'s model without compiling its random initialisation."""
    if args.gate_bias is None:
        args = args.replace(gate_bias=args.score_func == "sigmoid")  # as `build` decides it
    options = dsv3_jax.RunOptions(compute_dtype="float32", layout=layout, unroll=True)
    graphdef, abstract = _abstract(args, options)
    state = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    return dsv3_jax.Model(args, graphdef, state, make_mesh(num_devices), options)


def step_counts(args: ModelArgs, layout: str, num_devices: int, batch: int, compiled: bool = True) -> tuple:
    """(lowered, compiled) collective counts of one decode step of `batch` rows (compiled: only
    when `compiled`)."""
    model = zero_model(args, layout, num_devices)
    zeros = np.zeros((batch,), np.int32)
    lowered = model.step.lower(model.state, model.cache, np.zeros((batch, 1), np.int32), zeros, zeros, kv_len=64)
    return (collective_counts(lowered.as_text()),) + ((collective_counts(lowered.compile().as_text()),)
                                                      if compiled else ())


def per_layer_counts(base: ModelArgs, layout: str, num_devices: int, batch: int, compiled: bool = True) -> dict:
    """{"lowered"|"compiled": {"dense layer"|"moe layer"|"step": {kind: count}}} (no "compiled"
    unless `compiled`)."""
    depths = {(1, 1): None, (2, 1): None, (1, 2): None}
    for dense, moe in depths:
        depths[dense, moe] = step_counts(base.replace(n_layers=dense + moe, n_dense_layers=dense), layout,
                                         num_devices, batch, compiled)
    out = {}
    for which, stage in enumerate(("lowered", "compiled")[:2 if compiled else 1]):
        one = depths[1, 1][which]
        dense = {k: depths[2, 1][which][k] - one[k] for k in KINDS}
        moe = {k: depths[1, 2][which][k] - one[k] for k in KINDS}
        step = {k: one[k] - dense[k] - moe[k] for k in KINDS}
        out[stage] = {"dense layer": dense, "moe layer": moe, "step": step}
    return out


def brief(counts: dict[str, int]) -> str:
    parts = [f"{n} {kind}" for kind, n in counts.items() if n]
    return ", ".join(parts) if parts else "none"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a reference or Hugging Face JSON (default: a tiny V3-shaped model)")
    parser.add_argument("--num-devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="rows of the decode step")
    parser.add_argument("--layouts", default=",".join(PRESETS))
    parser.add_argument("--out", help="write the counts as JSON here")
    opts = parser.parse_args(argv)
    base = ModelArgs.from_file(opts.config) if opts.config else ModelArgs(**TINY)
    base = base.replace(max_batch_size=max(base.max_batch_size, opts.batch), max_seq_len=64)
    results = {}
    print(f"collectives of a decode step of {opts.batch} rows on {opts.num_devices} devices (lowered | compiled)")
    for layout in opts.layouts.split(","):
        results[layout] = counts = per_layer_counts(base, layout, opts.num_devices, opts.batch)
        for part in ("dense layer", "moe layer", "step"):
            print(f"  {layout:9s} {part:11s}: {brief(counts['lowered'][part])} | {brief(counts['compiled'][part])}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"devices": opts.num_devices, "batch": opts.batch, "counts": results}, f, indent=2)


if __name__ == "__main__":
    main()
