"""One decoder layer (attention, then a dense MLP or an MoE) and the scan that runs a stack of them.

Layers of one kind are stacked (leading layer axis on every parameter) and run by `jax.lax.scan`,
so compile time does not grow with depth.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import fp8_gemm_reads_stacks_in_place

from ..config import ModelArgs
from ..options import StepContext
from .attention import MLA
from .layers import RMSNorm, dequant_kernel_applies, norm_kernel_applies, projection_kernel_applies
from .moe import MLP, MoE, gate_in_norm


class Block(nnx.Module):
    """h = x + attn(attn_norm(x)); out = h + ffn(ffn_norm(h)), with a dense MLP or an MoE as ffn."""

    def __init__(self, args: ModelArgs, *, moe: bool, stack: tuple[int, ...] = (), param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        self.attn = MLA(args, stack=stack, param_dtype=param_dtype, rngs=rngs)
        if moe:
            self.ffn = MoE(args, stack=stack, param_dtype=param_dtype, rngs=rngs)
        else:
            self.ffn = MLP(args.dim, args.inter_dim, stack=stack, param_dtype=param_dtype, fp8=args.quantized,
                           rngs=rngs)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, stack=stack)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, stack=stack)

    def __call__(self, x: jnp.ndarray, ctx: StepContext, cache: dict | None, layer, stack_index=None, *,
                 loads: bool = False):
        """-> (block output, this layer's new cache entries), and with `loads` the routed experts'
        loads (E,) (None for a dense block). `layer` (the model's layer number) indexes the cache
        (None: no cache, the chunk attends to itself); `stack_index` (the layer's place in its
        stack) the weight stacks that hold every layer of it (see `run_stack`)."""
        fp8 = self.attn.wkv_a.scale is not None and ctx.options.gemm_impl == "fp8"
        with jax.named_scope("attention"):  # attn_norm inside: decode-sized steps run it in the projections' launch
            attn_out, entries = self.attn(x, ctx, cache, layer, stack_index, norm=self.attn_norm)
        with jax.named_scope("ffn_norm"):
            normed, h, normed_fp8, logits = self._ffn_norm(x, attn_out, ctx, stack_index, fp8)
        expert_loads = None
        if isinstance(self.ffn, MoE):
            ffn_out = self.ffn(normed, ctx, stack_index, loads=loads, x_fp8=normed_fp8, logits=logits)
            if loads:
                ffn_out, expert_loads = ffn_out
        else:
            with jax.named_scope("mlp"):
                ffn_out = self.ffn(normed, ctx, reduce=True, layer=stack_index, x_fp8=normed_fp8)
        return (h + ffn_out, entries, expert_loads) if loads else (h + ffn_out, entries)

    def _ffn_norm(self, x, attn_out, ctx: StepContext, stack_index, fp8: bool) -> tuple:
        """(normed h, h = x + attn_out, normed h's act_quant for the fp8 GEMMs or None, the MoE gate's logits of
        normed h or None): the gate's GEMM inside the norm's launch where `gate_in_norm` says so."""
        in_norm = isinstance(self.ffn, MoE) and gate_in_norm(ctx, x.shape[0] * x.shape[1])
        norm = dict(residual=attn_out, layer=stack_index, gate=self.ffn.gate.weight[...] if in_norm else None)
        if fp8:
            out = self.ffn_norm.with_fp8(x, scale_fmt=ctx.scale_fmt, **norm)
        else:
            normed, h, *logits = self.ffn_norm(x, **norm)
            out = (normed, h, None, *logits)
        return out if in_norm else (*out, None)


WHOLE_STACKS = ("experts", "shared_experts", "wkv_b")
# fp8 dense projections are read in place by the fp8 GEMM's Triton kernel (gemm_impl "fp8", decode-sized
# steps) and by `Linear.dequantizing_kernel` (gemm_impl "bf16", decode-sized steps); XLA's GEMMs and the
# Mosaic kernel slice them
FP8_GEMM_STACKS = ("wq", "wq_a", "wq_b", "wkv_a", "wo", "w1", "w2", "w3")
# read in place by the one-launch RMSNorm (decode-sized steps, `norm_kernel_applies`)
NORM_STACKS = ("attn_norm", "ffn_norm", "q_norm", "kv_norm")
# plain (not fp8) projections and their norms, read in place by the projections' one launch (`layers.project`,
# decode-sized steps, `projection_kernel_applies`)
PROJECTION_STACKS = ("wq", "wq_a", "wq_b", "wkv_a", "wo", "attn_norm", "q_norm")


def _is_gate_weight(path, _) -> bool:
    """The MoE gate's weight, read in place by the norm before the MoE where it computes the logits (`gate_in_norm`;
    the gate's bias stays scanned over, for the router)."""
    return tuple(path[-2:]) == ("gate", "weight")


def run_stack(stack: Block, x: jnp.ndarray, ctx: StepContext, cache: dict | None, first_layer: int, *,
              loads: bool = False, remat: bool = False):
    """Apply the stacked layers in order with `jax.lax.scan`, or one after another (`RunOptions.unroll`),
    cache rows indexed by global layer; returns the output and the stacked new cache entries
    (depth, B, S, ...), and with `loads` the stacked expert loads (depth, E) (None for dense layers).
    `remat` recomputes each layer's activations in the backward pass instead of keeping them (training)."""
    # the weights that Pallas kernels read stay whole, the kernels indexing the layer (a slice of the
    # stack passed to a kernel is copied out first): routed and shared experts, wkv_b, and the fp8
    # projections in the steps where a kernel reads them in place (FP8_GEMM_STACKS); the rest is scanned over
    rows, fp8 = x.shape[0] * x.shape[1], stack.attn.wkv_a.scale is not None
    in_place = fp8 and ((ctx.options.gemm_impl == "fp8" and fp8_gemm_reads_stacks_in_place(rows))
                        or dequant_kernel_applies(ctx.options.gemm_impl, rows))
    names = (WHOLE_STACKS + (FP8_GEMM_STACKS if in_place else ()) + (NORM_STACKS if norm_kernel_applies(rows) else ())
             + (PROJECTION_STACKS if projection_kernel_applies(rows, fp8) else ()))
    gate = (_is_gate_weight,) if gate_in_norm(ctx, rows) else ()
    graphdef, whole, rest = nnx.split(stack, nnx.Any(*map(nnx.PathContains, names), *gate), ...)
    depth = stack.attn_norm.weight.shape[0]  # every parameter has the layer axis; `rest` can be empty

    def one_layer(h, xs):
        layer_state, index = xs
        block = nnx.merge(graphdef, whole, layer_state)
        out = block(h, ctx, cache, first_layer + index, index, loads=loads)
        return out[0], out[1:]

    if remat:
        one_layer = jax.checkpoint(one_layer)
    if not ctx.options.unroll:
        h, stacked = jax.lax.scan(one_layer, x, (rest, jnp.arange(depth)))
        return (h, *stacked)
    h, outs = x, []  # unrolled: a Python loop (a scan of length 1 would still leave a while loop)
    for index in range(depth):
        h, out = one_layer(h, (jax.tree.map(lambda a: a[index], rest), jnp.int32(index)))
        outs.append(out)
    return (h, *jax.tree.map(lambda *layers: jnp.stack(layers), *outs))
