"""GPU time per launch of the absorbed-MLA decode kernels under several tilings, at a config's shapes.

    PYTHONPATH=. python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json --batches 1,8 --out x.json
    PYTHONPATH=. python3 scripts/sweep_mla_tiles.py --config configs/config_671B.json --batches 1 --wkv-b fp8 \
        --kernels output --output-tiles '[{"block_v": 16}, {"block_v": 16, "v_blocks": 8}]'
    PYTHONPATH=. python3 scripts/sweep_mla_tiles.py --config configs/config_16B.json --batches 8,32 \
        --kernels splits --splits 1,2,4,8,16

For each kernel (`mla_absorb_query`, `mla_decode_splits`, `mla_decode_output`) and tiling, one jit launches
the kernel once per layer of a stacked wkv_b and cache, so that every launch reads a layer that is not in L2,
as in the model's decode step. The time is the kernel's duration on the GPU from a profiler trace (dispatch,
which CUDA graphs hide in the step, is not measured). The first tiling of each kernel is its default.
`--kernels splits` times the cache's split count instead: `mla_decode_splits` and the `mla_decode_output` that
merges its splits, both at their default tiles, and their sum ("decode+output"; the count `default_splits`
picks is marked).
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import json

import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelArgs
from dsv3_jax.model.cache import cache_window
from pallas_kernels.mla import default_splits, mla_absorb_query, mla_decode_output, mla_decode_splits
import profile_step

BLOCK_T = inspect.signature(mla_decode_splits).parameters["block_t"].default  # a decode tiling without one
QUERY_TILES = [dict(block_c=c, num_warps=w) for c, w in itertools.product((128, 64, 32), (4, 2))]
DECODE_TILES = [dict(block_t=t, num_warps=w) for t, w in itertools.product((64, 32, 16), (4, 2))]
OUTPUT_TILES = ([dict(block_v=v, num_warps=w) for v, w in itertools.product((16, 32, 64), (4, 2))]
                + [dict(block_v=16, v_blocks=n) for n in (2, 4, 8)])  # one merge for several V blocks
OUTPUT_SPLIT_BLOCKS = (64, 32)  # the output kernel merges as many splits as mla_decode_splits made at these (64:
# its default block_t)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=512, help="cached positions each row attends to")
    p.add_argument("--layers", type=int, default=27, help="layers in the stacks (at most the config's)")
    p.add_argument("--repeats", type=int, default=5, help="jit calls traced per tiling")
    p.add_argument("--kernels", default="query,decode,output", help="which sweeps: query, decode, output, splits")
    p.add_argument("--splits", default="1,2,4,8,16", help="the split counts of the splits sweep")
    p.add_argument("--decode-tiles", type=json.loads, default=DECODE_TILES,
                   help="JSON list of the decode sweep's tilings, e.g. '[{\"block_t\": 32, \"num_stages\": 3}]' "
                        "(default: the built-in list)")
    p.add_argument("--output-tiles", type=json.loads, default=OUTPUT_TILES,
                   help="JSON list of the output sweep's tilings, e.g. '[{\"block_v\": 64}]' (default: the built-in "
                        "list)")
    p.add_argument("--split-output-tiles", type=json.loads, default=[{}],
                   help="JSON list of the output kernel's tilings in the splits sweep (default: its default tiles)")
    p.add_argument("--split-blocks", default=",".join(map(str, OUTPUT_SPLIT_BLOCKS)),
                   help="the output sweep's cache blocks (block_t of the splits it merges)")
    p.add_argument("--wkv-b", choices=("bf16", "fp8"), default="bf16",
                   help="wkv_b's storage: fp8 as V3's checkpoints (block scales, dequantized in the kernels)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def operands(args: ModelArgs, layers: int, batch: int, window: int, fp8_wkv_b: bool = False) -> dict:
    """Random decode-step operands at the config's shapes: the query, a wkv_b stack (bf16, or float8_e4m3fn with
    its 128 x 128 block scales as the fp8 checkpoints store it: `wkv_b_scale`, else None), the caches."""
    heads, nope, rope, rank = args.n_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.kv_lora_rank
    keys = iter(jax.random.split(jax.random.key(0), 16))

    def normal(shape, scale=1.0, dtype=jnp.bfloat16):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    angles = normal((batch, rope // 2), 3.0, jnp.float32)
    return dict(q=normal((batch, heads, nope + rope)), q_pe=normal((batch, heads, rope)),
                q_latent=normal((batch, heads, rank)), wkv_b=normal((layers, heads * (nope + args.v_head_dim), rank),
                                                                    rank ** -0.5),
                kv=normal((layers, batch, window, rank)), pe=normal((layers, batch, window, rope)),
                new_kv=normal((batch, rank)), new_pe=normal((batch, rope)), cos=jnp.cos(angles), sin=jnp.sin(angles),
                lengths=jnp.full((batch,), window - 64, jnp.int32), wkv_b_scale=None) | (
                    _fp8_wkv_b(normal, layers, heads * (nope + args.v_head_dim), rank) if fp8_wkv_b else {})


def _fp8_wkv_b(normal, layers: int, rows: int, rank: int) -> dict:
    """A random float8_e4m3fn wkv_b stack and its float32 block scales (one per 128 x 128 block)."""
    return dict(wkv_b=normal((layers, rows, rank), 16.0, jnp.float8_e4m3fn),
                wkv_b_scale=normal((layers, rows // 128, rank // 128), 0.01, jnp.float32) ** 2 + rank ** -0.5 / 16)


def launch_us(name: str, per_layer, layers: int, repeats: int, operands: dict) -> float | str:
    """Mean GPU time of the kernel events called `name` while a jit of per_layer(layer, operands) for each layer
    runs (or the first line of the error of a tiling that does not compile)."""
    try:
        return profile_step.launch_us(name, per_layer, layers, repeats, operands)
    except Exception as e:  # noqa: BLE001 -- a tiling Triton refuses is a result of the sweep
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def sweep(args: ModelArgs, layers: int, batch: int, context: int, repeats: int, kernels: set[str],
          split_counts: list[int], output_tiles: list[dict] = OUTPUT_TILES, fp8_wkv_b: bool = False,
          split_blocks: tuple[int, ...] = OUTPUT_SPLIT_BLOCKS, decode_tiles: list[dict] = DECODE_TILES,
          split_output_tiles: list[dict] = ({},)):
    """Yield one row a (kernel, tiling) at this batch, or one a split count."""
    window = cache_window(context + 64, args.max_seq_len)
    x = operands(args, layers, batch, window, fp8_wkv_b)
    row = dict(batch=batch, window=window)
    if "query" in kernels:
        yield from _query_rows(args, x, row, layers, repeats)
    if "decode" in kernels:
        yield from _decode_rows(args, x, row, layers, repeats, decode_tiles)
    if "output" in kernels:
        yield from _output_rows(args, x, row, layers, repeats, output_tiles, split_blocks)
    if "splits" in kernels:
        yield from _split_rows(args, x, row, layers, repeats, split_counts, split_output_tiles)


def _query_rows(args: ModelArgs, x: dict, row: dict, layers: int, repeats: int):
    nope = args.qk_nope_head_dim
    for tiles in QUERY_TILES:
        run = lambda layer, x, t=tiles: mla_absorb_query(x["q"], x["wkv_b"], layer, nope=nope,  # noqa: E731
                                                         rope=(x["cos"], x["sin"], True),
                                                         wkv_b_scale=x["wkv_b_scale"], **t)
        yield dict(row, kernel="mla_absorb_query", tiles=tiles,
                   us=launch_us("mla_absorb_query", run, layers, repeats, x))


def _decode_rows(args: ModelArgs, x: dict, row: dict, layers: int, repeats: int, decode_tiles: list[dict]):
    window, scale = row["window"], args.qk_head_dim ** -0.5
    for tiles in decode_tiles:
        run = lambda layer, x, t=tiles: mla_decode_splits(x["q_latent"], x["q_pe"], x["kv"], x["pe"],  # noqa: E731
                                                          layer, x["lengths"], kv_len=window, scale=scale, **t)
        yield dict(row, kernel="mla_decode", tiles=tiles, splits=default_splits(row["batch"], args.n_heads, window,
                                                                                tiles.get("block_t", BLOCK_T), 16),
                   us=launch_us("mla_decode", run, layers, repeats, x))


def _output_rows(args: ModelArgs, x: dict, row: dict, layers: int, repeats: int, output_tiles: list[dict],
                 split_blocks: tuple[int, ...]):
    window, scale = row["window"], args.qk_head_dim ** -0.5
    for block_t, tiles in itertools.product(split_blocks, output_tiles):
        acc, m, l = mla_decode_splits(x["q_latent"], x["q_pe"], x["kv"], x["pe"], 0, x["lengths"], kv_len=window,
                                      scale=scale, block_t=block_t)
        run = lambda layer, x, t=tiles: mla_decode_output(  # noqa: E731
            x["acc"], x["m"], x["l"], x["q_latent"], x["q_pe"], x["new_kv"], x["new_pe"], x["wkv_b"], layer,
            scale=scale, v_dim=args.v_head_dim, wkv_b_scale=x["wkv_b_scale"], **t)
        yield dict(row, kernel="mla_decode_output", tiles=tiles, splits=int(acc.shape[1]),
                   us=launch_us("mla_decode_output", run, layers, repeats, dict(x, acc=acc, m=m, l=l)))


def _split_rows(args: ModelArgs, x: dict, row: dict, layers: int, repeats: int, split_counts: list[int],
                output_tiles: list[dict] = ({},)):
    """Per split count: the cache kernel, the merge + output kernel on its splits at each of `output_tiles`, and
    their sum."""
    window, scale = row["window"], args.qk_head_dim ** -0.5
    chosen = default_splits(row["batch"], args.n_heads, window, 64, 16)
    for splits in split_counts:
        decode = lambda layer, x, s=splits: mla_decode_splits(  # noqa: E731
            x["q_latent"], x["q_pe"], x["kv"], x["pe"], layer, x["lengths"], kv_len=window, scale=scale, splits=s)
        acc, m, l = decode(0, x)
        decode_us = launch_us("mla_decode", decode, layers, repeats, x)
        yield dict(row, kernel="decode", tiles=dict(default=splits == chosen), splits=splits, us=decode_us)
        for tiles in output_tiles:
            output = lambda layer, x, t=tiles: mla_decode_output(  # noqa: E731
                x["acc"], x["m"], x["l"], x["q_latent"], x["q_pe"], x["new_kv"], x["new_pe"], x["wkv_b"], layer,
                scale=scale, v_dim=args.v_head_dim, wkv_b_scale=x["wkv_b_scale"], **t)
            output_us = launch_us("mla_decode_output", output, layers, repeats, dict(x, acc=acc, m=m, l=l))
            times = (decode_us, output_us)
            total = sum(times) if all(isinstance(t, float) for t in times) else "; ".join(
                str(t) for t in times if not isinstance(t, float))
            label = dict(default=splits == chosen, **tiles)
            yield dict(row, kernel="output", tiles=label, splits=splits, us=output_us)
            yield dict(row, kernel="decode+output", tiles=label, splits=splits, us=total)


def main() -> None:
    o = parse_args()
    args = ModelArgs.from_reference_json(o.config)
    layers = min(o.layers, args.n_layers)
    batches = [int(b) for b in o.batches.split(",")]
    args = args.replace(max_batch_size=max(batches), max_seq_len=o.context + 64)
    rows = []
    for batch in batches:
        for row in sweep(args, layers, batch, o.context, o.repeats, set(o.kernels.split(",")),
                         [int(s) for s in o.splits.split(",")], o.output_tiles, o.wkv_b == "fp8",
                         tuple(int(b) for b in o.split_blocks.split(",")), o.decode_tiles, o.split_output_tiles):
            rows.append(row)
            print(row_line(row), flush=True)
    if o.out:
        with open(o.out, "w") as f:
            json.dump(dict(config=o.config, device=jax.devices()[0].device_kind, jax=jax.__version__,
                           layers=layers, context=o.context, wkv_b=o.wkv_b, rows=rows), f, indent=1)


def row_line(r: dict) -> str:
    tiles = " ".join(f"{k}={v}" for k, v in r["tiles"].items())
    splits = f" splits={r['splits']}" if "splits" in r else ""
    us = f"{r['us']:7.2f} us" if isinstance(r["us"], float) else r["us"]
    return f"b={r['batch']:<3d} {r['kernel']:18s} {tiles:40s}{splits:11s} {us}"


if __name__ == "__main__":
    main()
