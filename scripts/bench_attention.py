"""Benchmark causal MLA prefill attention on one GPU: the Mosaic GPU flash kernel beside its jnp twin,
the materialised XLA path and cuDNN (v padded to d_qk), with the bf16 peak printed next to every figure.

    PYTHONPATH=. python3 scripts/bench_attention.py [--out-dir DIR] [--sizes 4096x16,32768x128] [--tiles SPEC]

Shapes: batch 1, one prompt of S tokens attending to itself (T = S, positions 0..S-1), H heads,
d_qk 192, d_v 128 (DeepSeek-V2-Lite H=16, V3 H=128), bf16. FLOPs counted: the visible (query, key)
pairs only, 2 * H * (d_qk + d_v) * S (S + 1) / 2 (the two GEMMs, Q K^T and P V; the exps are not
counted), so a kernel that computed the masked half too gains nothing. The floor is FLOPs / 790e12
(the H200's bf16 dense peak). Paths:
  * mosaic: `flash_attention(impl="mosaic")` (and each --tiles variant);
  * twin: `flash_attention_ref` compiled by XLA on the GPU (the portable path);
  * xla-dense: `attention_dense_ref`, the (B, S, H, T) float32 scores materialised (the model's
    attention today), where three such tensors fit in 100 GB;
  * cudnn-pad: `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)` with v
    zero-padded to 192 (cuDNN refuses d_v != d_qk), then sliced; FLOPs counted as above.
Timing: warm-up (compile) then 7 samples, each enough back-to-back calls to last >= 50 ms;
median seconds per call. Writes flash-attention-<gpu>.json and .md into --out-dir after every row.
--smoke: tiny shapes on any backend (on a CPU the kernel runs interpreted), a dry run of the script.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import FlashTiles, flash_attention
from pallas_kernels.flash_attention import flash_attention_ref
from pallas_kernels.reference import attention_dense_ref

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = 790e12  # H200 bf16 dense tensor-core peak
D_QK, D_V = 192, 128
DENSE_BYTES_MAX = 100e9  # xla-dense runs where 3 float32 (S, H, T) tensors fit in this
DEFAULT_SIZES = "4096x16,4096x128,32768x16,32768x128"


def log(*a):
    print(*a, flush=True)


def causal_flops(s: int, heads: int) -> float:
    return 2.0 * heads * (D_QK + D_V) * s * (s + 1) / 2


def time_call(fn, args, samples: int = 7, min_sample_s: float = 0.05) -> dict:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    calls = max(1, int(min_sample_s / max(one, 1e-6)))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    med = statistics.median(times)
    return {"s": med, "spread": (max(times) - min(times)) / med, "calls": calls}


def cudnn_padded(q, k, v, positions, *, scale):
    del positions  # causal by index: positions are 0..S-1 here
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, D_QK - D_V)))
    out = jax.nn.dot_product_attention(q, k, vp, scale=scale, is_causal=True, implementation="cudnn")
    return out[..., :D_V]


def paths(s: int, heads: int, tiles: list[FlashTiles], smoke: bool) -> list[tuple[str, object]]:
    out = [("mosaic", functools.partial(flash_attention, impl="mosaic"))]
    out += [(f"mosaic {t}", functools.partial(flash_attention, impl="mosaic", tiles=t)) for t in tiles]
    out.append(("twin", flash_attention_ref))
    if 3 * s * s * heads * 4 <= DENSE_BYTES_MAX:
        out.append(("xla-dense", attention_dense_ref))
    if not smoke:
        out.append(("cudnn-pad", cudnn_padded))
    return out


def bench_size(s: int, heads: int, tiles, smoke: bool) -> list[dict]:
    keys = jax.random.split(jax.random.PRNGKey(s + heads), 3)
    q = jax.random.normal(keys[0], (1, s, heads, D_QK), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, s, heads, D_QK), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, s, heads, D_V), jnp.bfloat16)
    positions = jnp.arange(s, dtype=jnp.int32)[None]
    scale = D_QK ** -0.5
    flops = causal_flops(s, heads)
    rows, outs = [], {}
    for name, fn in paths(s, heads, tiles, smoke):
        f = jax.jit(functools.partial(fn, scale=scale))
        row = {"S": s, "T": s, "H": heads, "B": 1, "path": name, "gflop": flops / 1e9,
               "floor_ms": flops / PEAK_BF16 * 1e3}
        try:
            t = time_call(f, (q, k, v, positions), samples=1 if smoke else 7)
            outs[name] = f(q, k, v, positions)
            row.update(ms=t["s"] * 1e3, tflops=flops / t["s"] / 1e12, pct_peak=100 * flops / t["s"] / PEAK_BF16,
                       spread=t["spread"], calls=t["calls"])
        except Exception as e:  # noqa: BLE001  (a path that cannot run here is reported, not fatal)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if name != "twin" and name in outs and "twin" in outs:
            row["max_abs_diff_vs_twin"] = float(jnp.max(jnp.abs(outs[name].astype(jnp.float32)
                                                               - outs["twin"].astype(jnp.float32))))
        log(json.dumps(row))
        rows.append(row)
    if "twin" in outs:  # paths timed before the twin get their difference now
        for row in rows:
            if row["path"] in outs and row["path"] != "twin" and "max_abs_diff_vs_twin" not in row:
                row["max_abs_diff_vs_twin"] = float(jnp.max(jnp.abs(outs[row["path"]].astype(jnp.float32)
                                                                   - outs["twin"].astype(jnp.float32))))
    return rows


def markdown(rep: dict) -> str:
    lines = [f"# Causal MLA prefill attention, {rep['gpu']} ({rep['date']})", "",
             f"bf16, batch 1, T = S, d_qk {D_QK}, d_v {D_V}. FLOPs = 2 H (d_qk + d_v) S (S + 1) / 2 (visible pairs "
             f"only); floor = FLOPs / {PEAK_BF16 / 1e12:.0f} TFLOP/s. {rep['method']}", "",
             "| S | H | path | ms | TFLOP/s | % of peak | floor ms | max abs diff vs twin |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rep["rows"]:
        if "ms" in r:
            diff = f"{r['max_abs_diff_vs_twin']:.2g}" if "max_abs_diff_vs_twin" in r else "-"
            lines.append(f"| {r['S']} | {r['H']} | {r['path']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                         f"{r['pct_peak']:.0f}% | {r['floor_ms']:.3f} | {diff} |")
        else:
            lines.append(f"| {r['S']} | {r['H']} | {r['path']} | - | - | - | {r['floor_ms']:.3f} | {r['error']} |")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    v = {"jax": jax.__version__}
    for pkg in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            v[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list of SxH (default {DEFAULT_SIZES})")
    ap.add_argument("--tiles", default="", help="extra kernel tilings, ';'-separated FlashTiles fields, "
                    "e.g. 'block_kv=64,max_concurrent_steps=3'")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: a dry run of the script on any backend")
    args = ap.parse_args()
    tiles = [FlashTiles(**{k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))})
             for spec in args.tiles.split(";") if spec.strip()]
    sizes = [(256, 2)] if args.smoke else [tuple(int(x) for x in sz.split("x")) for sz in args.sizes.split(",")]
    dev = jax.devices()[0]
    rep = {"gpu": dev.device_kind, "versions": versions(), "peak_bf16_flops": PEAK_BF16,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "method": "Median over 7 samples of wall time per call (each sample >= 50 ms of back-to-back calls).",
           "rows": []}
    stem = "flash-attention-" + ("h200" if "H200" in dev.device_kind else dev.device_kind.replace(" ", "_").lower())
    stem += "-smoke" if args.smoke else ""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    for s, heads in sizes:
        rep["rows"] += bench_size(s, heads, tiles, args.smoke)
        rep["wall_s"] = time.time() - t_start
        (out / f"{stem}.json").write_text(json.dumps(rep, indent=1))
        (out / f"{stem}.md").write_text(markdown(rep))
    log(markdown(rep))


if __name__ == "__main__":
    main()
