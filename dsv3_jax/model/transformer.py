"""Transformer: the DeepSeek-V3 forward pass for the shard that one rank holds.

Layers of one kind are stacked (leading layer axis on every parameter) and run by `jax.lax.scan`,
so compile time does not grow with depth: the dense-MLP layers form one stack, the MoE layers
another. The cache is one stacked pytree for all layers: the scans read it, each layer returns its
new entries, and one scatter after the scans stores them all (in place, the cache being donated).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelArgs
from ..options import RunOptions, StepContext
from ..sharding import Layout
from .attention import write_cache, write_layer_cache
from .block import Block, run_stack
from .layers import Linear, ParallelEmbedding, RMSNorm
from .mtp import MTP
from .rope import inverse_frequencies, rotary_angles


def step_context(args: ModelArgs, positions: jnp.ndarray, kv_len: int, options: RunOptions, layout: Layout,
                 kv_start: int = 0, valid: jnp.ndarray | None = None) -> StepContext:
    """The context of one forward pass over tokens at `positions` (B, S): their rotary angles, the
    cache window [kv_start, kv_len) attention reads, and how the pass is run and split."""
    cos, sin = rotary_angles(positions, inverse_frequencies(args), args.rope_attention_factor)
    return StepContext(positions, cos, sin, kv_len, options, args.scale_fmt, kv_start, layout, valid)


class Transformer(nnx.Module):
    """Embedding, the dense and MoE layer stacks, final norm and the vocabulary-parallel head."""

    def __init__(self, args: ModelArgs, *, param_dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None,
                 mtp: bool = False):
        self.embed = ParallelEmbedding(args.vocab_size, args.dim, param_dtype=param_dtype, rngs=rngs)
        common = dict(param_dtype=param_dtype, rngs=rngs)
        self.dense_layers = (Block(args, moe=False, stack=(args.n_dense_layers,), **common)
                             if args.n_dense_layers else None)
        self.moe_layers = Block(args, moe=True, stack=(args.n_moe_layers,), **common) if args.n_moe_layers else None
        self.n_dense_layers = args.n_dense_layers
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = Linear(args.dim, args.vocab_size, axes=("vocab_out", "embed"), param_dtype=param_dtype, rngs=rngs)
        # the multi-token-prediction module (layer n_layers of the checkpoint and of the cache)
        self.mtp = MTP(args, param_dtype=param_dtype, rngs=rngs) if mtp else None
        self.n_layers = args.n_layers

    def hidden(self, tokens: jnp.ndarray, ctx: StepContext, cache: dict | None, *, loads: bool = False,
               remat: bool = False):
        """tokens (B, S) -> the final-normed hidden states (B, S, dim), what the head sees, and the
        cache with this chunk's entries of every main layer stored (None: no cache, each chunk
        attends to itself, as in training). With `loads`, also the MoE layers' expert loads
        (n_moe_layers, E), or None; `remat` as in `run_stack`."""
        with jax.named_scope("embed"):
            h = self.embed(tokens, ctx.layout)
        entries, moe_loads = [], None
        for stack, first, name in ((self.dense_layers, 0, "dense_layers"),
                                   (self.moe_layers, self.n_dense_layers, "moe_layers")):
            if stack is not None:
                with jax.named_scope(name):
                    h, new, *stack_loads = run_stack(stack, h, ctx, cache, first, loads=loads, remat=remat)
                entries.append(new)
                moe_loads = stack_loads[0] if stack is self.moe_layers and loads else moe_loads
        if cache is not None:
            with jax.named_scope("cache_write"):
                cache = write_cache(cache, jax.tree.map(lambda *e: jnp.concatenate(e), *entries), ctx.positions)
        with jax.named_scope("norm"):
            h = self.norm(h)
        return (h, cache, moe_loads) if loads else (h, cache)

    def logits(self, h: jnp.ndarray, layout: Layout) -> jnp.ndarray:
        """Normed hidden states (B, ..., dim) -> float32 logits (B, ..., vocab), the vocabulary
        gathered over its ranks (and, when the batch is split over them too, the rows gathered
        first and this rank's taken back)."""
        gathered, _ = layout.reduction("vocab_out")
        with jax.named_scope("head"):
            logits = self.head(layout.gather_rows(h, gathered), out_dtype=jnp.float32)
        vocab = layout.axes("vocab_out")
        if vocab:
            logits = jax.lax.all_gather(logits, vocab, axis=logits.ndim - 1, tiled=True)
        return layout.own_rows(logits, gathered)

    def mtp_hidden(self, tokens: jnp.ndarray, hidden: jnp.ndarray, ctx: StepContext,
                   cache: dict) -> tuple[jnp.ndarray, dict]:
        """The MTP module at ctx.positions (those of `tokens`, the known next tokens t_{i+1}) on the
        main model's normed hidden states H_i (B, S, dim): its normed output (B, S, dim), whose
        logits (`self.logits`) predict t_{i+2}, and the cache with its entries stored at layer
        n_layers. The MTP cache holds no position 0 (the module first runs at position 1):
        `ctx.kv_start` must be 1."""
        with jax.named_scope("mtp"):
            y, entries = self.mtp(self.embed(tokens, ctx.layout), hidden, ctx, cache, self.n_layers)
            return y, write_layer_cache(cache, entries, ctx.positions, self.n_layers)

    def __call__(self, tokens: jnp.ndarray, ctx: StepContext, cache: dict,
                 last_index: jnp.ndarray) -> tuple[jnp.ndarray, dict]:
        """tokens (B, S) -> float32 logits (B, vocab) at each row's `last_index`, and the updated cache."""
        h, cache = self.hidden(tokens, ctx, cache)
        h = jnp.take_along_axis(h, last_index[:, None, None], axis=1)[:, 0]
        return self.logits(h, ctx.layout), cache
