"""Does reading the first part of a weight into L2 in an earlier launch shorten the GEMV that streams it next?

    PYTHONPATH=. python3 scripts/bench_l2_prefetch.py --megabytes 0,8,16,32,48 --out x.json

At decode a layer's small launches (norms, the MLA kernels, the router) read little and leave HBM idle while
they run; if the next large GEMV's first weight bytes could be streamed into L2 there, that GEMV would start from
L2. This measures the effect alone: one jit runs, in order, a flush (a 128 MiB buffer read), a "touch" launch
that reads the first MB of the weight (or, as the control, of an unrelated buffer) with an L2 eviction policy,
then the product of one activation row with the weight (`fp8_gemm`, V3's wo: 7,168 x 16,384 fp8, as the decode
step runs it with gemm fp8). Each kernel's GPU time comes from a profiler trace. The GEMV's time should fall by
about the touched bytes over its streaming rate if L2 keeps them, and the touch's own time says what the bytes
cost when read alone.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import act_quant, fp8_gemm
from pallas_kernels._common import use_interpret
import profile_step
from bench_model import HBM_BYTES_PER_S

N, K = 7168, 16384  # V3's wo (out, in) on one device
ROWS_PER_PROGRAM, CHUNK = 8, 512  # a touch program reads 8 weight rows (128 KB) in 8 x 512-byte tiles
FLUSH_BYTES = 128 << 20


def touch(w: jax.Array, rows: int, eviction_policy: str | None, name: str = "l2_touch") -> jax.Array:
    """Reads w[:rows] (fp8 (N, K)) with `eviction_policy` and returns one float32 a program (its tiles' max),
    so that nothing is read for nothing."""
    def kernel(w_ref, o_ref):
        first = pl.program_id(0) * ROWS_PER_PROGRAM

        def step(c, top):
            tile = plgpu.load(w_ref.at[pl.ds(first, ROWS_PER_PROGRAM), pl.ds(c * CHUNK, CHUNK)],
                              eviction_policy=eviction_policy)
            return jnp.maximum(top, tile.astype(jnp.float32).max())

        o_ref[0] = jax.lax.fori_loop(0, K // CHUNK, step, jnp.float32(-jnp.inf))

    programs = rows // ROWS_PER_PROGRAM
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32), grid=(programs,),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          out_specs=pl.BlockSpec((1,), lambda i: (i,)),
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                          interpret=use_interpret(), name=name)(w)


def fp8_matrix(key, rows: int, cols: int) -> jax.Array:
    return jax.random.uniform(key, (rows, cols), jnp.bfloat16, -1.9, 1.9).astype(jnp.float8_e4m3fn)


def kernel_us(run, calls: int) -> dict[str, float]:
    """Mean GPU µs a call of each kernel name (its prefix before a "__" suffix) over `calls` calls of run."""
    jax.block_until_ready(run())
    events = profile_step.gpu_events(lambda: [jax.block_until_ready(run()) for _ in range(calls)])
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e["name"].split("__")[0], []).append(e["dur"])
    return {name: sum(d) / calls for name, d in by_name.items()}


def touch_then_gemv(megabytes: int, source: str, eviction_policy: str | None):
    """The jitted step `measure` times: flush L2, touch `megabytes` of `source` ("weight" or "other"), the GEMV."""
    rows = (megabytes << 20) // K

    def run(flush, other, w, w_s, a, a_s):
        flushed = touch(flush, flush.shape[0], None, name="l2_flush").max()
        a, read = jax.lax.optimization_barrier((flushed, a, w if source == "weight" else other))[1:]  # flush first
        touched = touch(read, rows, eviction_policy).max() if rows else flushed
        a = jax.lax.optimization_barrier((touched, a))[1]
        return fp8_gemm(a, a_s, w, w_s), touched

    return jax.jit(run)


def measure(megabytes: int, source: str, eviction_policy: str | None, operands: dict, calls: int) -> dict:
    """`touch_then_gemv`'s kernels' µs."""
    call = touch_then_gemv(megabytes, source, eviction_policy)
    times = kernel_us(lambda: call(**operands), calls)
    gemv = sum(us for name, us in times.items() if not name.startswith("l2_"))  # fp8_gemm and its split-K sum
    return dict(megabytes=megabytes, source=source, eviction_policy=eviction_policy, kernels_us=times,
                gemv_us=gemv, touch_us=times.get("l2_touch", 0.0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megabytes", default="0,8,16,32,48", help="MB of the weight (or the control) touched first")
    p.add_argument("--policies", default="evict_last,none", help="eviction policies of the touch: evict_last, "
                   "evict_first, none")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    o = p.parse_args()
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (1, K), jnp.bfloat16)
    a, a_s = act_quant(x)
    operands = dict(flush=fp8_matrix(keys[1], FLUSH_BYTES // K, K), other=fp8_matrix(keys[2], N, K),
                    w=fp8_matrix(keys[3], N, K), w_s=jnp.full((N // 128, K // 128), 2.0 ** -6, jnp.float32),
                    a=a, a_s=a_s)
    floor_us = N * K / HBM_BYTES_PER_S * 1e6
    print(f"{jax.devices()[0].device_kind}: GEMV 1 x {K} by {N} x {K} fp8 ({N * K / 1e6:.0f} MB), "
          f"floor {floor_us:.1f} µs at 4.3 TB/s")
    rows = []
    for mb in [int(m) for m in o.megabytes.split(",")]:
        for policy in o.policies.split(","):
            policy = None if policy == "none" else policy
            for source in ("other", "weight") if mb else ("other",):
                r = measure(mb, source, policy, operands, o.calls)
                rows.append(r)
                kernels = {k: round(v, 2) for k, v in r["kernels_us"].items()}
                print(f"touch {mb:3d} MB of {source:6s} ({policy or 'no policy':10s}): GEMV "
                      f"{r['gemv_us']:7.2f} µs; kernels {json.dumps(kernels)}")
            if not mb:
                break
    if o.out:
        with open(o.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, floor_us=floor_us, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
