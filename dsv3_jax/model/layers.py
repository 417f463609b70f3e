"""Building blocks: Linear (high-precision or block-scaled fp8 weight), RMSNorm, vocab-parallel embedding.

Every module is written for the local shard it sees inside `jax.shard_map`: sizes come from its
arrays, never from the config, and the collectives name the mesh axes the step's `Layout` gives.
Parameters carry their logical axes (`sharding.LOGICAL_AXES`, one per array axis, None for an axis
never split) as the Variable metadata `partition`; the layout maps them to mesh axes.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import FP8_BLOCK, FP8_DTYPE, act_quant, cdiv, dequant_gemm, fp8_gemm, use_interpret, weight_dequant
from pallas_kernels.norm import gate_logits_ref, norm_chunk, rms_norm, rms_norm_fp8
from pallas_kernels.projection import VECTOR_MAX_ROWS, norm_project

from ..sharding import LOGICAL_AXES, Layout


def param(value, partition) -> nnx.Param:
    """A parameter with its logical axes (a tuple, one entry per axis: a `LOGICAL_AXES` name or None)."""
    if len(partition) != value.ndim:
        raise ValueError(f"partition {partition} does not match a parameter of shape {value.shape}")
    unknown = [name for name in partition if name is not None and name not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"unknown logical axis {unknown[0]!r}; the logical axes are {', '.join(LOGICAL_AXES)}")
    return nnx.Param(value, partition=tuple(partition))


def init_normal(rngs: nnx.Rngs | None, shape, dtype, std: float):
    """Random normal weights (for models built without a checkpoint); zeros when rngs is None."""
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def init_fp8(rngs: nnx.Rngs | None, shape):
    """Random e4m3 values of magnitude < 2, drawn as raw bytes (no float32 copy of a huge weight);
    clearing the top exponent bit also rules out the NaN encodings."""
    if rngs is None:
        return jnp.zeros(shape, FP8_DTYPE)
    bits = jax.random.bits(rngs.params(), shape, jnp.uint8) & jnp.uint8(0b10111111)
    return jax.lax.bitcast_convert_type(bits, FP8_DTYPE)


# fp8 weights under gemm_impl "bf16" in steps of at most this many rows (decode, speculative verification):
# dequant_gemm dequantizes the weight tile by tile as it reads the fp8 bytes, and reads its layer of a stack
# in place, where dequantizing first writes and reads the whole weight in bf16 every step
DEQUANT_KERNEL_MAX_ROWS = 64


def dequant_kernel_applies(gemm_impl: str, rows: int) -> bool:
    """Whether fp8 projections of a step of `rows` rows run `Linear`'s in-kernel dequantizing form (on a GPU)."""
    return gemm_impl == "bf16" and rows <= DEQUANT_KERNEL_MAX_ROWS and not use_interpret()


class Linear(nnx.Module):
    """y = x W^T with W (out, in), optionally stacked (leading layer / expert axes).

    `axes` names the logical axes of (out, in) (None: never split), `stack_axes` those of the
    stack. When the layout splits `in`, y is partial: the caller's psum, or `reduce` (the mesh
    axes to sum over, in float32), completes it. With `fp8=True` the weight is float8_e4m3fn
    and `scale` holds one float32 per 128x128 block; `gemm_impl` then picks between dequantising
    the weight (`"bf16"`) and quantising the activations for the scaled fp8 GEMM (`"fp8"`).
    """

    def __init__(self, in_features: int, out_features: int, *, axes: tuple = (None, None),
                 stack: tuple[int, ...] = (), stack_axes: tuple = (), param_dtype=jnp.bfloat16,
                 fp8: bool = False, rngs: nnx.Rngs | None = None):
        stack_partition = tuple(stack_axes) or ("layers",) * len(stack)
        split = tuple(axes)
        shape = (*stack, out_features, in_features)
        std = 1.0 / math.sqrt(in_features)
        if fp8:
            self.weight = param(init_fp8(rngs, shape), stack_partition + split)
            scale_shape = (*stack, cdiv(out_features, FP8_BLOCK), cdiv(in_features, FP8_BLOCK))
            self.scale = param(jnp.full(scale_shape, std, jnp.float32), stack_partition + split)
        else:
            self.weight = param(init_normal(rngs, shape, param_dtype, std), stack_partition + split)
            self.scale = None

    def dequantizing_kernel(self, x: jnp.ndarray, layer=None) -> jnp.ndarray:
        """x W^T in float32 for an fp8 W, gemm_impl "bf16"'s math (W's tiles dequantized to x's dtype) from
        `dequant_gemm` (split over K, so that a weight of few output columns keeps every SM reading): it reads
        the fp8 weight, and layer `layer` of a stack in place."""
        return dequant_gemm(x, self.weight[...], self.scale[...], jnp.float32, layer=layer)

    def dequantized(self, dtype) -> jnp.ndarray:
        """The weight in `dtype` (block scales applied when the weight is fp8)."""
        if self.scale is None:
            return self.weight[...].astype(dtype)
        return weight_dequant(self.weight[...], self.scale[...], block_size=FP8_BLOCK, out_dtype=dtype)

    def __call__(self, x: jnp.ndarray, *, gemm_impl: str = "bf16", scale_fmt: str | None = None,
                 reduce: tuple[str, ...] = (), out_dtype=None, layer=None, x_fp8=None) -> jnp.ndarray:
        """`layer`: where the weight holds its whole layer stack (L, out, in) -- `run_stack` keeps the
        ones the fp8 GEMM kernel reads so -- the layer to use; an (out, in) weight ignores it. `x_fp8`: x
        as `act_quant(x, scale_fmt=)` gives it, made already (`RMSNorm.with_fp8`), for the fp8 GEMM."""
        whole = layer is not None and self.weight.ndim == 3
        if self.scale is not None and gemm_impl == "fp8":
            xq, xs = x_fp8 if x_fp8 is not None else act_quant(x, block_size=FP8_BLOCK, scale_fmt=scale_fmt)
            y = fp8_gemm(xq, xs, self.weight[...], self.scale[...], out_dtype=jnp.float32,
                         layer=layer if whole else None)
        elif (self.scale is not None and x.shape[-1] % FP8_BLOCK == 0
              and dequant_kernel_applies(gemm_impl, math.prod(x.shape[:-1]))):
            y = self.dequantizing_kernel(x, layer if whole else None)
        else:
            w = (layer_of(self, layer) if whole else self).dequantized(x.dtype)
            y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if reduce:
            y = jax.lax.psum(y, reduce)
        return y.astype(out_dtype or x.dtype)


# steps of at most this many rows (decode, speculative verification) run RMSNorm, with the residual add
# before it, as one Pallas launch a row (`pallas_kernels.norm`) where XLA runs two kernels
NORM_KERNEL_MAX_ROWS = 64


def norm_kernel_applies(rows: int) -> bool:
    """Whether the RMSNorms of a step of `rows` rows run the one-launch kernel (on a GPU)."""
    return rows <= NORM_KERNEL_MAX_ROWS and not use_interpret()


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6, *, stack: tuple[int, ...] = (), axis: str = "embed"):
        self.eps = eps
        self.weight = param(jnp.ones((*stack, dim), jnp.float32), ("layers",) * len(stack) + (axis,))

    def __call__(self, x: jnp.ndarray, *, residual: jnp.ndarray | None = None, layer=None,
                 columns: int | None = None, gate: jnp.ndarray | None = None):
        """The norm of x's first `columns` (default: all of it); with `residual`, of h = x + residual,
        returned as (normed, h). `layer`: where the weight holds its whole layer stack (`run_stack` keeps
        it so where the kernel reads it), the layer to use. `gate`: the MoE gate's weight (E, dim), or its
        stack; then the gate's float32 logits of the normed rows come last (in the kernel's launch)."""
        weight = self.weight[...]
        layer = layer if weight.ndim == 2 else None
        columns = columns or x.shape[-1]
        if norm_kernel_applies(math.prod(x.shape[:-1])) and norm_chunk(columns):
            return rms_norm(x, weight, eps=self.eps, residual=residual, layer=layer,
                            columns=None if residual is not None else columns, gate=gate)
        h = x if residual is None else x + residual
        if layer is not None:
            weight = jax.lax.dynamic_index_in_dim(weight, layer, 0, keepdims=False)
        hf = h[..., :columns].astype(jnp.float32)
        hf = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + self.eps)
        normed = (hf * weight.astype(jnp.float32)).astype(x.dtype)
        out = (normed,) if residual is None else (normed, h)
        out += () if gate is None else (gate_logits_ref(normed, gate, layer=layer),)
        return out[0] if len(out) == 1 else out

    def with_fp8(self, x: jnp.ndarray, *, residual: jnp.ndarray | None = None, layer=None,
                 scale_fmt: str | None = None, gate: jnp.ndarray | None = None) -> tuple:
        """(normed, x + residual or None, the normed rows quantized as `act_quant(normed, scale_fmt=)` gives
        them, for the fp8 GEMMs that read them, or None where the one-launch kernel does not run); with `gate`
        (as `__call__`'s), its logits fourth."""
        weight = self.weight[...]
        if norm_kernel_applies(math.prod(x.shape[:-1])) and x.shape[-1] % FP8_BLOCK == 0:
            return rms_norm_fp8(x, weight, eps=self.eps, residual=residual, layer=layer if weight.ndim == 2 else None,
                                scale_fmt=scale_fmt, gate=gate)
        out = self(x, residual=residual, layer=layer, gate=gate)
        out = out if isinstance(out, tuple) else (out,)
        out = out if residual is not None else (out[0], None, *out[1:])  # (normed, summed or None[, logits])
        return (out[0], out[1], None, *out[2:])


# steps of at most this many rows (decode, speculative verification) run an RMSNorm and the projections that read it
# as one Pallas launch (`pallas_kernels.projection`), where XLA runs the norm and each projection apart; inside the
# layer scan XLA's GEMMs also copy their weights out of the stacks, which the launch reads in place
# (benchmarks/NOTES.md, "thresholds")
PROJECTION_KERNEL_MAX_ROWS = 32


def projection_kernel_applies(rows: int, fp8_weights: bool) -> bool:
    """Whether a step of `rows` rows runs `project`'s one-launch form (on a GPU): not for fp8 weights, where
    act_quant and the fp8 GEMM, or the dequantizing GEMM, measure faster at the V3 shape."""
    return rows <= PROJECTION_KERNEL_MAX_ROWS and not fp8_weights and not use_interpret()


def project(linears, x: jnp.ndarray, *, norm: RMSNorm | None = None, norm_scope: str = "norm", gemm_impl: str = "bf16",
            scale_fmt: str | None = None, layer=None, reduce: tuple[str, ...] = (), out_dtype=None, x_fp8=None) -> list:
    """[linear(norm(x)) for each of `linears`] (x itself where `norm` is None), in decode-sized steps on a GPU as one
    launch (`norm_project`: the norm in the projections' prologue, the weights and the norm's weight read at `layer`
    of their stacks in place); else the norm's kernel or XLA's (named `norm_scope` in profiles), then each Linear
    (see `Linear.__call__`; `x_fp8`, x's act_quant made already, goes to them where there is no norm)."""
    kernel = _projection_kernel(linears, x, norm, layer)
    if kernel is not None:
        outs = norm_project(x, **kernel, out_dtype=jnp.float32 if reduce else out_dtype)
        return [(jax.lax.psum(y, reduce) if reduce else y).astype(out_dtype or x.dtype) for y in outs]
    fp8 = linears[0].scale is not None and gemm_impl == "fp8"
    if norm is not None:
        with jax.named_scope(norm_scope):
            x, _, x_fp8 = (norm.with_fp8(x, layer=layer, scale_fmt=scale_fmt) if fp8
                           else (norm(x, layer=layer), None, None))
    return [linear(x, gemm_impl=gemm_impl, scale_fmt=scale_fmt, reduce=reduce, out_dtype=out_dtype, layer=layer,
                   x_fp8=x_fp8) for linear in linears]


# projections without a norm run `norm_project` as vector products (a few rows, <= VECTOR_MAX_ROWS) only against at
# least this many bytes of weights a layer (the dense MLP's w1 + w3, w2), as a dot (more rows) only against fewer
# (attention's wo): on either side of it XLA's GEMV measured faster
BIG_PROJECTION_BYTES = 32 * 2**20


def _projection_kernel(linears, x, norm, layer) -> dict | None:
    """`norm_project`'s arguments for `project`, or None where its one launch does not apply: more rows than
    PROJECTION_KERNEL_MAX_ROWS, no GPU, fp8 weights (`projection_kernel_applies`), no norm and a few rows against less
    than BIG_PROJECTION_BYTES of weights or more rows against more, weights in another dtype than x or not all read in
    place."""
    rows = math.prod(x.shape[:-1])
    if not projection_kernel_applies(rows, any(linear.scale is not None for linear in linears)):
        return None
    weights = [linear.weight[...] for linear in linears]
    layer_bytes = sum(w.shape[-2] * w.shape[-1] * w.dtype.itemsize for w in weights)
    if norm is None and (rows <= VECTOR_MAX_ROWS) != (layer_bytes >= BIG_PROJECTION_BYTES):
        return None
    stacked = {w.ndim == 3 for w in weights} | ({norm.weight.ndim == 2} if norm is not None else set())
    if len(stacked) != 1 or (True in stacked and layer is None) or any(w.dtype != x.dtype for w in weights):
        return None
    return dict(weights=weights, norm=None if norm is None else norm.weight[...],
                eps=norm.eps if norm is not None else 1e-6, layer=layer if True in stacked else None)


class ParallelEmbedding(nnx.Module):
    """Vocabulary-parallel embedding: each rank holds a contiguous range of rows ("vocab_in").

    Ids outside the local range look up row 0 and are zeroed; a sum over the ranks assembles
    the full embedding (when the batch is split over the same devices, the token ids are gathered
    first and the sum reduce-scattered back: `Layout.reduction`).
    """

    def __init__(self, vocab_size: int, dim: int, *, param_dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.weight = param(init_normal(rngs, (vocab_size, dim), param_dtype, 1.0), ("vocab_in", "embed"))

    def __call__(self, tokens: jnp.ndarray, layout: Layout) -> jnp.ndarray:
        gathered, summed = layout.reduction("vocab_in")
        tokens = layout.gather_rows(tokens, gathered)
        local_rows = self.weight.shape[0]
        local_ids = tokens - layout.index("vocab_in") * local_rows
        outside = (local_ids < 0) | (local_ids >= local_rows)
        rows = jnp.take(self.weight[...], jnp.where(outside, 0, local_ids), axis=0)
        rows = jnp.where(outside[..., None], jnp.zeros((), rows.dtype), rows)
        return layout.reduce_rows(rows, gathered, summed)


def layer_of(module: nnx.Module, stack_index) -> nnx.Module:
    """Layer `stack_index` of a module whose parameters carry a leading layer axis (the layer scan keeps
    some stacks whole for the kernels that index them, see `run_stack`); `module` itself when
    `stack_index` is None."""
    if stack_index is None:
        return module
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, stack_index, 0, keepdims=False), state))
