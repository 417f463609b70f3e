"""The slot kernels of a MoE decode layer (DeepSeek-V3 or V2-Lite) timed alone, for a sweep of their launch settings.

    PYTHONPATH=. python3 scripts/bench_grouped_decode.py --batches 1,8 --out-dir $OUT

    PYTHONPATH=. python3 scripts/bench_grouped_decode.py --weights bf16 --shape 64,6,1408,2048 --shared-chunks 2

    PYTHONPATH=. python3 scripts/bench_grouped_decode.py --weights bf16 --shape 64,6,1408,2048 --shared-chunks 2 \
        --layout sorted --batches 256 --block-m 16,32,64

What the model's "slots" path runs at decode (`dsv3_jax/model/moe.py`): `grouped_gemm_swiglu` over each
token's routed slots plus its rows of the shared experts (`--shared-chunks` experts' worth of hidden units,
read in place from their own weight), then `grouped_gemm` for the down projection with the routing weights,
by default on DeepSeek-V3's expert stacks (256 experts of 2048 x 7168, fp8 with 128x128 block scales, one
shared expert; the second command: DeepSeek-V2-Lite's 64 experts of 1408 x 2048 in bf16, two shared). fp8
weights run two forms of the product: "fp8" (activations from act_quant on the fp8 tensor cores, gemm_impl
"fp8") and "dequant" (the weight tiles dequantized to bf16, gemm_impl "bf16"; the "fp8" time includes
act_quant's launch); bf16 weights the one form "bf16". Each timed call picks other experts (distinct input
sets, as bench_kernels.py times), so every call streams its experts from HBM; the floor is the bytes of
the distinct experts read at 4.3 TB/s. `--layout sorted` times what moe_impl "fused" runs instead (larger
batches): the (token, choice) rows sorted by expert, each token's shared rows after them, gathered from
the tokens' rows by the swiglu launch itself, the launches over group sizes, at each `--block-m`. Writes
grouped-decode-<weights>[-sorted]-<gpu>.json and .md into --out-dir.
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
    shared_chunks: int = 1  # the shared experts' hidden units, in experts of `inter`
    weights: str = "fp8"  # or "bf16"
    layout: str = "slots"  # or "sorted"

    @property
    def shared_inter(self) -> int:
        return self.shared_chunks * self.inter

    @property
    def forms(self) -> tuple[str, ...]:
        return ("fp8", "dequant") if self.weights == "fp8" else ("bf16",)


def stack(key, shape, weights: str):
    """Random values of a weight stack (..., N, K): fp8 with its block scales, or bf16 and no scales."""
    kw, ks = jax.random.split(key)
    if weights == "bf16":
        return (jax.random.normal(kw, shape, jnp.float32) * shape[-1] ** -0.5).astype(jnp.bfloat16), None
    w = (jax.random.normal(kw, shape, jnp.float32) * 64).astype(FP8_DTYPE)
    scale_shape = shape[:-2] + (shape[-2] // FP8_BLOCK, shape[-1] // FP8_BLOCK)
    return w, jnp.exp2(jax.random.uniform(ks, scale_shape, minval=-12, maxval=-4))


def weights(sh: Shape) -> dict:
    keys = jax.random.split(jax.random.key(0), 6)
    shapes = dict(w1=(sh.experts, sh.inter, sh.dim), w3=(sh.experts, sh.inter, sh.dim), w2=(sh.experts, sh.dim, sh.inter),
                  s1=(sh.shared_inter, sh.dim), s3=(sh.shared_inter, sh.dim), s2=(sh.dim, sh.shared_inter))
    return {name: stack(key, shape, sh.weights) for key, (name, shape) in zip(keys, shapes.items(), strict=True)}


def input_set(i: int, batch: int, sh: Shape) -> tuple:
    """The tokens' rows, their experts (batch, topk), the swiglu's output rows (routed slots token-major, then
    each token's shared row) and the routed slots' weights: the slots form the model runs. The sorted layout
    holds the group sizes in place of the experts, and after the weights each sorted row's token: the swiglu
    launch gathers its rows from x by them, as "fused" does."""
    rng = np.random.default_rng(i)
    experts = np.stack([rng.choice(sh.experts, sh.topk, replace=False) for _ in range(batch)]).astype(np.int32)
    x = rng.standard_normal((batch, sh.dim)).astype(jnp.bfloat16)
    h = rng.standard_normal((batch * (sh.topk + sh.shared_chunks), sh.inter)).astype(jnp.bfloat16)
    row_weights = rng.uniform(0, 1, batch * sh.topk).astype(np.float32)
    if sh.layout == "sorted":  # x's rows by expert, then the shared chunks' (chunk-major), as "fused" gathers them
        order = np.argsort(experts.reshape(-1), kind="stable")
        tokens = np.concatenate([order // sh.topk, np.tile(np.arange(batch), sh.shared_chunks)])
        row_weights = np.concatenate([row_weights[order], np.ones(batch * sh.shared_chunks, np.float32)])
        sizes = np.concatenate([np.bincount(experts.reshape(-1), minlength=sh.experts),
                                np.full(sh.shared_chunks, batch)]).astype(np.int32)
        return tuple(jax.device_put(a) for a in (x, sizes, h, row_weights, tokens.astype(np.int32)))
    return tuple(jax.device_put(a) for a in (x, experts, h, row_weights))


def kernel(form: str, which: str, w: dict, setting: dict, layout: str = "slots"):
    """fn(x, experts, h, row_weights[, x_rows]) running one of the two kernels in `form` with `setting`; in the
    sorted layout `experts` holds the group sizes and the swiglu launch gathers x's rows by x_rows."""
    def run(x, experts, h, row_weights, x_rows=None):
        x, x_rows = (x, x_rows) if which == "swiglu" else (h, None)
        x, x_scale = act_quant(x) if form == "fp8" else (x, None)
        groups = (dict(group_sizes=experts, x_rows=x_rows) if layout == "sorted"
                  else dict(group_sizes=None, slot_experts=experts))
        if which == "swiglu":
            return grouped_gemm_swiglu(x, w["w1"][0], w["w3"][0], w1_scale=w["w1"][1], w3_scale=w["w3"][1], **groups,
                                       shared_w1=w["s1"][0], shared_w3=w["s3"][0], shared_w1_scale=w["s1"][1],
                                       shared_w3_scale=w["s3"][1], x_scale=x_scale, out_dtype=jnp.bfloat16,
                                       **setting)
        return grouped_gemm(x, w["w2"][0], w_scale=w["w2"][1], **groups, row_scale=row_weights,
                            shared_w=w["s2"][0], shared_w_scale=w["s2"][1], x_scale=x_scale, **setting)
    return run


def settings(block_ms, block_ns, warps, stages) -> list[dict]:
    return [dict(block_m=m, block_n=n, num_warps=nw, num_stages=st)
            for m, n, nw, st in itertools.product(block_ms, block_ns, warps, stages)]


def sweep(w: dict, batch: int, grid: list[dict], max_sets: int, sh: Shape, forms: tuple[str, ...] = ()) -> list[dict]:
    """Each kernel in each of `forms` (default: every form of the weights) at each setting of `grid`."""
    itemsize = 1 if sh.weights == "fp8" else 2
    routed_bytes = min(batch * sh.topk, sh.experts) * sh.inter * sh.dim * itemsize  # distinct experts, at most
    out = []
    for which, weights_read in (("swiglu", 2), ("down", 1)):
        moved = weights_read * (routed_bytes + sh.shared_inter * sh.dim * itemsize)
        for form, setting in itertools.product(forms or sh.forms, grid):
            try:
                t = time_op(kernel(form, which, w, setting, sh.layout), lambda i: input_set(i, batch, sh), moved,
                            moved / HBM, max_sets)
            except Exception as e:  # a setting the compiler refuses (shared memory, registers)
                out.append(dict(batch=batch, kernel=which, form=form, **setting, error=str(e).splitlines()[0][:200]))
                continue
            out.append(dict(batch=batch, kernel=which, form=form, **setting, us=t["s"] * 1e6, spread=t["spread"],
                            floor_us=moved / HBM * 1e6, sets=t["sets"]))
            print(json.dumps(out[-1]), flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| batch | kernel | form | block_m | block_n | warps | stages | us | floor us | of floor |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted((r for r in rows if "us" in r), key=lambda r: (r["batch"], r["kernel"], r["form"], r["us"])):
        lines.append(f"| {r['batch']} | {r['kernel']} | {r['form']} | {r['block_m']} | {r['block_n']} | "
                     f"{r['num_warps']} | {r['num_stages']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['floor_us'] / r['us']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--layout", choices=("slots", "sorted"), default="slots",
                   help='the rows as "slots" runs them (a row a slot) or as "fused" does (sorted by expert)')
    p.add_argument("--block-m", default="16", help="row tiles (the slots layout: the shared rows' tiles)")
    p.add_argument("--block-n", default="16,32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3,4,6")
    p.add_argument("--max-sets", type=int, default=24)
    p.add_argument("--shape", default="", help="experts,topk,inter,dim (default: DeepSeek-V3's 256,8,2048,7168)")
    p.add_argument("--shared-chunks", type=int, default=1, help="the shared experts' hidden units / inter")
    p.add_argument("--weights", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--forms", default="", help='fp8 weights\' forms to time: "fp8", "dequant" (default both)')
    p.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks"))
    o = p.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    sh = Shape(*(ints(o.shape) if o.shape else ()), shared_chunks=o.shared_chunks, weights=o.weights, layout=o.layout)
    w = weights(sh)
    grid = settings(ints(o.block_m), ints(o.block_n), ints(o.warps), ints(o.stages))
    forms = tuple(f for f in o.forms.split(",") if f)
    if set(forms) - set(sh.forms):
        p.error(f"--forms {o.forms}: {sh.weights} weights run {', '.join(sh.forms)}")
    rows = [r for b in ints(o.batches) for r in sweep(w, b, grid, o.max_sets, sh, forms)]
    gpu = jax.devices()[0].device_kind.lower().replace("nvidia ", "").replace(" ", "-")
    name = f"grouped-decode-{sh.weights}{'' if sh.layout == 'slots' else '-sorted'}-{gpu}"
    out = Path(o.out_dir)
    (out / f"{name}.json").write_text(json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows), indent=1))
    (out / f"{name}.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
