"""The MoE router after its GEMM in one launch: scores, group-limited top-k and routing weights.

From the gate's logits (M, E) it computes, per row, what `reference.route_ref` states: softmax or
sigmoid scores; with a score-correction bias the experts are *selected* by score + bias but
*weighted* by the score; with expert groups only the best `topk_groups` groups compete (a group's
score: its best expert, or with a bias the sum of its best two); the top `topk` experts, their
weights (optionally normalised to sum 1) times `route_scale`. Ties go to the lower index, as with
`lax.top_k`. In XLA this is a softmax or sigmoid, one to three sorts (top-k), a gather and a few
elementwise kernels per MoE layer; here it is one kernel (fewer kernels per decode layer).

Top-k is k rounds of (row max, lowest index reaching it, mask it out) over a register tile of the
row's E scores: E is at most a few hundred, so the rounds cost less than one kernel launch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (cdiv, fail, interpret_in_shard_map, launch_dependents, match_vma, pow2_at_most, result,
                      use_interpret, vma_union)
from .reference import route_ref

_FN = "route"
SCORE_FUNCS = ("softmax", "sigmoid")


def route(logits: jax.Array, bias: jax.Array | None = None, *, topk: int, n_groups: int = 1, topk_groups: int = 1,
          score_func: str = "softmax", route_scale: float = 1.0, normalize: bool = False,
          block_rows: int = 1, num_warps: int = 1) -> tuple[jax.Array, jax.Array]:
    """(weights (M, topk) float32, expert indices (M, topk) int32) of the gate's float32 logits (M, E).

    bias: optional float32 (E,), the score-correction bias (selection only). n_groups must divide E;
    topk <= topk_groups * E / n_groups. block_rows: rows per program (a power of two); num_warps: Triton's.
    By default a program routes one row on one warp: a row's few hundred scores fit one warp's registers, so
    the ~k rounds of reductions need no barrier between warps, and a decode step's rows (at most
    `dsv3_jax.model.moe.ROUTER_KERNEL_MAX_TOKENS` where `auto` runs the kernel) are as many programs.
    """
    _check(logits, bias, topk, n_groups, topk_groups, score_func, block_rows)
    m, experts = logits.shape
    static = dict(topk=topk, n_groups=n_groups, topk_groups=topk_groups, score_func=score_func,
                  route_scale=float(route_scale), normalize=bool(normalize))
    interpret = use_interpret()
    if m == 0 or interpret_in_shard_map(interpret, logits):
        return route_ref(logits, bias, **static)
    padded = 1 << max(0, (experts - 1).bit_length())  # Triton tiles are powers of two
    if padded != experts:
        logits = jnp.pad(logits, ((0, 0), (0, padded - experts)), constant_values=-jnp.inf)
    has_bias = bias is not None
    operands = (logits,) + ((jnp.pad(bias.astype(jnp.float32), (0, padded - experts)),) if has_bias else ())
    rows = pow2_at_most(m, block_rows)
    k_padded = 1 << max(0, (topk - 1).bit_length())
    vma = vma_union(logits)
    operands = match_vma(vma, *operands)
    weights, indices = pl.pallas_call(
        functools.partial(_kernel, m=m, experts=experts, rows=rows, k_padded=k_padded, has_bias=has_bias, **static),
        # (M, topk) written in place: the slots past topk of the kernel's power-of-two tile are masked off,
        # so no slice of the results runs after it
        out_shape=(result((m, topk), jnp.float32, vma), result((m, topk), jnp.int32, vma)),
        grid=(cdiv(m, rows),),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=_FN,
    )(*operands)
    return weights, indices


def _kernel(logits_ref, *refs, m, experts, rows, k_padded, has_bias, topk, n_groups, topk_groups, score_func,
            route_scale, normalize):
    bias_ref, weights_ref, indices_ref = refs if has_bias else (None, *refs)
    program = launch_dependents(pl.program_id(0))
    block = pl.ds(program * rows, rows)
    row_ok = program * rows + jnp.arange(rows) < m
    padded = logits_ref.shape[1]
    column = jax.lax.broadcasted_iota(jnp.int32, (rows, padded), 1)
    real = column < experts
    logits = plgpu.load(logits_ref.at[block, :], mask=row_ok[:, None], other=0.0)
    logits = jnp.where(real, logits, -jnp.inf)
    if score_func == "softmax":
        e = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        scores = e / jnp.sum(e, axis=1, keepdims=True)
    else:
        scores = jax.nn.sigmoid(logits)
    select = scores + bias_ref[...][None, :] if has_bias else scores
    select = jnp.where(real, select, -jnp.inf)
    neg = jnp.full_like(select, -jnp.inf)

    def first_max(values, allowed):
        """Per row: the largest of `values` where `allowed`, and the lowest column holding it."""
        best = jnp.max(jnp.where(allowed, values, neg), axis=1)
        at = jnp.min(jnp.where(allowed & (values == best[:, None]), column, padded), axis=1)
        return best, at

    if n_groups > 1:
        group_of = column // (experts // n_groups)
        group_scores = []
        for g in range(n_groups):
            mine = group_of == g
            best, at = first_max(select, mine)
            if has_bias:
                second, _ = first_max(select, mine & (column != at[:, None]))
                best = best + second
            group_scores.append(best)
        kept = jnp.zeros((rows, padded), jnp.bool_)
        for _ in range(topk_groups):
            top = functools.reduce(jnp.maximum, group_scores)
            found = jnp.zeros((rows,), jnp.bool_)
            for g in range(n_groups):
                pick = (group_scores[g] == top) & ~found  # the lowest group index among ties
                found = found | pick
                kept = kept | (pick[:, None] & (group_of == g))
                group_scores[g] = jnp.where(pick, -jnp.inf, group_scores[g])
        select = jnp.where(kept, select, neg)

    slot = jax.lax.broadcasted_iota(jnp.int32, (rows, k_padded), 1)
    weights = jnp.zeros((rows, k_padded), jnp.float32)
    indices = jnp.zeros((rows, k_padded), jnp.int32)
    for r in range(topk):
        _, at = first_max(select, real)
        chosen = column == at[:, None]
        weight = jnp.sum(jnp.where(chosen, scores, 0.0), axis=1)
        weights = jnp.where(slot == r, weight[:, None], weights)
        indices = jnp.where(slot == r, at[:, None], indices)
        select = jnp.where(chosen, neg, select)
    if normalize:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    weights = weights * route_scale
    stored = row_ok[:, None] & (slot < topk)
    plgpu.store(weights_ref.at[block, pl.ds(0, k_padded)], weights, mask=stored)
    plgpu.store(indices_ref.at[block, pl.ds(0, k_padded)], indices, mask=stored)


def _check(logits, bias, topk, n_groups, topk_groups, score_func, block_rows) -> None:
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        fail(_FN, f"logits must be float32 (M, E), got {logits.dtype} {logits.shape}")
    experts = logits.shape[1]
    if bias is not None and tuple(bias.shape) != (experts,):
        fail(_FN, f"bias has shape {tuple(bias.shape)}, expected ({experts},)")
    if score_func not in SCORE_FUNCS:
        fail(_FN, f"score_func is {score_func!r}, expected one of {SCORE_FUNCS}")
    if n_groups < 1 or experts % n_groups:
        fail(_FN, f"n_groups={n_groups} must divide the {experts} experts")
    if not 1 <= topk_groups <= n_groups:
        fail(_FN, f"topk_groups={topk_groups} must lie in [1, n_groups={n_groups}]")
    if not 1 <= topk <= topk_groups * experts // n_groups:
        fail(_FN, f"topk={topk} must lie in [1, {topk_groups * experts // n_groups}] (the experts of the kept groups)")
    if block_rows < 1 or block_rows & (block_rows - 1):
        fail(_FN, f"block_rows={block_rows} must be a power of two")
