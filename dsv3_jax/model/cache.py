"""The attention cache: one stacked pytree for all layers, allocated on the mesh.

absorb: kv (L, B, T, kv_lora_rank) and pe (L, B, T, rope_dim);
naive:  k (L, B, T, H, qk_head_dim) and v (L, B, T, H, v_head_dim);
rows split as the layout splits "batch", heads as it splits "heads" (`cache_specs`). With a
batch split, a step's row i lives in cache row (i % parts) * (B / parts) + i // parts
(`Layout.row_order`): the cache's rows are an internal order, read only by the steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import ModelArgs
from ..sharding import Layout


def cache_window(end: int, max_seq_len: int) -> int:
    """The attention window for positions < end: the next power of two (at least 64), capped.

    A step is compiled once per window, so windows come in few sizes; attention reads only
    cache positions [0, window)."""
    return min(max_seq_len, max(64, 1 << max(0, end - 1).bit_length()))


def cache_shapes(args: ModelArgs, attn_impl: str, batch: int, length: int,
                 mtp: bool = False) -> dict[str, tuple[int, ...]]:
    layers = args.n_layers + int(mtp)  # the MTP block's cache is layer n_layers
    if attn_impl == "naive":
        return {"k": (layers, batch, length, args.n_heads, args.qk_head_dim),
                "v": (layers, batch, length, args.n_heads, args.v_head_dim)}
    return {"kv": (layers, batch, length, args.kv_lora_rank), "pe": (layers, batch, length, args.qk_rope_head_dim)}


def cache_specs(attn_impl: str, layout: Layout) -> dict[str, P]:
    """The PartitionSpec of each cache array under `layout`."""
    if attn_impl == "naive":
        spec = layout.spec("layers", "batch", None, "heads", None)
        return {"k": spec, "v": spec}
    spec = layout.spec("layers", "batch", None, "kv_lora")
    return {"kv": spec, "pe": spec}


def allocate_cache(args: ModelArgs, attn_impl: str, mesh: Mesh, layout: Layout, dtype, batch: int | None = None,
                   length: int | None = None, mtp: bool = False) -> dict[str, jax.Array]:
    """A zeroed cache for (batch, length), default (max_batch_size, max_seq_len), placed on the mesh
    as `layout` splits it; with `mtp`, one more layer (index n_layers) for the MTP block. Its rows
    are rounded up to a multiple of the parts the layout splits the batch into."""
    rows = layout.padded_batch(batch or args.max_batch_size)
    shapes = cache_shapes(args, attn_impl, rows, length or args.max_seq_len, mtp)
    specs = cache_specs(attn_impl, layout)
    shardings = {name: NamedSharding(mesh, _without_trailing_none(specs[name])) for name in shapes}
    make = jax.jit(lambda: {name: jnp.zeros(shape, dtype) for name, shape in shapes.items()},
                   out_shardings=shardings)
    return make()


def _without_trailing_none(spec: P) -> P:
    """`spec` in the form a jitted step's outputs carry (trailing unsplit axes dropped): the cache a
    step returns then has the sharding of the one it was given, which the step's compiled program
    is keyed by; an equal split spelled otherwise would trace and compile every step once more."""
    parts = tuple(spec)
    while parts and parts[-1] is None:
        parts = parts[:-1]
    return P(*parts)
