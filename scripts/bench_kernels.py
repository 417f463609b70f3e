"""Benchmark pallas_kernels on one GPU beside XLA, with the roofline printed next to every figure.

    PYTHONPATH=. python3 scripts/bench_kernels.py [--out-dir DIR] [--sweep] [--budget-s S]

Writes kernels-<gpu>.json and kernels-<gpu>.md into --out-dir (default: $OUT if set, else
benchmarks/). Measures in the same run: copy bandwidth, XLA's bf16 and fp8 matmul peaks, then
  * act_quant on 4096x7168 bf16 (GB/s), weight_dequant on 18432x7168 (GB/s);
  * fp8_gemm for M in {1, 64, 4096} on DeepSeek-V3's (N, K) weight shapes, beside XLA's bf16
    matmul and XLA's raw fp8 dot (lax.dot_general on e4m3 operands) of the same shape;
  * part "mosaic" (--only mosaic, not run by default): fp8_gemm's Triton and Mosaic GPU kernels
    side by side (impl="triton" / "mosaic") at M in {64, 128, 512, 4096} on (18432, 7168) and
    (7168, 18432), with the kernel "auto" picks; --mosaic-sweep / --mosaic-configs add Mosaic
    tilings (at every M of --mosaic-m). With only this part the ceilings are the constants below, not measured.
  * the grouped expert GEMM (--only grouped) at prefill: V2-Lite 8x512 tokens top-6 of 64 experts
    (24,576 rows; w1/w3 (64, 1408, 2048), w2 (64, 2048, 1408)) and V3's 256 experts at 4,096 rows
    ((2048, 7168), (7168, 2048)): the Triton kernel (mma.sync) beside the Mosaic GPU one (wgmma),
    bf16 weights, float32 out, with the backend grouped_gemm picks by itself; --grouped-tiles
    sweeps the Mosaic kernel's MosaicTiles (e.g. "block_m=128,max_concurrent_steps=4;block_n=64").
Timing: one jitted program applies the op to R distinct input sets (R chosen so the sets exceed
the L2 several times and one call lasts >= ~0.3 ms, hiding dispatch), called repeatedly after a
warm-up; the median over repeats of wall time / (calls * R) is reported. --sweep also times
alternative tilings (GemmConfig, act_quant / weight_dequant tiles) and reports the best.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import (FP8_BLOCK, FP8_DTYPE as FP8, GemmConfig, MosaicTiles, act_quant, cdiv, fp8_gemm,
                            grouped_gemm, grouped_gemm_backend, reference)
from pallas_kernels import dequantize as WD, gemm as GM, quantize as AQ
from pallas_kernels.gemm_mgpu import MosaicGemmConfig, default_mosaic_config

ROOT = Path(__file__).resolve().parents[1]

HBM = 4.3e12  # measured copy bandwidth on an H200 here (bytes/s), overridden by this run's
PEAK_BF16, PEAK_FP8 = 785e12, 1400e12  # XLA on an H200 here, overridden by this run's
PEAK_BF16_SPEC = 790e12  # the bf16 dense peak the grouped GEMM's TFLOP/s are printed beside
L2 = 60e6


@dataclasses.dataclass(frozen=True)
class Sizes:
    gemm_nk: tuple = ((24576, 1536), (7168, 16384), (18432, 7168), (7168, 18432), (2048, 7168), (7168, 2048))
    gemm_m: tuple = (4096, 1, 64)  # the compute-bound target first: the sweep budget may run out
    act: tuple = (4096, 7168)
    dequant: tuple = (18432, 7168)
    peak_n: int = 8192
    copy_elems: int = 2**29
    max_sets: int = 64
    # (name, routed rows, experts, N, K, weight kinds) of the grouped expert GEMM at prefill
    grouped: tuple = (("v2lite_w13", 24_576, 64, 1408, 2048, ("bf16",)), ("v2lite_w2", 24_576, 64, 2048, 1408, ("bf16",)),
                      ("v3_w13", 4096, 256, 2048, 7168, ("bf16", "fp8")), ("v3_w2", 4096, 256, 7168, 2048, ("bf16", "fp8")))
    reps: int = 9


SMOKE = Sizes(gemm_nk=((256, 256), (130, 384)), gemm_m=(1, 20), act=(64, 256), dequant=(200, 256),
              peak_n=256, copy_elems=2**16, max_sets=2, grouped=(("tiny", 300, 4, 256, 256, ("bf16", "fp8")),),
              reps=1)  # a CPU dry run of every code path, in interpret mode


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- timing
def time_op(fn, make_set, bytes_per_op: float, floor_s: float, max_sets: int, reps: int = 9,
            mem_cap: float = 6e9) -> dict:
    """Median seconds per op of fn(*set) over R distinct input sets (see module docstring)."""
    r = math.ceil(max(3 * L2 / max(bytes_per_op, 1), 3e-4 / max(floor_s, 1e-7)))
    r = int(max(2, min(r, max_sets, mem_cap // max(bytes_per_op, 1))))
    sets = [make_set(i) for i in range(r)]
    many = jax.jit(lambda sets: [fn(*s) for s in sets])
    jax.block_until_ready(many(sets))  # compile + warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(many(sets))
    per_call = time.perf_counter() - t0
    calls = max(1, int(5e-3 / per_call))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = many(sets)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (calls * r))
    del sets, out
    return {"s": statistics.median(samples), "spread": (max(samples) - min(samples)) / statistics.median(samples),
            "sets": r, "calls": calls}


def rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def weight(key, n, k):
    kw, ks = jax.random.split(key)
    return rand(kw, (n, k), FP8, 64.0), jnp.exp2(jax.random.uniform(ks, (cdiv(n, FP8_BLOCK), k // FP8_BLOCK), minval=-12, maxval=-4))


# ---------------------------------------------------------------- ceilings
def ceilings(sz: Sizes) -> dict:
    key = jax.random.PRNGKey(0)
    copy = 0.0
    for dt in (jnp.bfloat16, jnp.float32):  # 1 and 2 GiB; the faster elementwise pass counts
        x = rand(key, (sz.copy_elems,), dt)
        t = time_op(lambda v: v * 2, lambda i: (x,) if i == 0 else (x + i,), 2 * x.nbytes, 2 * x.nbytes / HBM, 2)
        copy = max(copy, 2 * x.nbytes / t["s"])
        del x
    n = sz.peak_n
    a, b = rand(key, (n, n), jnp.bfloat16), rand(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    pairs = lambda p, q: lambda i: (p, q) if i == 0 else (q, p)  # noqa: E731  (distinct sets)
    t = time_op(lambda p, q: p @ q, pairs(a, b), 3 * n * n * 2, 2 * n**3 / PEAK_BF16, 2)
    bf16 = 2 * n**3 / t["s"]
    a8, b8 = a.astype(FP8), b.astype(FP8)
    t = time_op(xla_fp8_dot, pairs(a8, b8), 3 * n * n, 2 * n**3 / PEAK_FP8, 2)
    fp8 = 2 * n**3 / t["s"]
    return {"copy_Bps": copy, "bf16_flops": bf16, "fp8_flops": fp8}


def xla_fp8_dot(a, b):
    """XLA's own fp8 GEMM: e4m3 x e4m3^T, float32 accumulation, bf16 out (no block scales)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def xla_bf16(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)


# ---------------------------------------------------------------- act_quant / weight_dequant
def tiles_arg(text: str) -> list[tuple[int, int, int]] | None:
    return [tuple(int(v) for v in t.split("x")) for t in text.split(",")] if text else None


def bench_act_quant(sz: Sizes, sweep: bool, sweep_tiles=None) -> dict:
    m, k = sz.act
    byts = m * k * 3 + m * k // 128 * 4
    key = jax.random.PRNGKey(2)
    mk = lambda i: (rand(jax.random.fold_in(key, i), (m, k), jnp.bfloat16, 10.0),)  # noqa: E731
    res = {"shape": [m, k], "bytes": byts, "floor_us": byts / HBM * 1e6}
    tiles = [None]
    if sweep:
        tiles += sweep_tiles or [(8, 8, 4), (32, 8, 8), (4, 8, 4), (16, 4, 4), (8, 4, 2), (64, 1, 4), (2, 8, 2)]
    rows = []
    for tile in tiles:
        def fn(x, tile=tile):
            y, s = AQ._act_quant_2d(x.reshape(m, k // 128, 128), False, AQ.use_interpret(), tile)
            return y, s
        try:
            t = time_op(fn, mk, byts, byts / HBM, sz.max_sets)
        except Exception as e:  # a tile the compiler rejects: record and go on
            rows.append({"tile": tile, "error": str(e)[:300]})
            continue
        rows.append({"tile": tile or list(AQ.default_tile(m, k // 128, 2)), "default": tile is None,
                     "us": t["s"] * 1e6, "GBps": byts / t["s"] / 1e9, "spread": t["spread"]})
        log(f"act_quant tile={rows[-1]['tile']} {rows[-1]['us']:.1f} us {rows[-1]['GBps']:.0f} GB/s")
    # ue8m0 and the jnp twin under XLA, for comparison
    t = time_op(lambda x: act_quant(x, scale_fmt="ue8m0"), mk, byts, byts / HBM, sz.max_sets)
    res["ue8m0_default_us"] = t["s"] * 1e6
    t = time_op(lambda x: reference.act_quant_ref(x), mk, byts, byts / HBM, sz.max_sets)
    res["xla_twin_us"] = t["s"] * 1e6
    res["runs"] = rows
    return res


def bench_weight_dequant(sz: Sizes, sweep: bool, sweep_tiles=None) -> dict:
    m, n = sz.dequant
    byts = m * n * 3 + (m // 128) * (n // 128) * 4
    key = jax.random.PRNGKey(3)
    mk = lambda i: weight(jax.random.fold_in(key, i), m, n)  # noqa: E731
    res = {"shape": [m, n], "bytes": byts, "floor_us": byts / HBM * 1e6}
    tiles = [None]
    if sweep:
        tiles += sweep_tiles or [(32, 512, 4), (128, 256, 8), (64, 128, 4), (128, 128, 4), (32, 1024, 8),
                                 (128, 512, 8), (16, 1024, 4), (64, 512, 4)]
    rows = []
    for tile in tiles:
        try:
            t = time_op(lambda w, s, tile=tile: WD._weight_dequant(w, s, jnp.bfloat16, WD.use_interpret(), tile), mk, byts, byts / HBM, sz.max_sets)
        except Exception as e:
            rows.append({"tile": tile, "error": str(e)[:300]})
            continue
        rows.append({"tile": tile or list(WD.default_tile(m, n)), "default": tile is None,
                     "us": t["s"] * 1e6, "GBps": byts / t["s"] / 1e9, "spread": t["spread"]})
        log(f"weight_dequant tile={rows[-1]['tile']} {rows[-1]['us']:.1f} us {rows[-1]['GBps']:.0f} GB/s")
    t = time_op(lambda w, s: reference.weight_dequant_ref(w, s), mk, byts, byts / HBM, sz.max_sets)
    res["xla_twin_us"] = t["s"] * 1e6
    res["runs"] = rows
    return res


# ---------------------------------------------------------------- fp8_gemm
def candidates(m: int, n: int, k: int) -> list[GemmConfig]:
    """Tilings tried by --sweep beside the default, most promising first."""
    sp = lambda bm, bn: GM.auto_split(m, n, k, bm, bn)  # noqa: E731
    if m <= 16:
        s64 = sp(16, 64)
        halves = [d for d in (s64 // 2, s64 * 2) if d >= 1 and (k // 128) % d == 0 and k // 128 // d >= 4]
        out = [GemmConfig(16, 32, sp(16, 32), 4, 4), GemmConfig(16, 128, sp(16, 128), 4, 4),
               GemmConfig(16, 64, s64, 4, 6), GemmConfig(16, 64, s64, 2, 4)]
        out += [GemmConfig(16, 64, d, 4, 4) for d in halves]
    elif m <= 64:
        out = [GemmConfig(64, 64, sp(64, 64), 4, 4, "f16"), GemmConfig(64, 32, sp(64, 32), 4, 4),
               GemmConfig(64, 128, sp(64, 128), 4, 4), GemmConfig(64, 128, sp(64, 128), 4, 3, "f16")]
    else:
        # (128x128 with 4 warps and 256x128 spill registers: per-K-block scaling needs 2 accumulators)
        out = [GemmConfig(128, 128, 1, 8, 4, "f16"), GemmConfig(128, 128, 1, 8, 3, "fp8"),
               GemmConfig(128, 64, 1, 4, 4, "f16"), GemmConfig(64, 128, 1, 4, 4, "f16"),
               GemmConfig(256, 64, 1, 8, 3, "f16")]
    default = GM.default_config(m, n, k)
    return [c for c in dict.fromkeys(out) if c != default]


def fp8_gemm_operands(m: int, n: int, k: int):
    """(bytes an fp8_gemm of this shape moves, a maker of its i-th distinct operand set (a, a_s, b, b_s),
    the shape's PRNG key)."""
    nbytes = n * k + m * k + m * n * 2 + m * k // 128 * 4 + cdiv(n, FP8_BLOCK) * (k // FP8_BLOCK) * 4
    key = jax.random.PRNGKey(m * 7 + n * 13 + k)

    def make(i):
        kk = jax.random.fold_in(key, i)
        a, a_s = act_quant(rand(jax.random.fold_in(kk, 1), (m, k), jnp.bfloat16, 3.0))
        b, b_s = weight(kk, n, k)
        return a, a_s, b, b_s

    return nbytes, make, key


def bench_gemm(sz: Sizes, m: int, n: int, k: int, ceil: dict, sweep: bool, deadline: float) -> dict:
    flops = 2 * m * n * k
    b8, mk8, key = fp8_gemm_operands(m, n, k)
    b16 = 2 * (n * k + m * k + m * n)
    hbm, pk8, pk16 = ceil["copy_Bps"], ceil["fp8_flops"], ceil["bf16_flops"]
    floor8 = {"mem_us": b8 / hbm * 1e6, "compute_us": flops / pk8 * 1e6}
    floor16 = {"mem_us": b16 / hbm * 1e6, "compute_us": flops / pk16 * 1e6}

    def mk16(i):
        kk = jax.random.fold_in(key, i)
        return rand(jax.random.fold_in(kk, 1), (m, k), jnp.bfloat16), rand(kk, (n, k), jnp.bfloat16, 0.05)

    row = {"M": m, "N": n, "K": k, "flops": flops, "bytes_fp8": b8, "bytes_bf16": b16,
           "floor_fp8": floor8, "floor_bf16": floor16}
    fl8, fl16 = max(floor8.values()) / 1e6, max(floor16.values()) / 1e6
    t = time_op(xla_bf16, mk16, b16, fl16, sz.max_sets)
    row["xla_bf16_us"] = t["s"] * 1e6
    try:
        t = time_op(lambda a, a_s, b, b_s: xla_fp8_dot(a, b), mk8, b8, fl8, sz.max_sets)
        row["xla_fp8_us"] = t["s"] * 1e6
    except Exception as e:
        row["xla_fp8_error"] = str(e)[:300]
    configs = [GM.default_config(m, n, k)] + (candidates(m, n, k) if sweep else [])
    runs = []
    for i, cfg in enumerate(configs):
        if i and time.time() > deadline:
            row["sweep_cut"] = True
            break
        try:
            t = time_op(lambda a, a_s, b, b_s, cfg=cfg: GM.fp8_gemm_with_config(a, a_s, b, b_s, cfg), mk8, b8, fl8,
                        sz.max_sets)
        except Exception as e:
            runs.append({"config": dataclasses.asdict(cfg), "error": str(e)[:300]})
            log(f"  {cfg}: ERROR {str(e)[:200]}")
            continue
        runs.append({"config": dataclasses.asdict(cfg), "default": i == 0, "us": t["s"] * 1e6,
                     "tflops": flops / t["s"] / 1e12, "spread": t["spread"]})
    row["runs"] = runs
    ok = [r for r in runs if "us" in r]
    if ok:
        best = min(ok, key=lambda r: r["us"])
        row["ours_default_us"] = ok[0]["us"] if ok[0].get("default") else None
        row["ours_best_us"] = best["us"]
        row["ours_best_config"] = best["config"]
    log(f"M={m:5d} N={n:5d} K={k:5d}  ours {row.get('ours_default_us') or float('nan'):8.1f} us "
        f"(best {row.get('ours_best_us', float('nan')):8.1f})  xla bf16 {row['xla_bf16_us']:8.1f}  "
        f"xla fp8 {row.get('xla_fp8_us', float('nan')):8.1f}  floor fp8 mem {floor8['mem_us']:.1f} "
        f"compute {floor8['compute_us']:.1f} us")
    return row


# ---------------------------------------------------------------- fp8_gemm: Triton vs Mosaic GPU
MOSAIC_NK = ((18432, 7168), (7168, 18432))
MOSAIC_M = (4096, 512, 128, 64)


def mosaic_candidates() -> list[MosaicGemmConfig]:
    """Mosaic GPU tilings tried by --mosaic-sweep beside the default (gemm_mgpu.MosaicGemmConfig)."""
    C = MosaicGemmConfig
    return [C(max_concurrent_steps=3), C(max_concurrent_steps=5),
            C(grid_tile_width=4), C(grid_tile_width=16), C(grid_minor="m"),
            C(tile_m=128, tile_n=64, wg_dim="n"), C(tile_m=128, tile_n=64, wg_dim="m"),
            C(num_compute_wgs=3), C(num_compute_wgs=3, max_concurrent_steps=3),
            C(epi_tile_m=64, epi_tile_n=128, max_concurrent_steps=3),
            C(cluster="n"), C(cluster="m"), C(cluster="n", max_concurrent_steps=5),
            C(cluster="n", tile_m=128, tile_n=64, wg_dim="n"), C(cluster="m", num_compute_wgs=3),
            C(tile_n=64), C(tile_n=64, cluster="n"), C(num_compute_wgs=3, memory_registers=24),
            C(chain=False)]


def mosaic_configs_arg(text: str) -> list[MosaicGemmConfig]:
    """--mosaic-configs: a JSON list of MosaicGemmConfig fields, e.g. '[{"max_concurrent_steps": 5}]'."""
    return [MosaicGemmConfig(**d) for d in json.loads(text)] if text else []


def bench_mosaic(sz: Sizes, m: int, n: int, k: int, peak: float, configs: list) -> dict:
    """Triton and Mosaic fp8_gemm (bf16 out) at one shape: us, TFLOP/s, share of the fp8 peak,
    and each Mosaic result's rel. L2 distance from the Triton kernel's (a correctness guard)."""
    flops = 2 * m * n * k
    b8, mk8, _ = fp8_gemm_operands(m, n, k)
    row = {"M": m, "N": n, "K": k, "flops": flops, "auto_path": GM.fp8_gemm_path(m, n, k), "peak_fp8": peak,
           "runs": []}
    floor = max(b8 / HBM, flops / peak)
    ops = mk8(0)
    want = None
    for impl, cfg in [("triton", None), ("mosaic", None)] + [("mosaic", c) for c in configs]:
        fn = lambda a, a_s, b, b_s, impl=impl, cfg=cfg: fp8_gemm(a, a_s, b, b_s, impl=impl, mosaic_config=cfg)  # noqa: E731
        used = cfg or default_mosaic_config(m, n, k)
        run = {"impl": impl, "config": dataclasses.asdict(used) if impl == "mosaic" else None,
               "default": cfg is None}
        try:
            got = jax.jit(fn)(*ops).astype(jnp.float32)
            if want is None:
                want = got
            run["rel_l2_vs_triton"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            t = time_op(fn, mk8, b8, floor, sz.max_sets)
            run.update(us=t["s"] * 1e6, tflops=flops / t["s"] / 1e12, of_peak=flops / t["s"] / peak,
                       spread=t["spread"])
            log(f"M={m:5d} N={n:5d} K={k:5d} {impl:6s} {t['s'] * 1e6:9.1f} us {flops / t['s'] / 1e12:7.1f} TFLOP/s "
                f"({100 * flops / t['s'] / peak:4.1f}% of {peak / 1e12:.0f})  rel_l2 vs triton "
                f"{run['rel_l2_vs_triton']:.1e}  auto={row['auto_path']}  "
                f"{(('' if cfg else 'default ') + str(used)) if impl == 'mosaic' else ''}")
        except Exception as e:
            run["error"] = str(e)[:300]
            log(f"M={m:5d} N={n:5d} K={k:5d} {impl}: ERROR {str(e)[:200]}  {cfg}")
        row["runs"].append(run)
    return row


# ---------------------------------------------------------------- PTX inspection
INSPECT = r"""
import sys, json
import jax, jax.numpy as jnp
from pallas_kernels import gemm as GM
m, n, k = 4096, 2048, 7168
a = jnp.zeros((m, k), jnp.float8_e4m3fn); s = jnp.ones((m, k // 128)); b = jnp.zeros((n, k), jnp.float8_e4m3fn); bs = jnp.ones((n // 128, k // 128))
for i, c in enumerate(json.loads(sys.argv[1])):
    cfg = GM.GemmConfig(**c)
    f = lambda *x, cfg=cfg: GM.fp8_gemm_with_config(*x, cfg)
    f.__name__ = f"inspect_cfg{i}"
    jax.jit(f).lower(a, s, b, bs).compile()
"""


def inspect_ptx(configs: list[GemmConfig]) -> list[dict]:
    """Compile one GEMM per config in a subprocess with XLA dumps on and count the tensor-core
    instructions in the PTX XLA generated: wgmma (Hopper's warpgroup MMA) against mma.sync."""
    d = Path(f"/tmp/bench_kernels_dump_{os.getpid()}")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={d}", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        subprocess.run([sys.executable, "-c", INSPECT, json.dumps([dataclasses.asdict(c) for c in configs])],
                       env=env, check=True, timeout=120, capture_output=True)
    except Exception as e:
        return [{"error": str(e)[:300]}]
    out = []
    for i, cfg in enumerate(configs):
        files = [p for p in d.rglob(f"*inspect_cfg{i}*") if p.is_file()]
        text = {p.name: p.read_text(errors="ignore") for p in files}
        ptx = "".join(t for name, t in text.items() if name.endswith(".ptx"))
        pats = ("wgmma.mma_async", "mma.sync", "cp.async.bulk.tensor", "cp.async.cg")
        counts = {pat: ptx.count(pat) for pat in pats}
        everywhere = {pat: sum(t.count(pat) for t in text.values()) for pat in pats}
        out.append({"config": dataclasses.asdict(cfg), "ptx_files": [n for n in text if n.endswith(".ptx")],
                    "in_any_dump_file": everywhere, "files": sorted(text)[:40], **counts})
        log("inspect", out[-1])
    return out


# ---------------------------------------------------------------- report
def versions() -> dict:
    v = {"jax": jax.__version__}
    for pkg in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton"):
        try:
            v[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return v


def routed_sizes(rows: int, experts: int, seed: int) -> jax.Array:
    """Rows per expert of a uniform top-k routing: a multinomial draw (the tile schedule sees the
    uneven counts a real router gives)."""
    return jax.random.multinomial(jax.random.PRNGKey(seed), rows, jnp.full((experts,), 1.0 / experts),
                                  shape=(experts,)).astype(jnp.int32)


def bench_grouped(sz: Sizes, ceil: dict, tiles: list[MosaicTiles], deadline: float,
                  names: set[str] | None = None) -> list[dict]:
    """Triton vs Mosaic grouped GEMM (float32 out) at each `sz.grouped` shape (those in `names`, if
    given) and weight kind (bf16; fp8 with 128x128 block scales, dequantised in the kernels); the
    first Mosaic config is the default, the rest are --grouped-tiles (timed while the budget lasts)."""
    rows_out = []
    for name, m, experts, n, k, kinds in sz.grouped:
        if names and name not in names:
            continue
        for kind in kinds:
            rows_out.append(_bench_grouped_shape(sz, ceil, tiles, deadline, name, m, experts, n, k, kind == "fp8"))
    return rows_out


def _bench_grouped_shape(sz, ceil, tiles, deadline, name, m, experts, n, k, fp8) -> dict:
    """One row of bench_grouped: every backend / tile config at one shape and weight kind."""
    sizes = routed_sizes(m, experts, seed=m + n)
    used = int((sizes > 0).sum())
    flops = 2 * m * n * k
    scale_bytes = used * cdiv(n, FP8_BLOCK) * (k // FP8_BLOCK) * 4 if fp8 else 0
    nbytes = used * n * k * (1 if fp8 else 2) + scale_bytes + m * k * 2 + m * n * 4  # experts in use, x, f32 out
    floor = {"mem_us": nbytes / ceil["copy_Bps"] * 1e6, "compute_us": flops / ceil["bf16_flops"] * 1e6,
             "compute_790_us": flops / PEAK_BF16_SPEC * 1e6}
    key = jax.random.PRNGKey(n * 7 + k)

    def make(i):
        kk = jax.random.fold_in(key, i)
        x = rand(jax.random.fold_in(kk, 1), (m, k), jnp.bfloat16)
        if not fp8:
            return x, rand(kk, (experts, n, k), jnp.bfloat16, 0.05), None, sizes
        w8 = rand(kk, (experts, n, k), FP8, 64.0)
        scale = jnp.exp2(jax.random.uniform(jax.random.fold_in(kk, 2), (experts, cdiv(n, FP8_BLOCK), k // FP8_BLOCK),
                                            minval=-12, maxval=-4))
        return x, w8, scale, sizes

    row = {"name": name, "weights": "fp8" if fp8 else "bf16", "rows": m, "experts": experts, "experts_used": used,
           "N": n, "K": k, "flops": flops, "bytes": nbytes, "floor": floor,
           "peak_bf16_spec_tflops": PEAK_BF16_SPEC / 1e12}
    probe = make(0)
    row["backend_auto"] = grouped_gemm_backend(probe[0], probe[1], probe[2], out_dtype=jnp.float32)
    fl = max(floor["mem_us"], floor["compute_us"]) / 1e6
    runs = []
    variants = [("triton", None)] + [("mosaic", t) for t in tiles]
    outs = {}
    for i, (backend, t) in enumerate(variants):
        if i > 1 and time.time() > deadline:
            row["sweep_cut"] = True
            break
        fn = lambda x, w, sc, s, backend=backend, t=t: grouped_gemm(  # noqa: E731
            x, w, s, sc, backend=backend, mosaic_tiles=t, block_m=64, block_n=128)  # Triton: moe's prefill tiles
        entry = {"backend": backend, "tiles": None if t is None else dataclasses.asdict(t), "default": i <= 1}
        try:
            if i <= 1:
                outs[backend] = jax.jit(fn)(*probe)
            res = time_op(fn, make, nbytes, fl, sz.max_sets, reps=sz.reps, mem_cap=16e9)  # 2 sets of V3's 7.5 GB
        except Exception as e:
            entry["error"] = str(e)[:300]
            log(f"  {name} {row['weights']} {backend} {'' if t is None else t.label()}: ERROR {str(e)[:200]}")
            runs.append(entry)
            continue
        entry.update(us=res["s"] * 1e6, tflops=flops / res["s"] / 1e12, spread=res["spread"], sets=res["sets"])
        runs.append(entry)
        log(f"  {name} {row['weights']} {backend:6s} {'' if t is None else t.label()}: {entry['us']:8.1f} us {entry['tflops']:6.1f} TFLOP/s "
            f"(bf16 peak {PEAK_BF16_SPEC / 1e12:.0f}, XLA dense {ceil['bf16_flops'] / 1e12:.0f})")
    if "triton" in outs and "mosaic" in outs:
        a, b = outs["triton"].astype(jnp.float32), outs["mosaic"].astype(jnp.float32)
        row["mosaic_vs_triton_max_rel"] = float(jnp.max(jnp.abs(a - b)) / jnp.sqrt(jnp.mean(a * a)))
    del probe, outs
    row["runs"] = runs
    best = {b: min((r for r in runs if r["backend"] == b and "us" in r), key=lambda r: r["us"], default=None)
            for b in ("triton", "mosaic")}
    for b, r in best.items():
        if r:
            row[f"{b}_best_us"], row[f"{b}_best_tflops"] = r["us"], r["tflops"]
    row["mosaic_best_tiles"] = best["mosaic"]["tiles"] if best["mosaic"] else None
    log(f"{name} {row['weights']}: rows {m} experts {used}/{experts} N {n} K {k}: triton {row.get('triton_best_tflops', float('nan')):.0f}, "
        f"mosaic {row.get('mosaic_best_tflops', float('nan')):.0f} TFLOP/s (peak {PEAK_BF16_SPEC / 1e12:.0f}); "
        f"floor mem {floor['mem_us']:.0f} us compute {floor['compute_us']:.0f} us; auto picks {row['backend_auto']}")
    return row


def markdown(rep: dict) -> str:
    c = rep["ceilings"]
    note = rep.get("ceilings_note") or (
        f"Ceilings measured in this run: copy {c['copy_Bps'] / 1e12:.2f} TB/s, XLA bf16 matmul "
        f"{c['bf16_flops'] / 1e12:.0f} TFLOP/s, XLA fp8 dot {c['fp8_flops'] / 1e12:.0f} TFLOP/s (8192^3). "
        "Floors below use these ceilings.")
    L = [f"# pallas_kernels on {rep['gpu']} ({rep['date']})", "",
         f"Versions: {', '.join(f'{k} {v}' for k, v in rep['versions'].items())}. {note}", ""]
    for name in ("act_quant", "weight_dequant"):
        r = rep.get(name)
        if not r:
            continue
        ok = [x for x in r["runs"] if "us" in x]
        d = next((x for x in ok if x.get("default")), None)
        b = min(ok, key=lambda x: x["us"]) if ok else None
        if d and b:
            L.append(f"- **{name}** {r['shape'][0]}x{r['shape'][1]}: default tile {d['tile']} {d['us']:.1f} us = "
                     f"{d['GBps']:.0f} GB/s; best tile {b['tile']} {b['us']:.1f} us = {b['GBps']:.0f} GB/s; "
                     f"memory floor {r['floor_us']:.1f} us; XLA (jnp twin) {r['xla_twin_us']:.1f} us.")
    L += [] if not rep["gemm"] else ["", "fp8_gemm (block-scaled, bf16 out) vs XLA bf16 matmul and XLA raw fp8 dot of the same shape. "
          "Floors: memory = bytes / bandwidth, compute = FLOPs / peak (fp8 peak for ours and XLA fp8, "
          "bf16 peak for XLA bf16), with the ceilings named above. Times in us.", "",
          "| M | N x K | ours (default) | ours (best) | TFLOP/s (best) | best config | floor fp8 mem / compute "
          "| XLA bf16 | floor bf16 mem / compute | XLA fp8 | run |",
          "|---:|---|---:|---:|---:|---|---|---:|---|---:|---|"]
    L += [] if rep["gemm"] else [""]
    order = {m: i for i, m in enumerate(sorted({r["M"] for r in rep["gemm"]}))}
    for r in sorted(rep["gemm"], key=lambda r: order[r["M"]]):
        bc = r.get("ours_best_config") or {}
        cfg = f"{bc.get('bm')}x{bc.get('bn')} s{bc.get('split')} w{bc.get('num_warps')} st{bc.get('num_stages')} {bc.get('mma')}" if bc else "-"
        f8, f16 = r["floor_fp8"], r["floor_bf16"]
        fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
        tf = r["flops"] / (r["ours_best_us"] * 1e-6) / 1e12 if r.get("ours_best_us") else None
        L.append(f"| {r['M']} | {r['N']}x{r['K']} | {fmt(r.get('ours_default_us'))} | {fmt(r.get('ours_best_us'))} | "
                 f"{fmt(tf)} | {cfg} | {f8['mem_us']:.1f} / {f8['compute_us']:.1f} | {fmt(r.get('xla_bf16_us'))} | "
                 f"{f16['mem_us']:.1f} / {f16['compute_us']:.1f} | {fmt(r.get('xla_fp8_us'))} | "
                 f"{r.get('run', rep['date'])} |")
    if rep.get("mosaic"):
        L += ["", "fp8_gemm, Triton vs Mosaic GPU kernel (bf16 out; impl forced; `auto` = the kernel fp8_gemm "
              "picks by default). Share of the fp8 peak named in the row.", "",
              "| M | N x K | auto | impl | config | us | TFLOP/s | of peak | rel L2 vs Triton |",
              "|---:|---|---|---|---|---:|---:|---:|---:|"]
        for r in rep["mosaic"]:
            for x in r["runs"]:
                c = x.get("config")
                cfg = "-" if not c else ("default" if x.get("default") else ", ".join(
                    f"{k}={v}" for k, v in c.items() if v != getattr(MosaicGemmConfig(), k)))
                if "error" in x:
                    L.append(f"| {r['M']} | {r['N']}x{r['K']} | {r['auto_path']} | {x['impl']} | {cfg} | error: "
                             f"{x['error'][:80]} | | | |")
                else:
                    L.append(f"| {r['M']} | {r['N']}x{r['K']} | {r['auto_path']} | {x['impl']} | {cfg} | {x['us']:.1f} | "
                             f"{x['tflops']:.0f} | {100 * x['of_peak']:.0f}% of {r['peak_fp8'] / 1e12:.0f} | "
                             f"{x['rel_l2_vs_triton']:.1e} |")
    if rep.get("grouped"):
        L += ["", f"Grouped expert GEMM (float32 out; fp8 weights dequantised to bf16 in the kernels): Triton (mma.sync, 64x128 tiles) vs Mosaic GPU "
              f"(wgmma). TFLOP/s beside the {PEAK_BF16_SPEC / 1e12:.0f} TFLOP/s bf16 peak; floors: memory = the "
              "experts in use + x + out over the copy bandwidth, compute = FLOPs over XLA's measured bf16 peak.", "",
              "| shape | weights | rows | experts used | N x K | Triton us | TFLOP/s | Mosaic us | TFLOP/s | best Mosaic tiles "
              "| floor mem / compute us | auto |", "|---|---|---:|---:|---|---:|---:|---:|---:|---|---|---|"]
        fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
        for r in rep["grouped"]:
            t = r.get("mosaic_best_tiles")
            tiles = MosaicTiles(**t).label() if t else "-"
            L.append(f"| {r['name']} | {r.get('weights', 'bf16')} | {r['rows']} | {r['experts_used']}/{r['experts']} | {r['N']}x{r['K']} | "
                     f"{fmt(r.get('triton_best_us'))} | {fmt(r.get('triton_best_tflops'))} | {fmt(r.get('mosaic_best_us'))} | "
                     f"{fmt(r.get('mosaic_best_tflops'))} | {tiles} | {r['floor']['mem_us']:.1f} / "
                     f"{r['floor']['compute_us']:.1f} | {r['backend_auto']} |")
    if rep.get("inspect"):
        L += ["", "Tensor-core instructions in the PTX XLA compiled (M=4096, N=2048, K=7168):", ""]
        for r in rep["inspect"]:
            L.append(f"- {r.get('config')}: " + (r.get("error") or
                     f"wgmma.mma_async {r['wgmma.mma_async']}, mma.sync {r['mma.sync']}, "
                     f"cp.async.bulk.tensor {r['cp.async.bulk.tensor']}, cp.async.cg {r['cp.async.cg']}"))
    return "\n".join(L) + "\n"


def compose(paths: list[str], out_dir: str) -> None:
    """One report from several runs (later runs override earlier rows): floors use the reference
    ceilings (4.3 TB/s, 785 / 1400 TFLOP/s) so rows of different runs compare; 'ours (default)'
    is the run's time for what default_config picks now, wherever a run timed that tiling."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    last = runs[-1]
    rep = {k: last[k] for k in ("gpu", "sms", "versions", "method")}
    rep["date"] = " + ".join(r["date"] for r in runs)
    rep["composed_from"] = [Path(p).name for p in paths]
    rep["ceilings"] = last["ceilings"]
    rep["ceilings_by_run"] = {r["date"]: r["ceilings"] for r in runs}
    rep["ceilings_note"] = (
        "Ceilings measured in the runs: " + "; ".join(
            f"{d}: copy {c['copy_Bps'] / 1e12:.2f} TB/s, XLA bf16 {c['bf16_flops'] / 1e12:.0f}, fp8 "
            f"{c['fp8_flops'] / 1e12:.0f} TFLOP/s" for d, c in rep["ceilings_by_run"].items())
        + ". Floors below use the reference ceilings 4.3 TB/s, 785 TFLOP/s bf16, 1400 TFLOP/s fp8.")
    for name in ("act_quant", "weight_dequant"):
        have = [r for r in runs if r.get(name)]
        if have:
            rep[name] = dict(have[-1][name], run=have[-1]["date"])
            rep[name]["floor_us"] = rep[name]["bytes"] / 4.3e12 * 1e6
    rows = {}
    for r in runs:
        for g in r.get("gemm", []):
            if not g.get("from_run"):
                rows[(g["M"], g["N"], g["K"])] = dict(g, run=r["date"])
    rep["gemm"] = []
    for (m, n, k), g in rows.items():
        want = dataclasses.asdict(GM.default_config(m, n, k, rep["sms"] or 132))
        hit = [x for x in g["runs"] if x.get("config") == want and "us" in x]
        g["ours_default_us"] = hit[0]["us"] if hit else None
        g["ours_default_config"] = want
        g["floor_fp8"] = {"mem_us": g["bytes_fp8"] / 4.3e12 * 1e6, "compute_us": g["flops"] / 1400e12 * 1e6}
        g["floor_bf16"] = {"mem_us": g["bytes_bf16"] / 4.3e12 * 1e6, "compute_us": g["flops"] / 785e12 * 1e6}
        rep["gemm"].append(g)
    missing = [f"{m}x{n}x{k}" for m in Sizes().gemm_m for n, k in Sizes().gemm_nk if (m, n, k) not in rows]
    rep["not_measured"] = missing
    md = markdown(rep) + (f"\nNot measured (device time ran out): M x N x K = {', '.join(missing)}.\n" if missing else "")
    out = Path(out_dir)
    (out / "kernels-h200.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / "kernels-h200.md").write_text(md)
    log(md)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--sweep", action="store_true", help="also time alternative tilings")
    ap.add_argument("--budget-s", type=float, default=420, help="stop sweeping after this many seconds")
    ap.add_argument("--inspect", action="store_true", help="count wgmma / mma.sync in XLA's PTX")
    ap.add_argument("--only", default="", help="comma list of parts: act,dequant,gemm,mosaic,grouped (default: "
                    "act,dequant,gemm)")
    ap.add_argument("--mosaic-m", default="", help="comma list of M for part mosaic (default 4096,512,128,64)")
    ap.add_argument("--mosaic-sweep", action="store_true", help="part mosaic: also time mosaic_candidates()")
    ap.add_argument("--mosaic-configs", default="", help="part mosaic: JSON list of MosaicGemmConfig fields "
                    "to time too, e.g. '[{\"max_concurrent_steps\": 5}]'")
    ap.add_argument("--grouped-shapes", default="", help="part grouped: comma list of shape names to run "
                    "(default: all: v2lite_w13, v2lite_w2, v3_w13, v3_w2)")
    ap.add_argument("--grouped-tiles", default="", help="Mosaic grouped GEMM tiles to time after the default, "
                    "';'-separated MosaicTiles specs, e.g. 'block_m=128,max_concurrent_steps=5;block_n=64'")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU dry run of the script")
    ap.add_argument("--m", default="", help="comma list of M to run (default: all)")
    ap.add_argument("--sweep-only", default="", help="comma list of MxNxK (or M) to sweep; default: all")
    ap.add_argument("--act-tiles", default="", help="act_quant tiles to sweep, e.g. 4x8x4,2x8x2")
    ap.add_argument("--dequant-tiles", default="", help="weight_dequant tiles to sweep, e.g. 16x1024x4")
    ap.add_argument("--merge", default="", help="earlier JSON: GEMM rows this run skips are copied "
                    "from it (marked with their run's date)")
    ap.add_argument("--compose", nargs="+", help="write one report from these run JSONs, run nothing")
    return ap.parse_args(argv)


def run_mosaic_part(args, sz, rep: dict, save) -> None:
    rep["mosaic"] = []
    ms = [int(v) for v in args.mosaic_m.split(",") if v] or list(MOSAIC_M)
    extra = (mosaic_candidates() if args.mosaic_sweep else []) + mosaic_configs_arg(args.mosaic_configs)
    nks = ((256, 384),) if args.smoke else MOSAIC_NK
    for m in (ms if not args.smoke else [200]):
        for n, k in nks:
            rep["mosaic"].append(bench_mosaic(sz, m, n, k, PEAK_FP8, extra))
            save()


def run_gemm_part(args, sz, rep: dict, save, deadline: float) -> None:
    only_m = {int(v) for v in args.m.split(",") if v}
    sweep_only = set(args.sweep_only.split(",")) - {""}
    prev = json.loads(Path(args.merge).read_text()) if args.merge else {"gemm": []}
    ms = [int(v) for v in args.m.split(",") if v]  # run first, in the order given
    for m in ms + [v for v in sz.gemm_m if v not in ms]:
        for n, k in sz.gemm_nk:
            if only_m and m not in only_m:
                old = [r for r in prev["gemm"] if (r["M"], r["N"], r["K"]) == (m, n, k)]
                if old:
                    rep["gemm"].append(dict(old[0], from_run=prev.get("date")))
                continue
            sweep = args.sweep and (not sweep_only or f"{m}x{n}x{k}" in sweep_only or str(m) in sweep_only)
            rep["gemm"].append(bench_gemm(sz, m, n, k, rep["ceilings"], sweep, deadline))
            save()


def main():
    args = parse_args()
    if args.compose:
        return compose(args.compose, args.out_dir)
    t_start = time.time()
    deadline = t_start + args.budget_s
    dev = jax.devices()[0]
    parts = set(args.only.split(",")) if args.only else {"act", "dequant", "gemm", "grouped"}
    grouped_tiles = [MosaicTiles()] + [MosaicTiles.parse(t) for t in args.grouped_tiles.split(";") if t.strip()]
    rep = {"gpu": dev.device_kind, "sms": getattr(dev, "core_count", None), "versions": versions(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "method": "median over 9 repeats of wall time / (calls x R distinct input sets) of one jitted "
                     "program; R sized to exceed 3x L2 and 0.3 ms per call"}
    log(rep)
    if args.inspect:  # first: a second process compiles while this one has not filled the GPU yet
        rep["inspect"] = inspect_ptx([GemmConfig(128, 128, 1, 8, 3, "f16"), GemmConfig(128, 128, 1, 8, 3, "fp8")])
    global HBM
    sz = SMOKE if args.smoke else Sizes()
    if parts <= {"mosaic", "grouped"}:  # a quick A/B: the ceilings are this file's constants
        rep["ceilings"] = {"copy_Bps": HBM, "bf16_flops": PEAK_BF16, "fp8_flops": PEAK_FP8}
        rep["ceilings_note"] = (f"Ceilings not measured in this run: copy {HBM / 1e12:.2f} TB/s, fp8 peak "
                                f"{PEAK_FP8 / 1e12:.0f} TFLOP/s (bench_kernels.py constants).")
    else:
        rep["ceilings"] = ceilings(sz)
    HBM = rep["ceilings"]["copy_Bps"]
    log("ceilings", rep["ceilings"])
    if "act" in parts:
        rep["act_quant"] = bench_act_quant(sz, args.sweep, tiles_arg(args.act_tiles))
    if "dequant" in parts:
        rep["weight_dequant"] = bench_weight_dequant(sz, args.sweep, tiles_arg(args.dequant_tiles))
    log(f"[{time.time() - t_start:.0f} s] act_quant / weight_dequant done")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "kernels-" + ("h200" if "H200" in dev.device_kind else dev.device_kind.replace(" ", "_").lower())
    stem += "-smoke" if args.smoke else ""
    rep["gemm"] = []

    def save():  # after every part, so that a run cut short still leaves its results
        rep["wall_s"] = time.time() - t_start
        (out / f"{stem}.json").write_text(json.dumps(rep, indent=1, default=str))
        (out / f"{stem}.md").write_text(markdown(rep))

    if "mosaic" in parts:
        run_mosaic_part(args, sz, rep, save)
    if "gemm" in parts:
        run_gemm_part(args, sz, rep, save, deadline)
    if "grouped" in parts:
        rep["grouped"] = bench_grouped(sz, rep["ceilings"], grouped_tiles, deadline,
                                       {v for v in args.grouped_shapes.split(",") if v})
    save()
    log(markdown(rep))


if __name__ == "__main__":
    main()
