"""GPU time per layer of a decode step's dense projections: XLA's GEMV against `norm_project` under several tilings.

    PYTHONPATH=. python3 scripts/sweep_projections.py --config configs/config_16B.json --batches 1,8 --out x.json

Each projection (attention's wo, the dense MLP's w1 + w3 and w2, the query's wq + wkv_a) runs once per layer of a
bf16 weight stack, read at its layer as the model's decode step reads it (XLA: the layer sliced out of the stack;
the kernel: in place), so every launch reads weights that are not in L2. The time is the sum of the durations of
every GPU kernel the jit runs (a copy or pad of the weight XLA adds counts), divided by the layers, from a
profiler trace. The floor beside it is the weights' bytes at 4.3 TB/s.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelArgs
from pallas_kernels.projection import Tiles, norm_project, tiles_for
from profile_step import gpu_events

HBM_BYTES_PER_US = 4.3e6
TILINGS = [Tiles(16, 512, 8, 3), Tiles(16, 256, 4, 3), Tiles(32, 256, 4, 3),
           Tiles(16, 1024, 8, 3)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--weight-mb", type=float, default=400, help="bytes of each stack (sets its layers), in MB")
    p.add_argument("--projections", default=None, help="comma-separated names to run (default: all of them)")
    p.add_argument("--repeats", type=int, default=5, help="jit calls traced per case")
    p.add_argument("--tilings", type=tiling_list, default=TILINGS,
                   help="the tilings to time beside the default one: a JSON list of [block_n, block_k, num_warps, "
                        "num_stages]")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def tiling_list(text: str) -> list[Tiles]:
    """--tilings' JSON list of [block_n, block_k, num_warps, num_stages] as Tiles."""
    try:
        return [Tiles(*map(int, t)) for t in json.loads(text)]
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list of [block_n, block_k, num_warps, num_stages] "
                                         f"lists, got {text!r} ({e})") from None


def projections(args: ModelArgs) -> dict[str, tuple[list[tuple[int, int]], bool]]:
    """name -> ([(N, K) of each weight], whether an RMSNorm feeds them)."""
    q = args.n_heads * args.qk_head_dim
    return {"wq+wkv_a": ([(q, args.dim), (args.kv_lora_rank + args.qk_rope_head_dim, args.dim)], True),
            "wo": ([(args.dim, args.n_heads * args.v_head_dim)], False),
            "mlp w1+w3": ([(args.inter_dim, args.dim)] * 2, False),
            "mlp w2": ([(args.dim, args.inter_dim)], False)}


def per_layer_us(run, operands, layers: int, repeats: int) -> float:
    """GPU time of every kernel of a jit of run(operands, layer) over the layers, per layer. The operands are the
    jit's arguments: closed over, they would be constants XLA folds its own products of at compile time."""
    many = jax.jit(lambda ops: [run(ops, jnp.int32(layer)) for layer in range(layers)])
    jax.block_until_ready(many(operands))
    jax.block_until_ready(many(operands))
    events = gpu_events(lambda: [jax.block_until_ready(many(operands)) for _ in range(repeats)])
    return sum(e["dur"] for e in events if not e["name"].startswith("Memcpy")) / (layers * repeats)


def sweep(args: ModelArgs, batch: int, weight_mb: float, repeats: int, names: list[str] | None,
          tilings: list[Tiles]):
    """Yield one row a (projection, implementation)."""
    keys = iter(jax.random.split(jax.random.key(0), 64))
    for name, (shapes, normed) in projections(args).items():
        if names is not None and name not in names:
            continue
        layers = max(2, int(weight_mb * 1e6 // (2 * sum(n * k for n, k in shapes))))
        k = shapes[0][1]
        ws = [(jax.random.normal(next(keys), (layers, n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
              for n, _ in shapes]
        norm = jnp.ones((layers, k), jnp.float32) if normed else None
        x = jax.random.normal(next(keys), (batch, k), jnp.float32).astype(jnp.bfloat16)
        floor = 2 * sum(n * k for n, _ in shapes) / HBM_BYTES_PER_US
        row = dict(batch=batch, projection=name, layers=layers, floor_us=floor)

        operands = (x, ws, norm)

        def xla(ops, layer):
            x, ws, norm = ops
            rows = x
            if norm is not None:
                f = x.astype(jnp.float32)
                inv = jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + 1e-6)
                rows = (f * inv * norm[layer]).astype(x.dtype)
            return [jnp.dot(rows, w[layer].T, preferred_element_type=jnp.float32).astype(x.dtype) for w in ws]

        yield dict(row, impl="xla", us=per_layer_us(xla, operands, layers, repeats))
        for tiles in [tiles_for(batch)] + [t for t in tilings if t != tiles_for(batch)]:
            def run(ops, layer, t=tiles):
                x, ws, norm = ops
                return norm_project(x, ws, norm=norm, layer=layer, tiles=t)
            try:
                us = per_layer_us(run, operands, layers, repeats)
            except Exception as e:  # noqa: BLE001 -- a tiling Triton or the checks refuse is a result of the sweep
                us = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            yield dict(row, impl="norm_project", tiles=tiles._asdict(), us=us)


def main() -> None:
    o = parse_args()
    args = ModelArgs.from_reference_json(o.config)
    names = None if o.projections is None else o.projections.split(",")
    unknown = sorted(set(names or ()) - set(projections(args)))
    if unknown:
        raise SystemExit(f"unknown projection {unknown[0]!r}; the projections are {', '.join(projections(args))}")
    rows = []
    for batch in (int(b) for b in o.batches.split(",")):
        for row in sweep(args, batch, o.weight_mb, o.repeats, names, o.tilings):
            rows.append(row)
            tiles = " ".join(f"{k}={v}" for k, v in row.get("tiles", {}).items())
            us = f"{row['us']:7.2f} us" if isinstance(row["us"], float) else row["us"]
            print(f"b={batch:<3d} {row['projection']:10s} {row['impl']:12s} {tiles:52s} {us}"
                  f"  (floor {row['floor_us']:.2f} us)", flush=True)
    if o.out:
        with open(o.out, "w") as f:
            json.dump(dict(config=o.config, device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
