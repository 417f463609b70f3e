"""GPU time per launch of the one-launch RMSNorm at a row width, for each count of programs a row.

    PYTHONPATH=. python3 scripts/sweep_norm.py --width 7168 --batches 1,8 --groups 1,2,4,7 --out x.json
    PYTHONPATH=. python3 scripts/sweep_norm.py --width 2048 --experts 64 --gate-groups 4,8,16 --groups 1

What the model's decode steps run before each projection of DeepSeek-V3 (7,168 columns, seven chunks of
1,024): `rms_norm` after the residual add (gemm_impl "bf16") and `rms_norm_fp8` (the normed rows also quantized
as act_quant does, gemm_impl "fp8"). `column_groups` splits a row's second pass (scale, store, quantize) over
that many programs, each of which sums the whole row's squares. One jit launches the norm once per layer of a
stacked weight; the time is the kernel's duration from a profiler trace (`profile_step.launch_us`), the first
count of each form its default (1).

With --experts E, the norm before the MoE as the model's router choices run it, per layer and all its kernels
timed together: the norm then XLA's float32 gate GEMV (router "kernel"), and the norm computing the gate's
logits in its launch (router "norm-gate") at each count of --gate-groups programs a row.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from pallas_kernels.norm import norm_chunk, rms_norm, rms_norm_fp8
from profile_step import launch_us


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=7168, help="the normed row's columns (the model's dim)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--groups", default="1,2,4,7", help="programs a row (at most the row's chunks)")
    p.add_argument("--experts", type=int, default=0, help="routed experts of the gate (0: no gate)")
    p.add_argument("--gate-groups", default="4,8,16,32", help="with --experts: programs a row sharing the experts")
    p.add_argument("--layers", type=int, default=16, help="layers of the weight stack, one launch each")
    p.add_argument("--repeats", type=int, default=5, help="jit calls traced per setting")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def sweep(width: int, batch: int, groups: list[int], layers: int, repeats: int):
    """Yield a row per (form, column groups) at this batch."""
    keys = jax.random.split(jax.random.key(batch), 3)
    x, residual = (jax.random.normal(k, (batch, width), jnp.float32).astype(jnp.bfloat16) for k in keys[:2])
    weight = jax.random.uniform(keys[2], (layers, width), jnp.float32, 0.5, 1.5)
    forms = {"bf16": lambda layer, g: rms_norm(x, weight, eps=1e-6, residual=residual, layer=layer, column_groups=g),
             "fp8": lambda layer, g: rms_norm_fp8(x, weight, eps=1e-6, residual=residual, layer=layer,
                                                  column_groups=g)}
    for form, norm in forms.items():
        for g in groups:
            us = launch_us("rms_norm", lambda layer, _, g=g, norm=norm: norm(layer, g), layers, repeats)
            yield dict(batch=batch, width=width, form=form, column_groups=g, us=us)


def sweep_gate(width: int, batch: int, experts: int, groups: list[int], layers: int, repeats: int):
    """Yield a row per way of computing the gate's logits after the norm (bf16 rows, a bf16 gate stack)."""
    keys = jax.random.split(jax.random.key(batch + 1), 4)
    x, residual = (jax.random.normal(k, (batch, width), jnp.float32).astype(jnp.bfloat16) for k in keys[:2])
    weight = jax.random.uniform(keys[2], (layers, width), jnp.float32, 0.5, 1.5)
    gate = (jax.random.normal(keys[3], (layers, experts, width), jnp.float32) * width ** -0.5).astype(jnp.bfloat16)

    def norm_then_gemv(layer, _):
        normed, h = rms_norm(x, weight, eps=1e-6, residual=residual, layer=layer)
        return jnp.dot(normed.astype(jnp.float32), gate[layer].astype(jnp.float32).T), h

    us = launch_us(None, norm_then_gemv, layers, repeats)
    yield dict(batch=batch, width=width, experts=experts, form="norm, then XLA's gate GEMV", gate_groups=0, us=us)
    for g in groups:
        us = launch_us(None, lambda layer, _, g=g: rms_norm(x, weight, eps=1e-6, residual=residual, layer=layer,
                                                         gate=gate, gate_groups=g), layers, repeats)
        yield dict(batch=batch, width=width, experts=experts, form="gate in the norm", gate_groups=g, us=us)


def main() -> None:
    o = parse_args()
    chunks = o.width // norm_chunk(o.width)
    groups = [g for g in (int(v) for v in o.groups.split(",")) if g <= chunks]
    rows = []
    for batch in (int(b) for b in o.batches.split(",")):
        for row in sweep(o.width, batch, groups, o.layers, o.repeats):
            rows.append(row)
            print(f"b={row['batch']:<3d} {row['form']:5s} column_groups={row['column_groups']:<2d} {row['us']:7.2f} us",
                  flush=True)
        if not o.experts:
            continue
        gate_groups = [g for g in (int(v) for v in o.gate_groups.split(",")) if g <= o.experts]
        for row in sweep_gate(o.width, batch, o.experts, gate_groups, o.layers, o.repeats):
            rows.append(row)
            print(f"b={row['batch']:<3d} E={o.experts} {row['form']:30s} gate_groups={row['gate_groups']:<3d} "
                  f"{row['us']:7.2f} us a layer", flush=True)
    if o.out:
        with open(o.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
