"""The jitted, shard_mapped forward step of a model, and what every step builder is made from.

`StepParts` holds what a step is built from (a `Model` keeps them as `model.parts`): the plain step
(`make_step`) and the speculative ones (`speculative.make_mtp_steps`) all take one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..config import ModelArgs
from ..model.cache import cache_specs
from ..model.transformer import step_context
from ..options import RunOptions
from ..sharding import Layout


# XLA command buffers for every kind of launch a decode step makes, from the first kernel on
# (`xla_gpu_graph_min_graph_size` 1): the compiled step runs as CUDA graphs.
COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
                   "xla_gpu_graph_min_graph_size": 1}


class StepParts(NamedTuple):
    """A model's graph, how its state is split (partition specs), its config, mesh, options and layout."""

    graphdef: nnx.GraphDef
    state_specs: Any
    args: ModelArgs
    mesh: Mesh
    options: RunOptions
    layout: Layout

    @property
    def cache_specs(self):
        return cache_specs(self.options.attn_impl, self.layout)

    def _identity(self) -> tuple:
        leaves, structure = jax.tree.flatten(self.state_specs)
        return self.graphdef, structure, tuple(leaves), self.args, self.mesh, self.options, self.layout

    # Hashable by value, so that the step builders below memoize on it (`step_builder`).
    def __hash__(self) -> int:
        return hash(self._identity())

    def __eq__(self, other) -> bool:
        return isinstance(other, StepParts) and self._identity() == other._identity()


def step_builder(make):
    """Memoize a builder of jitted steps on its `StepParts`: a second `Model` of the same graph, split,
    config, mesh and options gets the first one's jitted functions, whose traces and compiled programs
    it then reuses, instead of tracing, lowering and compiling every step again. Bounded, so that a
    session trying many configs does not keep every one's programs."""
    return functools.lru_cache(maxsize=16)(make)


def decode_graphs(parts: StepParts) -> bool:
    """Whether the single-token decode steps run as CUDA graphs (`RunOptions.decode_graph`; auto: on a
    GPU mesh)."""
    if parts.options.decode_graph != "auto":
        return parts.options.decode_graph == "on"
    return parts.mesh.devices.flat[0].platform == "gpu"


def decode_step_parts(parts: StepParts) -> tuple[StepParts, dict | None]:
    """What a single-token decode step is traced from and compiled with: under decode graphs, `parts`
    with the layer scans unrolled and the command-buffer options; otherwise `parts` as they are."""
    if not decode_graphs(parts):
        return parts, None
    return parts._replace(options=dataclasses.replace(parts.options, unroll=True)), COMMAND_BUFFERS


@step_builder
def make_step(parts: StepParts):
    """The jitted forward step `(state, cache, tokens, start_pos, last_index, *, kv_len) -> (logits, cache)`.

    tokens (B, S) int32; start_pos (B,) int32, each row's position of tokens[:, 0]; last_index (B,)
    int32, the chunk index whose logits are returned (float32, (B, vocab)). The cache (argument 1)
    is donated and comes back updated at positions [start_pos, start_pos + S) of rows [0, B);
    attention reads cache positions [0, kv_len), a static bound that must cover every row's end.
    When the layout splits the batch, B is padded to a multiple of its parts and the rows are dealt
    out by `Layout.row_order`; padding rows sit past the cache's end (their cache writes are
    dropped) and send no token to the routed experts (`StepContext.valid`).
    """
    layout, options = parts.layout, parts.options
    rows = layout.spec("batch")

    def local_step(state, cache, tokens, positions, last_index, valid, kv_len, padded):
        model = nnx.merge(parts.graphdef, state)
        ctx = step_context(parts.args, positions, kv_len, options, layout, valid=valid if padded else None)
        with options.precision_scope():  # float32: full-precision dots (no TF32)
            return model(tokens, ctx, cache, last_index)

    def step(state, cache, tokens, start_pos, last_index, *, kv_len: int):
        positions = start_pos[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        batch = tokens.shape[0]
        split = layout.size("batch") > 1
        padded = layout.padded_batch(batch)
        valid = jnp.arange(padded) < batch
        if split:
            order = layout.row_order(padded)
            end = next(iter(cache.values())).shape[2]  # padding rows' positions: past the cache

            def deal(a, fill=0):
                return jnp.pad(a, [(0, padded - batch)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)[order]

            tokens, positions, last_index, valid = deal(tokens), deal(positions, end), deal(last_index), valid[order]
        sharded = jax.shard_map(functools.partial(local_step, kv_len=kv_len, padded=padded != batch),
                                mesh=parts.mesh, in_specs=(parts.state_specs, parts.cache_specs, rows, rows, rows, rows),
                                out_specs=(rows, parts.cache_specs), check_vma=False)
        logits, cache = sharded(state, cache, tokens, positions, last_index, valid)
        if split:
            logits = logits[np.argsort(order)[:batch]]
        return logits, cache

    return jax.jit(step, static_argnames=("kv_len",), donate_argnums=(1,))
