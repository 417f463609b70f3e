"""generate()'s decode speed with and without this revision's decode kernels, in ONE process on the same weights.

    python scripts/bench_decode_kernels.py --batches 1,8 --out benchmarks/decode-kernels-h200.json

Variants (rounds interleaved, as `bench_generate_ab.py` does; median over the rounds after a compiling one):
  before  router "xla", the shared experts apart (XLA's GEMMs), wkv_b's absorptions in XLA
  fused   router "auto" (the kernel) and the shared experts inside the routed experts' slot kernels
  new     fused, plus wkv_b's absorptions in the MLA decode kernels (the defaults)
wkv_b's XLA absorption (the fallback for shapes the kernels do not take) is reached by turning
`MLA._absorbs_in_kernels` off while a variant's steps trace; distinct `prefill_chunk` values (prompts
are shorter than any) keep the variants' compiled steps apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

import dsv3_jax
from dsv3_jax.api import Model
from dsv3_jax.config import ModelArgs
from dsv3_jax.model.attention import MLA
from bench_generate_ab import decode_rate

VARIANTS = {"before": (dict(router="xla", fuse_shared_experts=False, prefill_chunk=8192), False),
            "fused": (dict(router="auto", fuse_shared_experts=True, prefill_chunk=4096), False),
            "new": (dict(router="auto", fuse_shared_experts=True, prefill_chunk=2048), True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/config_16B.json"))
    p.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    o = p.parse_args()
    args = ModelArgs.from_file(o.config).replace(max_batch_size=max(o.batches), max_seq_len=1024)
    base = dsv3_jax.build(args)
    models = {name: Model(base.args, base.graphdef, base.state, base.mesh,
                          dataclasses.replace(base.options, **options), layout=base.layout)
              for name, (options, _) in VARIANTS.items()}
    in_kernels = MLA._absorbs_in_kernels
    pool = np.random.default_rng(0).integers(2, args.vocab_size, (16, 128)).tolist()
    results = []
    for batch in o.batches:
        rates = {name: [] for name in VARIANTS}
        for r in range(o.rounds + 1):
            for name, (_, kernels) in VARIANTS.items():
                MLA._absorbs_in_kernels = in_kernels if kernels else (lambda self, dtype: False)
                rate = decode_rate(models[name], pool, batch, o.new_tokens, r, False)
                if r:  # round 0 compiles
                    rates[name].append(rate)
        MLA._absorbs_in_kernels = in_kernels
        for name, (options, kernels) in VARIANTS.items():
            results.append({"batch": batch, "variant": name, "options": options, "absorb_in_kernels": kernels,
                            "ms_per_step": 1e3 * batch / float(np.median(rates[name])), "tok_s": rates[name]})
        print(f"b={batch}: " + ", ".join(f"{x['variant']} {x['ms_per_step']:.3f} ms" for x in results[-len(VARIANTS):]),
              flush=True)
    if o.out:
        o.out.write_text(json.dumps({"model": str(o.config), "results": results}, indent=1))


if __name__ == "__main__":
    main()
