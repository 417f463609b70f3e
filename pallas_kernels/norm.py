"""RMSNorm in one launch, optionally after the residual add, for decode-sized steps.

In XLA a row's RMSNorm is two kernels (the sum of squares, then the scaling), and the residual add
before it is recomputed in both; here one program per row does the add, the sum of squares and the
scaling, reading the row from HBM once (the second pass re-reads it from cache). The norm can read
the first `columns` of a wider row in place (MLA's latent, the head of wkv_a's output), and a layer
of a stacked weight in place (the layer scan keeps such stacks whole). The math is the model's
RMSNorm: float32 x * rsqrt(mean(x^2) + eps) * weight, cast back to x's dtype; the residual sum is
rounded to x's dtype first, as the model's add is.

`latent_norm_rope` is MLA's split of wkv_a's output in the same launch: the latent normed in place and
the shared rotary key (the columns after it) rotated (`rotary.rotate_row`), so XLA's slice, norm and
rotary kernels go. `rms_norm_fp8` also quantizes the normed rows as `act_quant` does (bit for bit), for
the fp8 GEMMs that read them, so their act_quant launches go.

With `gate` (the MoE gate's weight), both also compute the gate's float32 logits of the normed rows, the
GEMV before the router, so its launch goes: the row's programs each take a share of the experts (`gate_groups`),
each re-normalizing the whole row (from cache) for its dot products.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (AMAX_FLOOR, BLOCK, FP8, FP8_MAX, cdiv, exact_div, fail, interpret_in_shard_map, launch_dependents,
                      match_vma, pow2_ceil, result, use_interpret, vma_union)
from .reference import act_quant_ref
from .rotary import rotate_ref, rotate_row

_FN = "rms_norm"
MAX_CHUNK = 2048  # columns a program holds at once: a power of two dividing the normed width, at most this
GATE_EXPERTS = 4  # the gate's experts a program by default (`gate_groups` None): the fastest count swept
GATE_TILE = 4096  # gate weights a program multiplies at once (experts x columns), to keep them in registers


def rms_norm_ref(x, weight, *, eps: float, residual=None, layer=None, columns: int | None = None):
    """The jnp twin: normed x[..., :columns] (or, with `residual`, normed x + residual and that sum)."""
    h = x if residual is None else (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    w = weight if layer is None else jax.lax.dynamic_index_in_dim(weight, layer, 0, keepdims=False)
    hf = h[..., :columns or h.shape[-1]].astype(jnp.float32)
    normed = (hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
              * w.astype(jnp.float32)).astype(x.dtype)
    return normed if residual is None else (normed, h)


def gate_logits_ref(normed, gate, *, layer=None):
    """The jnp twin of the gate's part: float32 logits (..., E) of the normed rows against gate (E, W), or a
    stack (L, E, W) at `layer`, as the model's Gate computes them (float32 products of the rows in their dtype)."""
    g = gate if layer is None else jax.lax.dynamic_index_in_dim(gate, layer, 0, keepdims=False)
    return jnp.einsum("...w,ew->...e", normed.astype(jnp.float32), g.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def latent_norm_rope_ref(kv, weight, cos, sin, *, eps: float, rank: int, layer=None, interleaved: bool = True):
    """The jnp twin of `latent_norm_rope`."""
    latent = rms_norm_ref(kv, weight, eps=eps, layer=layer, columns=rank)
    return latent, rotate_ref(kv[..., rank:], cos, sin, interleaved)


def norm_chunk(columns: int) -> int:
    """The largest power of two dividing `columns`, at most MAX_CHUNK (0: none of at least 16, no kernel)."""
    chunk = min(columns & -columns, MAX_CHUNK)
    return chunk if chunk >= 16 else 0


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, residual: jax.Array | None = None, layer=None,
             columns: int | None = None, column_groups: int | None = None, gate: jax.Array | None = None,
             gate_groups: int | None = None):
    """RMSNorm of x (..., W) over its last axis, or over its first `columns` (read in place).

    weight: float (C,), or a layer stack (L, C) read at `layer` (a traced int). residual: like x; then the
    result is (normed (..., W), x + residual (..., W) in x's dtype), else normed (..., C) in x's dtype.
    column_groups: programs a row, each summing the row's squares and scaling its share of the row's chunks
    (`norm_chunk` columns each; at most one group a chunk): a wide row's second pass split over several SMs.
    Default (None): one a chunk, the faster form at V3's width (benchmarks/NOTES.md).
    gate: the MoE gate's weight (E, W), or a stack (L, E, W) read at `layer`, for whole rows; then the gate's
    float32 logits of the normed rows (..., E) come last in the result. gate_groups: programs a row sharing the
    experts (E / gate_groups a power of two; default: GATE_EXPERTS experts each).
    """
    columns, column_groups = _check(x, weight, residual, layer, columns, column_groups)
    gate_groups = _check_gate(gate, x, weight, columns, gate_groups)
    interpret = use_interpret()
    operands = (x,) + (() if residual is None else (residual,)) + (() if gate is None else (gate,))
    if x.size == 0 or interpret_in_shard_map(interpret, *operands, weight):
        out = rms_norm_ref(x, weight, eps=eps, residual=residual, layer=layer, columns=columns)
        if gate is None:
            return out
        out = (out,) if residual is None else out
        return (*out, gate_logits_ref(out[0], gate, layer=layer))
    out = _launch(x, weight, residual=residual, layer=layer, columns=columns, eps=eps, column_groups=column_groups,
                  gate=gate, gate_groups=gate_groups)
    outs = (out.normed,) if residual is None else (out.normed, out.summed)
    outs += () if gate is None else (out.logits,)
    return outs[0] if len(outs) == 1 else outs


def rms_norm_fp8(x: jax.Array, weight: jax.Array, *, eps: float, residual: jax.Array | None = None, layer=None,
                 scale_fmt: str | None = None, column_groups: int | None = None, gate: jax.Array | None = None,
                 gate_groups: int | None = None):
    """`rms_norm` of whole rows, and the normed rows (in x's dtype) quantized as `act_quant(normed, scale_fmt=)`
    gives them: (normed, x + residual or None, (e4m3 values, float32 scales (..., W / 128))). W a multiple of 128.
    column_groups, gate, gate_groups: as `rms_norm`'s (with `gate`, its logits come fourth)."""
    columns, column_groups = _check(x, weight, residual, layer, None, column_groups)
    if columns % BLOCK or scale_fmt not in (None, "ue8m0"):
        fail("rms_norm_fp8", f"rows of {columns} (a multiple of {BLOCK}) and scale_fmt None or 'ue8m0' needed, "
                             f"got scale_fmt={scale_fmt!r}")
    gate_groups = _check_gate(gate, x, weight, columns, gate_groups)
    operands = (x, weight) + (() if residual is None else (residual,)) + (() if gate is None else (gate,))
    if x.size == 0 or interpret_in_shard_map(use_interpret(), *operands):
        out = rms_norm_ref(x, weight, eps=eps, residual=residual, layer=layer)
        normed, summed = (out, None) if residual is None else out
        logits = () if gate is None else (gate_logits_ref(normed, gate, layer=layer),)
        return normed, summed, act_quant_ref(normed, scale_fmt=scale_fmt), *logits
    out = _launch(x, weight, residual=residual, layer=layer, columns=columns, eps=eps, quantize=scale_fmt or "e4m3",
                  column_groups=column_groups, gate=gate, gate_groups=gate_groups)
    return (out.normed, out.summed, out.quantized) + (() if gate is None else (out.logits,))


def latent_norm_rope(kv: jax.Array, weight: jax.Array, cos: jax.Array, sin: jax.Array, *, eps: float, rank: int,
                     layer=None, interleaved: bool = True) -> tuple[jax.Array, jax.Array]:
    """MLA's latent and shared rotary key from wkv_a's output kv (..., rank + R), in one launch:
    (kv[..., :rank] RMS-normed with weight (rank,) or a stack (L, rank) at `layer`, kv[..., rank:] rotated by
    cos, sin (..., R / 2) float32, the pairs adjacent (`interleaved`) or R / 2 apart), both in kv's dtype."""
    rope = kv.shape[-1] - rank
    _check(kv, weight, None, layer, rank, 1)
    if rope < 2 or rope & (rope - 1) or cos.shape != kv.shape[:-1] + (rope // 2,) or sin.shape != cos.shape:
        fail("latent_norm_rope", f"the rotary part ({rope} columns after rank={rank}) must be a power of two "
                                 f"with cos and sin of shape {kv.shape[:-1] + (max(rope, 0) // 2,)}, got "
                                 f"{cos.shape} and {sin.shape}")
    if kv.size == 0 or interpret_in_shard_map(use_interpret(), kv, weight, cos, sin):
        return latent_norm_rope_ref(kv, weight, cos, sin, eps=eps, rank=rank, layer=layer, interleaved=interleaved)
    out = _launch(kv, weight, layer=layer, columns=rank, eps=eps,
                  rope=(cos.astype(jnp.float32), sin.astype(jnp.float32), interleaved))
    return out.normed, out.rotated


class _Outputs(NamedTuple):
    normed: jax.Array
    summed: jax.Array | None = None
    rotated: jax.Array | None = None
    quantized: tuple | None = None
    logits: jax.Array | None = None


def _launch(x, weight, *, residual=None, layer=None, columns: int, eps: float, rope=None, quantize=None,
            column_groups: int = 1, gate=None, gate_groups: int = 0) -> _Outputs:
    """The kernel over x's rows, max(column groups, gate_groups) programs a row (gate_groups 0: no gate, as
    `_check_gate` gives it): the normed rows, and x + residual, the rotated x[..., columns:], the normed rows
    quantized (`quantize`: "e4m3", or "ue8m0" for power-of-two scales) and the gate's logits where asked for. Quantized rows are passed as (rows, W / 128, 128) views (the
    gate as (L, E, W / 128, 128)), so that a program scales and quantizes several 128-blocks at once."""
    chunks = columns // norm_chunk(columns)
    per_group = cdiv(chunks, column_groups)
    lead, width = x.shape[:-1], x.shape[-1]
    tile = (width,) if quantize is None else (width // BLOCK, BLOCK)
    rows = x.reshape(-1, *tile)
    m = rows.shape[0]
    stack = weight if layer is not None else weight[None]
    stack = stack if quantize is None else stack.reshape(-1, *tile)  # quantized rows are whole (columns = W)
    index = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    operands = [index, rows] + ([] if residual is None else [residual.reshape(rows.shape)]) + [stack]
    experts = 0 if gate is None else gate.shape[-2]
    if gate is not None:
        gates = gate if layer is not None else gate[None]
        operands.append(gates.reshape(gates.shape[0], experts, *tile))
    if rope is not None:
        operands += [rope[0].reshape(m, -1), rope[1].reshape(m, -1)]
    vma = vma_union(*operands)
    shapes = [result((m, *stack.shape[1:]), x.dtype, vma)]
    shapes += [] if residual is None else [result(rows.shape, x.dtype, vma)]
    shapes += [] if rope is None else [result((m, width - columns), x.dtype, vma)]
    shapes += [] if quantize is None else [result(rows.shape, FP8, vma),
                                           result((m, width // BLOCK, 1), jnp.float32, vma)]
    shapes += [] if gate is None else [result((m, experts), jnp.float32, vma)]
    gate_experts = experts // gate_groups if gate_groups else 0
    outs = list(pl.pallas_call(
        functools.partial(_kernel, columns=columns, chunk=norm_chunk(columns), eps=float(eps),
                          summed=residual is not None, rope=None if rope is None else rope[2], quantize=quantize,
                          interpret=use_interpret(), per_group=per_group, gate_experts=gate_experts,
                          gate_groups=gate_groups),
        out_shape=tuple(shapes),
        grid=(m, max(cdiv(chunks, per_group), gate_groups)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=use_interpret(),
        name=_FN if rope is None else "latent_norm_rope",
    )(*match_vma(vma, *operands)))
    normed = outs.pop(0).reshape(*lead, columns)
    summed = None if residual is None else outs.pop(0).reshape(x.shape)
    rotated = None if rope is None else outs.pop(0).reshape(*lead, width - columns)
    quantized = None if quantize is None else (outs.pop(0).reshape(*lead, columns),
                                               outs.pop(0).reshape(*lead, columns // BLOCK))
    logits = None if gate is None else outs.pop(0).reshape(*lead, experts)
    return _Outputs(normed, summed, rotated, quantized, logits)


def _kernel(layer_ref, x_ref, *refs, columns, chunk, eps, summed, rope, quantize, interpret, per_group, gate_experts,
            gate_groups):
    """One row, `chunk` columns at a time: pass 1 sums the squares of every chunk (storing x + residual where
    summed), pass 2 scales (with `quantize`, each chunk's 128-blocks also quantized as act_quant does); both store
    only the program's group of `per_group` chunks. With `rope` (interleaved or not) group 0 rotates the columns
    after the normed ones. With a gate, programs 0 .. gate_groups - 1 each compute `gate_experts` logits."""
    refs = list(refs)
    res_ref = refs.pop(0) if summed else None
    w_ref = refs.pop(0)
    gate_ref = refs.pop(0) if gate_groups else None
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if rope is not None else (None, None)
    o_ref = refs.pop(0)
    sum_ref = refs.pop(0) if summed else None
    logits_ref = refs.pop() if gate_groups else None
    row, group, layer = launch_dependents(pl.program_id(0)), pl.program_id(1), layer_ref[0]
    load = _chunk_loader(x_ref, res_ref, row)
    blocked = quantize is not None
    chunks = [_chunk_at(c, chunk, blocked=blocked) for c in range(columns // chunk)]
    grouped = per_group < len(chunks) or gate_groups > 1  # several programs a row

    def own(c: int, store):  # `store` runs in the program of chunk c's group only
        if grouped:
            pl.when(group == c // per_group)(store)
        else:
            store()

    squares = jnp.zeros((chunk,) if quantize is None else (chunk // BLOCK, BLOCK), jnp.float32)
    for c, at in enumerate(chunks):
        h = load(at)
        if summed:
            own(c, functools.partial(plgpu.store, sum_ref.at[(row, *at)], h))
        hf = h.astype(jnp.float32)
        squares += hf * hf
    inv = jax.lax.rsqrt(jnp.sum(squares) / columns + eps)

    def normed_at(at):
        w = plgpu.load(w_ref.at[(layer, *at)]).astype(jnp.float32)
        return (load(at).astype(jnp.float32) * inv * w).astype(o_ref.dtype)

    def scale(at):
        normed = normed_at(at)
        plgpu.store(o_ref.at[(row, *at)], normed)
        if quantize is not None:
            _quantize_blocks(normed, at, q_refs=refs[-2:], row=row, ue8m0=quantize == "ue8m0", interpret=interpret)

    for c, at in enumerate(chunks):
        own(c, functools.partial(scale, at))
    if rope is not None:
        own(0, functools.partial(_rotate_tail, x_ref, cos_ref, sin_ref, refs[0], row, columns, rope))
    if gate_groups:
        logits = functools.partial(_gate_logits, normed_at, gate_ref, logits_ref, row=row, layer=layer, group=group,
                                   experts=gate_experts, columns=columns, blocked=blocked)
        if gate_groups < cdiv(len(chunks), per_group):  # more programs a row store chunks than hold experts
            pl.when(group < gate_groups)(logits)
        else:
            logits()


def _gate_logits(normed_at, gate_ref, logits_ref, *, row, layer, group, experts: int, columns: int, blocked: bool):
    """The row's logits for the group's `experts` gate rows: float32 products of the normed row (in its dtype, as
    stored) with the gate's rows, `gate_chunk(experts, columns)` columns at a time."""
    first = group * experts
    step = gate_chunk(experts, columns, blocked)
    total = jnp.zeros((experts,), jnp.float32)
    for j in range(columns // step):
        at = _chunk_at(j, step, blocked=blocked)
        normed = normed_at(at).astype(jnp.float32)
        products = plgpu.load(gate_ref.at[(layer, pl.ds(first, experts), *at)]).astype(jnp.float32) * normed[None]
        for _ in at:  # the chunk's one axis, or its (blocks, 128)
            products = jnp.sum(products, axis=-1)
        total += products
    plgpu.store(logits_ref.at[row, pl.ds(first, experts)], total)


def gate_chunk(experts: int, columns: int, blocked: bool) -> int:
    """Columns of the gate a program multiplies at once: about GATE_TILE weights, a power of two dividing
    `columns` (a multiple of 128 for blocked rows)."""
    step = min(columns & -columns, MAX_CHUNK, max(1, GATE_TILE // experts))
    return max(step, BLOCK) if blocked else step


def _rotate_tail(x_ref, cos_ref, sin_ref, rot_ref, row, columns: int, interleaved: bool):
    """The row's columns after the normed ones, rotated by its angles, into rot_ref."""
    x = plgpu.load(x_ref.at[row, pl.ds(columns, rot_ref.shape[1])])
    rotated = rotate_row(x.astype(jnp.float32), plgpu.load(cos_ref.at[row]), plgpu.load(sin_ref.at[row]),
                         interleaved)
    plgpu.store(rot_ref.at[row], rotated.astype(rot_ref.dtype))


def _chunk_at(c: int, chunk: int, *, blocked: bool) -> tuple:
    """The index of a row's chunk c: columns (1-D rows), or chunk / 128 whole 128-blocks (blocked rows)."""
    if not blocked:
        return (pl.ds(c * chunk, chunk),)
    return pl.ds(c * (chunk // BLOCK), chunk // BLOCK), slice(None)


def _chunk_loader(x_ref, res_ref, row):
    """at -> the row's chunk `at` of x (+ the residual: the model's add, rounded to x's dtype)."""
    def load(at):
        h = plgpu.load(x_ref.at[(row, *at)])
        if res_ref is None:
            return h
        return (h.astype(jnp.float32) + plgpu.load(res_ref.at[(row, *at)]).astype(jnp.float32)).astype(h.dtype)
    return load


def _quantize_blocks(normed, at, *, q_refs, row, ue8m0, interpret):
    """act_quant's math on normed (blocks, 128) in x's dtype: per block amax (at least AMAX_FLOOR) / 448 (ue8m0:
    the next power of two), the values divided by it (IEEE division) in e4m3."""
    y_ref, s_ref = q_refs
    v = normed.astype(jnp.float32)
    s = exact_div(jnp.maximum(jnp.max(jnp.abs(v), axis=1, keepdims=True), jnp.float32(AMAX_FLOOR)), FP8_MAX,
                  interpret)
    s = pow2_ceil(s) if ue8m0 else s
    plgpu.store(y_ref.at[(row, *at)], exact_div(v, s, interpret).astype(FP8))
    plgpu.store(s_ref.at[row, at[0], :], s)


def _check(x, weight, residual, layer, columns, column_groups: int | None) -> tuple[int, int]:
    """(the normed columns, the programs a row: `column_groups`, or None for one a chunk), after checking them."""
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        fail(_FN, f"x must be a float array (..., W), got {x.dtype} {x.shape}")
    width = x.shape[-1]
    columns = width if columns is None else columns
    if not 0 < columns <= width:
        fail(_FN, f"columns={columns} must lie in [1, {width}] (x's last dim)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or columns != width):
        fail(_FN, f"residual must match x ({x.dtype} {x.shape}) and normalise whole rows, got "
                  f"{residual.dtype} {residual.shape}, columns={columns}")
    if weight.shape[-1:] != (columns,) or weight.ndim != (1 if layer is None else 2):
        fail(_FN, f"weight has shape {weight.shape}, expected ({columns},)" + ("" if layer is None else
                                                                               f" stacked: (L, {columns})"))
    if not norm_chunk(columns):
        fail(_FN, f"columns={columns} has no power-of-two factor of at least 16 (a Triton tile)")
    chunks = columns // norm_chunk(columns)
    column_groups = chunks if column_groups is None else column_groups
    if not 1 <= column_groups <= chunks:
        fail(_FN, f"column_groups={column_groups} must lie in [1, {chunks}] (the row's {chunks} chunks of "
                  f"{norm_chunk(columns)} columns)")
    return columns, column_groups


def _check_gate(gate, x, weight, columns: int, gate_groups: int | None) -> int:
    """The gate's programs a row (0 without a gate), after checking the gate against the norm's rows."""
    if gate is None:
        if gate_groups is not None:
            fail(_FN, f"gate_groups={gate_groups} given without a gate")
        return 0
    width = x.shape[-1]
    if columns != width or gate.ndim != weight.ndim + 1 or gate.shape[-1] != width:
        fail(_FN, f"gate has shape {gate.shape}, expected (experts, {width})"
                  + ("" if weight.ndim == 1 else f" stacked like the norm's weight: ({weight.shape[0]}, experts, "
                                                f"{width})") + ", for whole rows")
    if weight.ndim == 2 and gate.shape[0] != weight.shape[0]:
        fail(_FN, f"gate stacks {gate.shape[0]} layers, the norm's weight {weight.shape[0]}")
    experts = gate.shape[-2]
    groups = experts // min(experts & -experts, GATE_EXPERTS) if gate_groups is None else gate_groups
    share = experts // groups if groups >= 1 and experts % groups == 0 else 0
    if not share or share & (share - 1):
        fail(_FN, f"gate_groups={groups} must divide the gate's {experts} experts into groups of a power of two")
    return groups
