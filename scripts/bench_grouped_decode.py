"""The slot kernels of a V3 MoE decode layer timed alone, for a sweep of their launch settings.

    PYTHONPATH=. python3 scripts/bench_grouped_decode.py --batches 1,8 --out-dir $OUT

What the model's "slots" path runs at decode (`dsv3_jax/model/moe.py`): `grouped_gemm_swiglu` over each
token's 8 routed slots plus its row of the shared expert (2048 hidden units, read in place from its
own weight), then `grouped_gemm` for the down projection with the routing weights, on DeepSeek-V3's
expert stacks (256 experts of 2048 x 7168, fp8 with 128x128 block scales). Two forms of the product:
"fp8" (activations from act_quant on the fp8 tensor cores, gemm_impl "fp8") and "dequant" (the weight
tiles dequantized to bf16, gemm_impl "bf16"; the "fp8" time includes act_quant's launch). Each timed call picks other experts (distinct input
sets, as bench_kernels.py times), so every call streams its experts from HBM; the floor is the bytes of
the distinct experts read at 4.3 TB/s. Writes grouped-decode-<gpu>.json and .md into --out-dir.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench_kernels import HBM, time_op
from pallas_kernels import FP8_BLOCK, FP8_DTYPE, act_quant, grouped_gemm, grouped_gemm_swiglu



@dataclasses.dataclass(frozen=True)
class Shape:
    experts: int = 256
    topk: int = 8
    inter: int = 2048  # an expert's hidden units, also the shared expert's
    dim: int = 7168


def stack(key, shape):
    """Random fp8 values and block scales of a weight stack (..., N, K)."""
    kw, ks = jax.random.split(key)
    w = (jax.random.normal(kw, shape, jnp.float32) * 64).astype(FP8_DTYPE)
    scale_shape = shape[:-2] + (shape[-2] // FP8_BLOCK, shape[-1] // FP8_BLOCK)
    return w, jnp.exp2(jax.random.uniform(ks, scale_shape, minval=-12, maxval=-4))


def weights(sh: Shape) -> dict:
    keys = jax.random.split(jax.random.key(0), 6)
    return dict(w1=stack(keys[0], (sh.experts, sh.inter, sh.dim)), w3=stack(keys[1], (sh.experts, sh.inter, sh.dim)),
                w2=stack(keys[2], (sh.experts, sh.dim, sh.inter)), s1=stack(keys[3], (sh.inter, sh.dim)),
                s3=stack(keys[4], (sh.inter, sh.dim)), s2=stack(keys[5], (sh.dim, sh.inter)))


def input_set(i: int, batch: int, sh: Shape) -> tuple:
    """The tokens' rows, their experts (batch, topk), the swiglu's output rows (routed slots token-major, then
    each token's shared row) and the routed slots' weights: the slots form the model runs."""
    rng = np.random.default_rng(i)
    experts = np.stack([rng.choice(sh.experts, sh.topk, replace=False) for _ in range(batch)]).astype(np.int32)
    x = rng.standard_normal((batch, sh.dim)).astype(jnp.bfloat16)
    h = rng.standard_normal((batch * (sh.topk + 1), sh.inter)).astype(jnp.bfloat16)
    row_weights = rng.uniform(0, 1, batch * sh.topk).astype(np.float32)
    return tuple(jax.device_put(a) for a in (x, experts, h, row_weights))


def kernel(form: str, which: str, w: dict, setting: dict):
    """fn(x, experts, h, row_weights) running one of the two slot kernels in `form` with `setting`."""
    def run(x, experts, h, row_weights):
        x = x if which == "swiglu" else h
        x, x_scale = act_quant(x) if form == "fp8" else (x, None)
        if which == "swiglu":
            return grouped_gemm_swiglu(x, w["w1"][0], w["w3"][0], None, w["w1"][1], w["w3"][1], slot_experts=experts,
                                       shared_w1=w["s1"][0], shared_w3=w["s3"][0], shared_w1_scale=w["s1"][1],
                                       shared_w3_scale=w["s3"][1], x_scale=x_scale, out_dtype=jnp.bfloat16,
                                       **setting)
        return grouped_gemm(x, w["w2"][0], None, w["w2"][1], slot_experts=experts, row_scale=row_weights,
                            shared_w=w["s2"][0], shared_w_scale=w["s2"][1], x_scale=x_scale, **setting)
    return run


def settings(block_ns, warps, stages) -> list[dict]:
    return [dict(block_m=16, block_n=n, num_warps=nw, num_stages=st) for n, nw, st in itertools.product(block_ns, warps, stages)]


def sweep(w: dict, batch: int, grid: list[dict], max_sets: int, sh: Shape) -> list[dict]:
    routed_bytes = min(batch * sh.topk, sh.experts) * sh.inter * sh.dim  # distinct experts, at most (a byte each)
    out = []
    for which, weights_read in (("swiglu", 2), ("down", 1)):
        moved = weights_read * (routed_bytes + sh.inter * sh.dim)
        for form, setting in itertools.product(("fp8", "dequant"), grid):
            try:
                t = time_op(kernel(form, which, w, setting), lambda i: input_set(i, batch, sh), moved, moved / HBM,
                            max_sets)
            except Exception as e:  # a setting the compiler refuses (shared memory, registers)
                out.append(dict(batch=batch, kernel=which, form=form, **setting, error=str(e).splitlines()[0][:200]))
                continue
            out.append(dict(batch=batch, kernel=which, form=form, **setting, us=t["s"] * 1e6, spread=t["spread"],
                            floor_us=moved / HBM * 1e6, sets=t["sets"]))
            print(json.dumps(out[-1]), flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| batch | kernel | form | block_n | warps | stages | us | floor us | of floor |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted((r for r in rows if "us" in r), key=lambda r: (r["batch"], r["kernel"], r["form"], r["us"])):
        lines.append(f"| {r['batch']} | {r['kernel']} | {r['form']} | {r['block_n']} | {r['num_warps']} | "
                     f"{r['num_stages']} | {r['us']:.1f} | {r['floor_us']:.1f} | {r['floor_us'] / r['us']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--block-n", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3,4,6")
    p.add_argument("--max-sets", type=int, default=24)
    p.add_argument("--shape", default="", help="experts,topk,inter,dim (default: DeepSeek-V3's 256,8,2048,7168)")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks"))
    o = p.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    sh = Shape(*ints(o.shape)) if o.shape else Shape()
    w = weights(sh)
    grid = settings(ints(o.block_n), ints(o.warps), ints(o.stages))
    rows = [r for b in ints(o.batches) for r in sweep(w, b, grid, o.max_sets, sh)]
    name = "grouped-decode-" + jax.devices()[0].device_kind.lower().replace("nvidia ", "").replace(" ", "-")
    out = Path(o.out_dir)
    (out / f"{name}.json").write_text(json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows), indent=1))
    (out / f"{name}.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
