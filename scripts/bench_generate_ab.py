"""generate()'s decode speed under several RunOptions variants, measured in ONE process on the same weights.

Each variant is a `Model` on the first one's weights (no copy) with its own cache and compiled steps; the
rounds interleave the variants, so host noise (which moves a small model's step by tens of percent from one
process to the next) falls on all of them alike. Reports decode tokens/s (`Timing`; the prefill excluded),
median over the rounds after a compiling round.

    python scripts/bench_generate_ab.py --demo --batches 1,8 --variants off,on        # the shipped demo
    python scripts/bench_generate_ab.py --config configs/config_16B.json --batches 1,8 --variants off,on

Variants: off / on (`decode_graph`), unroll (`unroll=True`), router-xla / router-kernel (`router`),
shared-apart / shared-fused (`fuse_shared_experts`). --demo also times mtp=True on held-out prompts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

import dsv3_jax
from dsv3_jax.api import Model
from dsv3_jax.config import ModelArgs
from dsv3_jax.decode.generate import Timing, generate

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"off": {"decode_graph": "off"}, "on": {"decode_graph": "on"}, "unroll": {"unroll": True},
            "router-xla": {"router": "xla"}, "router-kernel": {"router": "kernel"},
            "shared-apart": {"fuse_shared_experts": False}, "shared-fused": {"fuse_shared_experts": True}}


def heldout_prompts(demo: Path, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread over the corpus' evaluation files (as bench_mtp.py takes them)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from fidelity_demo import sibling_script
    from dsv3_jax.tokenizer import Tokenizer

    eval_demo, tokenizer = sibling_script("eval_demo"), Tokenizer.from_dir(demo)
    texts = eval_demo.read_eval_texts(ROOT / "data" / "pycorpus")
    stream = np.concatenate([eval_demo.domain_stream(tokenizer, texts[d]) for d in eval_demo.DOMAINS if texts[d]])
    return [stream[s:s + length].astype(int).tolist() for s in np.linspace(0, len(stream) - length, count).astype(int)]


def decode_rate(model, pool, batch: int, new_tokens: int, round_index: int, mtp: bool) -> float:
    prompts = [pool[(round_index * batch + i) % len(pool)] for i in range(batch)]
    timing = Timing()
    generate(model, prompts, new_tokens, None, 0.0, timing=timing, mtp=mtp)
    return timing.decode_tokens / timing.decode_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", action="store_true", help="the shipped demo model (with its MTP layer)")
    p.add_argument("--config", type=Path, help="a config for random weights (without --demo)")
    p.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    p.add_argument("--variants", type=lambda t: t.split(","), default=["off", "on"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    o = p.parse_args()
    if not o.demo and o.config is None:
        p.error("give --demo or --config")
    unknown = set(o.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    if o.demo:
        demo = Path(dsv3_jax.__file__).parent / "assets" / "demo"
        base = dsv3_jax.load(demo, mtp=True, max_batch_size=max(o.batches), **VARIANTS[o.variants[0]])
        pool = heldout_prompts(demo, 16, 128)
    else:
        args = ModelArgs.from_file(o.config).replace(max_batch_size=max(o.batches), max_seq_len=1024)
        base = dsv3_jax.build(args, **VARIANTS[o.variants[0]])
        pool = np.random.default_rng(0).integers(2, base.args.vocab_size, (16, 128)).tolist()
    models = {name: Model(base.args, base.graphdef, base.state, base.mesh,
                          dataclasses.replace(base.options, **VARIANTS[name]), layout=base.layout)
              for name in o.variants[1:]}
    models = {o.variants[0]: base, **models}
    results = []
    for batch in o.batches:
        for mtp in ([False, True] if o.demo else [False]):
            rates = {name: [] for name in models}
            for r in range(o.rounds + 1):
                for name, model in models.items():
                    rate = decode_rate(model, pool, batch, o.new_tokens, r, mtp)
                    if r:  # round 0 compiles
                        rates[name].append(rate)
            for name, values in rates.items():
                results.append({"batch": batch, "mtp": mtp, "variant": name, "decode_tok_s": float(np.median(values)),
                                "ms_per_step_row": 1e3 * batch / float(np.median(values))})
            print(f"b={batch} {'mtp' if mtp else 'plain'}: " + ", ".join(
                f"{r['variant']} {r['decode_tok_s']:.0f} tok/s ({r['ms_per_step_row']:.3f} ms a token per row)"
                for r in results[-len(models):]), flush=True)
    if o.out:
        o.out.write_text(json.dumps({"model": "demo" if o.demo else str(o.config), "results": results}, indent=1))


if __name__ == "__main__":
    main()
