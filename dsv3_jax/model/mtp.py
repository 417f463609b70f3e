"""DeepSeek-V3's multi-token-prediction (MTP) module (DeepSeek-V3 technical report §2.2).

For a position i whose next token t_{i+1} is known:
    e = enorm(Embed(t_{i+1}));  h = hnorm(H_i);  x = eh_proj(concat[e, h])
    y = Block(x) at position i + 1;  logits_{i+2} = Head(shared_head.norm(y))
with H_i the main model's hidden state after its final norm, and Embed/Head the main model's.
The checkpoint's names for it are in dsv3_jax.checkpoint.mtp.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ..config import ModelArgs
from ..options import StepContext
from .block import Block
from .layers import Linear, RMSNorm


class SharedHead(nnx.Module):
    """The MTP module's own final norm (its head is the main model's)."""

    def __init__(self, args: ModelArgs):
        self.norm = RMSNorm(args.dim, args.norm_eps)


class MTP(nnx.Module):
    """One multi-token-prediction module: enorm, hnorm, eh_proj, a decoder block (MoE, as in V3
    when the model has MoE layers) and the shared-head norm."""

    def __init__(self, args: ModelArgs, *, param_dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = Linear(2 * args.dim, args.dim, param_dtype=param_dtype, fp8=args.quantized, rngs=rngs)
        self.block = Block(args, moe=args.n_moe_layers > 0, param_dtype=param_dtype, rngs=rngs)
        self.shared_head = SharedHead(args)

    def inputs(self, embedded_next: jnp.ndarray, hidden: jnp.ndarray, ctx: StepContext) -> jnp.ndarray:
        """eh_proj(concat[enorm(e), hnorm(h)]): the block's input (B, S, dim)."""
        x = jnp.concatenate([self.enorm(embedded_next), self.hnorm(hidden).astype(embedded_next.dtype)], axis=-1)
        return self.eh_proj(x, **ctx.gemm)

    def __call__(self, embedded_next: jnp.ndarray, hidden: jnp.ndarray, ctx: StepContext, cache: dict | None = None,
                 layer=0, *, loads: bool = False):
        """-> (normalised output (B, S, dim) for the main head, the block's new cache entries), and
        with `loads` the block's expert loads (as `Block`); ctx.positions are those of t_{i+1}."""
        y, *rest = self.block(self.inputs(embedded_next, hidden, ctx), ctx, cache, layer, loads=loads)
        return (self.shared_head.norm(y), *rest)
