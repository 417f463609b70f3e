"""Feed-forward layers: the dense MLP, the routing Gate, and the MoE with routed and shared experts.

Routed experts never loop in Python: token-expert assignments are sorted by expert and pushed
through one grouped GEMM (`grouped_matmul`), the single place a Pallas kernel can replace.
Experts are split over the mesh in contiguous ranges ("experts"); each rank computes its experts'
share and one reduction over their ranks (together with the shared experts, when the layout
splits those the same way) assembles the output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import (FP8_BLOCK, MOSAIC_MIN_ROWS, act_quant, grouped_gemm, grouped_gemm_backend,
                            grouped_gemm_swiglu, use_interpret)
from pallas_kernels.reference import route_ref, weight_dequant_ref
from pallas_kernels.router import route

from ..config import ModelArgs
from ..options import StepContext
from .layers import Linear, init_normal, norm_kernel_applies, param, project


class MLP(nnx.Module):
    """w2(silu(w1 x) * w3 x), its hidden units the logical axis `hidden` ("ffn" for the dense MLP,
    "shared_ffn" for the shared experts): w1/w3 split by output, w2 by input."""

    def __init__(self, dim: int, inter_dim: int, *, stack: tuple[int, ...] = (), param_dtype=jnp.bfloat16,
                 fp8: bool = False, rngs: nnx.Rngs | None = None, hidden: str = "ffn"):
        common = dict(stack=stack, param_dtype=param_dtype, fp8=fp8, rngs=rngs)
        self.hidden = hidden
        self.w1 = Linear(dim, inter_dim, axes=(hidden, "embed"), **common)
        self.w2 = Linear(inter_dim, dim, axes=("embed", hidden), **common)
        self.w3 = Linear(dim, inter_dim, axes=(hidden, "embed"), **common)

    def __call__(self, x: jnp.ndarray, ctx: StepContext, reduce: bool = False, out_dtype=None,
                 layer=None, x_fp8=None) -> jnp.ndarray:
        """This rank's partial output; with `reduce` the whole output for x's rows (B, ...): rows
        gathered first and the sum reduce-scattered back when the batch is split over the hidden
        units' ranks too (`Layout.reduction`). `layer`: as `Linear`'s, for weights that hold their
        whole layer stack; `x_fp8`: x quantized already (`Linear`'s), used where no rows are gathered."""
        gathered, summed = ctx.layout.reduction(self.hidden) if reduce else ((), ())
        gemm = dict(ctx.gemm, layer=layer, x_fp8=None if gathered else x_fp8)
        rows = ctx.layout.gather_rows(x, gathered)
        # in decode-sized steps, the projections' one launch where it applies (`layers.project`)
        h1, h3 = project([self.w1, self.w3], rows, **gemm)
        hidden = jax.nn.silu(h1.astype(jnp.float32)).astype(x.dtype) * h3
        (y,) = project([self.w2], hidden, out_dtype=jnp.float32 if reduce else out_dtype, **dict(gemm, x_fp8=None))
        if reduce:
            y = ctx.layout.reduce_rows(y, gathered, summed).astype(out_dtype or x.dtype)
        return y


class Gate(nnx.Module):
    """Top-k expert selection (replicated on every rank), in float32.

    scores = softmax or sigmoid of x Wg^T; a score-correction bias, when present, shifts the
    scores used to SELECT experts but not the weights; with expert groups only the best
    `n_limited_groups` groups compete (group score: max, or the sum of the top two with a bias).
    """

    def __init__(self, args: ModelArgs, *, stack: tuple[int, ...] = (), param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        self.topk = args.n_activated_experts
        self.n_groups, self.topk_groups = args.n_expert_groups, args.n_limited_groups
        self.score_func, self.route_scale = args.score_func, args.route_scale
        self.normalize = args.normalize_topk
        lead = ("layers",) * len(stack)
        self.weight = param(init_normal(rngs, (*stack, args.n_routed_experts, args.dim), param_dtype, args.dim**-0.5),
                            lead + ("router", "embed"))
        self.bias = (param(jnp.zeros((*stack, args.n_routed_experts), jnp.float32), lead + ("router",))
                     if args.gate_bias else None)

    def __call__(self, x: jnp.ndarray, router: str = "xla", logits: jnp.ndarray | None = None
                 ) -> tuple[jnp.ndarray, jnp.ndarray]:
        """x (N, dim) -> (weights (N, k) float32, expert indices (N, k) int32).

        The logits come from one float32 GEMM (or are given: the norm's launch computed them, router
        "norm-gate"); the rest is `route_ref` in XLA (router "xla") or the one-launch Pallas kernel `route`."""
        if logits is None:
            logits = jnp.dot(x.astype(jnp.float32), self.weight[...].astype(jnp.float32).T)
        bias = None if self.bias is None else self.bias[...]
        routing = dict(topk=self.topk, n_groups=self.n_groups, topk_groups=self.topk_groups,
                       score_func=self.score_func, route_scale=self.route_scale, normalize=self.normalize)
        return (route if router in ("kernel", "norm-gate") else route_ref)(logits, bias, **routing)


def grouped_kernel_applies(in_dims: tuple[int, ...]) -> bool:
    """Whether the routed-expert GEMM can use the Pallas grouped kernel: on a GPU, K a multiple of 128."""
    return not use_interpret() and all(k % FP8_BLOCK == 0 for k in in_dims)


SLOTS_MAX = 96  # (token, expert) slots up to which "auto" runs "slots"
# routed rows up to which "auto" runs "fused" (decode-sized); above, the grouped kernel, which is the
# same decode/prefill boundary at which grouped_gemm takes its wgmma kernel and _kernel_tiles tall tiles
FUSED_MAX_ROWS = MOSAIC_MIN_ROWS


def auto_moe_impl(slots: int, local_experts: int, kernels: bool) -> str:
    """What moe_impl "auto" runs for a step of `slots` (token, expert) assignments.

    With the Pallas kernels (a GPU): "slots" up to SLOTS_MAX (no sort, scatter or schedule; past it,
    experts chosen by several tokens are read once per slot and "fused" wins); "fused" up to
    FUSED_MAX_ROWS; "kernel" above (prefill). Without them: "gather" when the experts in use are
    few next to the local experts, else "ragged". The boundaries come from the timings in
    benchmarks/NOTES.md ("Where the code's thresholds come from")."""
    if kernels:
        return "slots" if slots <= SLOTS_MAX else "fused" if slots <= FUSED_MAX_ROWS else "kernel"
    return "gather" if 2 * slots <= local_experts else "ragged"


# router "auto" runs the one-launch kernel on a GPU for steps of up to this many tokens: decode steps,
# where it was no slower at any batch measured (benchmarks/NOTES.md); larger steps keep XLA's ops.
ROUTER_KERNEL_MAX_TOKENS = 32


def router_impl(router: str, tokens: int) -> str:
    """What `RunOptions.router` runs for a step of `tokens` tokens ("auto" resolved; "norm-gate" the routing
    kernel after XLA's gate GEMM where the norm before the MoE does not run as its kernel)."""
    if router == "norm-gate" and not norm_kernel_applies(tokens):
        return "kernel"
    if router != "auto":
        return router
    return "kernel" if jax.default_backend() == "gpu" and tokens <= ROUTER_KERNEL_MAX_TOKENS else "xla"


def gate_in_norm(ctx: StepContext, tokens: int) -> bool:
    """Whether the gate's logits of a step of `tokens` tokens come from the launch of the norm before the MoE
    (router "norm-gate" where it applies): only where the experts' layout gathers no rows, so that the norm's rows
    are the gate's."""
    gathered, _ = ctx.layout.reduction("experts", "expert_ffn")
    return router_impl(ctx.options.router, tokens) == "norm-gate" and not gathered


def _fp8_activations(x: jnp.ndarray, scale_fmt: str | None, dtype) -> jnp.ndarray:
    """x rounded through `act_quant` (gemm_impl "fp8"): its per-128 fp8 values times their scales."""
    xq, xs = act_quant(x, block_size=FP8_BLOCK, scale_fmt=scale_fmt)
    blocks = xq.astype(jnp.float32).reshape(x.shape[0], -1, FP8_BLOCK) * xs[..., None]
    return blocks.reshape(x.shape).astype(dtype)


def _short_tiles(rows: int, one_row_tiles: bool) -> bool:
    """Whether the grouped kernels run decode-sized short row tiles (`_kernel_tiles`). There, under gemm_impl
    "fp8", fp8 activations meet the fp8 weights on the tensor cores (`x_scale`); with prefill's tall tiles the
    kernels dequantise the weights instead and take the activations rounded through act_quant, which measured
    faster there (benchmarks/NOTES.md)."""
    return rows <= MOSAIC_MIN_ROWS or one_row_tiles


# the down projection's launches (grouped_matmul) of at most this many rows take 16 x 128 tiles: at the V3 cut's
# b=1 (9 slot rows x 7,168 columns) 504 programs, one wave, against 1,008 at 16 x 64 (benchmarks/NOTES.md)
WIDE_DOWN_TILE_MAX_ROWS = 16
# the swiglu launch of at most this many rows (tokens, in the slots form) takes 16 x 32 tiles: at the V3 cut's
# b=1 (9 slot rows x 2,048 columns) 576 programs, 4.4 an SM, against 288 at 16 x 64, which leave 24 SMs a third
# program; from two tokens on 16 x 64 already gives as many (benchmarks/NOTES.md)
NARROW_SWIGLU_TILE_MAX_ROWS = 1
# decode-sized launches whose rows average more than this many an expert take 32-row tiles: most experts' rows then
# span two 16-row tiles, each of which reads the expert's weights (V2-Lite b=256: 24 an expert; benchmarks/NOTES.md)
SHORT_TILE_ROWS_PER_EXPERT = 16


def _kernel_tiles(rows: int, experts: int, fp8: bool, one_row_tiles: bool = False, down: bool = False) -> dict:
    """block_m, block_n of the grouped kernels over `experts` experts: decode-sized batches, and tiles of
    one row each (`slot_experts`), get short row tiles (32 rows past SHORT_TILE_ROWS_PER_EXPERT rows an
    expert), 128 wide for the down projection (`down`) up to WIDE_DOWN_TILE_MAX_ROWS rows and 32 wide for
    swiglu up to NARROW_SWIGLU_TILE_MAX_ROWS; prefill taller tiles, which re-read each expert less often
    (block_n <= 128 with fp8 weights). Past the same row count grouped_gemm runs bf16 weights on its wgmma
    kernel (with its own tiles) on sm_90."""
    short = _short_tiles(rows, one_row_tiles)
    block_m, block_n = (16, 64) if short else (64, 128)
    if short and not one_row_tiles and rows > SHORT_TILE_ROWS_PER_EXPERT * experts:
        block_m = 32
    if down and rows <= WIDE_DOWN_TILE_MAX_ROWS:
        block_n = 128
    elif not down and rows <= NARROW_SWIGLU_TILE_MAX_ROWS:
        block_n = 32
    return dict(block_m=block_m, block_n=min(block_n, FP8_BLOCK) if fp8 else block_n)


def _kernel_inputs(x, experts: int, fp8_weights: bool, gemm_impl: str, scale_fmt, one_row_tiles: bool, x_fp8=None,
                   down: bool = False, rows: int | None = None):
    """x for the grouped kernels and its x_scale (or None), and their tiles over `experts` experts (`down`: the
    down projection's) for a launch of `rows` rows (default x's). `x_fp8`: x's act_quant, made already (by the norm
    before), used where the kernels take fp8 activations."""
    rows = x.shape[0] if rows is None else rows
    short = _short_tiles(rows, one_row_tiles)
    tiles = _kernel_tiles(rows, experts, fp8_weights, one_row_tiles, down)
    if not (fp8_weights and gemm_impl == "fp8"):
        return x, None, tiles
    if short:
        return *(x_fp8 or act_quant(x, block_size=FP8_BLOCK, scale_fmt=scale_fmt)), tiles
    return _fp8_activations(x, scale_fmt, x.dtype), None, tiles


def grouped_matmul(x: jnp.ndarray, weight: jnp.ndarray, scale: jnp.ndarray | None, group_sizes: jnp.ndarray | None,
                   *, gemm_impl: str = "bf16", scale_fmt: str | None = None, use_kernel: bool = False,
                   stack_index=None, row_scale: jnp.ndarray | None = None, slot_experts: jnp.ndarray | None = None,
                   expert_offset=0, shared_w: jnp.ndarray | None = None,
                   shared_w_scale: jnp.ndarray | None = None) -> jnp.ndarray:
    """Rows of x (M, in), sorted by expert, times their expert's W^T (weight (E, out, in)) -> float32.

    group_sizes (E,) counts the rows of each expert; rows past their sum come out as zeros.
    `use_kernel` runs the Pallas grouped GEMM, which reads only the experts in use; otherwise
    `jax.lax.ragged_dot_general`, which streams every expert. With an fp8 weight, "bf16"
    dequantises it (in the kernel, tile by tile); "fp8" quantises the activations through `act_quant`
    for the scaled fp8 GEMM's products: exactly in float32 on the XLA path, on the fp8 tensor cores in the
    kernel's decode-sized steps (`_short_tiles`), and in its prefill-sized ones carried in x's dtype (exact
    for ue8m0 scales, within 2^-9 otherwise). With `stack_index` (kernel only),
    weight and scale are a stack over layers (L, E, out, in) of which layer `stack_index` is used.
    `row_scale` (M,) float32 multiplies each row's float32 result (in the kernel, before its store).
    `slot_experts` (T, k) and `expert_offset` (kernel only) replace group_sizes: the rows are T tokens'
    k routed slots, each naming its expert (`grouped_gemm`'s slots form; row_scale then (T k,)).
    `shared_w` (out, S * in) (kernel): S more experts past the routed ones, chunks of it along `in` (the shared
    experts' down projection; `grouped_gemm`); group_sizes then (E + S,).
    """
    if use_kernel:
        x, x_scale, tiles = _kernel_inputs(x, weight.shape[-3], scale is not None, gemm_impl, scale_fmt,
                                           slot_experts is not None, down=True)
        return grouped_gemm(x, weight, group_sizes, scale, layer=stack_index,
                            out_dtype=jnp.float32, row_scale=row_scale, shared_w=shared_w,
                            shared_w_scale=shared_w_scale, x_scale=x_scale, slot_experts=slot_experts,
                            expert_offset=expert_offset, **tiles)
    if scale is not None and gemm_impl == "fp8":
        x = _fp8_activations(x, scale_fmt, jnp.float32)
    if stack_index is not None or slot_experts is not None:
        raise ValueError("grouped_matmul: a stack of layers' weights (`stack_index`) or `slot_experts` needs the kernel")
    if scale is not None:
        # the jnp twin, not the Pallas kernel: vmapped over experts, the kernel would address a 1-byte
        # stack of 2^31..2^32 elements with 32-bit offsets (see pallas_kernels/grouped.py)
        dequantize = functools.partial(weight_dequant_ref, block_size=FP8_BLOCK, out_dtype=x.dtype)
        weight = jax.vmap(dequantize)(weight, scale)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    out = jax.lax.ragged_dot_general(x, weight.astype(x.dtype), group_sizes, dims,
                                     preferred_element_type=jnp.float32)
    return out if row_scale is None else out * row_scale[:, None]


def grouped_swiglu(x: jnp.ndarray, w1: jnp.ndarray, w3: jnp.ndarray, scale1: jnp.ndarray | None,
                   scale3: jnp.ndarray | None, group_sizes: jnp.ndarray | None, *, gemm_impl: str = "bf16",
                   scale_fmt: str | None = None, stack_index=None, slot_experts: jnp.ndarray | None = None,
                   expert_offset=0, x_fp8=None, x_rows=None, **shared) -> jnp.ndarray:
    """silu(x W1_g^T) * (x W3_g^T) in x's dtype from one Pallas launch (`grouped_gemm_swiglu`):
    the "fused" routed-expert path's first half. Same arguments as `grouped_matmul` with
    use_kernel; with gemm_impl "fp8" and fp8 weights x is quantised through `act_quant` once (as there).
    `shared`: the shared experts' weights as more experts (`grouped_gemm_swiglu`'s shared_w1, ...); `x_fp8`:
    x's act_quant made already (`_kernel_inputs`); `x_rows` (M,): the sorted rows are x[x_rows], gathered by
    the kernel (no gathered copy of x)."""
    out_dtype = x.dtype
    x, x_scale, tiles = _kernel_inputs(x, w1.shape[-3], scale1 is not None, gemm_impl, scale_fmt,
                                       slot_experts is not None, x_fp8,
                                       rows=None if x_rows is None else x_rows.shape[0])
    return grouped_gemm_swiglu(x, w1, w3, group_sizes, scale1, scale3, layer=stack_index,
                               out_dtype=out_dtype, x_scale=x_scale, slot_experts=slot_experts,
                               expert_offset=expert_offset, x_rows=x_rows, **shared, **tiles)


def _scale(linear: Linear) -> jnp.ndarray | None:
    """A Linear's block scales (fp8), or None."""
    return None if linear.scale is None else linear.scale[...]


def _shared_kernel_weights(shared: MLP | None, inter: int) -> tuple[int, dict, dict]:
    """The shared experts' weights as the grouped kernels' shared chunks of `inter` hidden units each: the chunk
    count, the swiglu launch's and the down projection's keyword arguments (0 and empty without `shared`)."""
    if shared is None:
        return 0, {}, {}
    return (shared.w1.weight.shape[-2] // inter,
            dict(shared_w1=shared.w1.weight[...], shared_w3=shared.w3.weight[...], shared_w1_scale=_scale(shared.w1),
                 shared_w3_scale=_scale(shared.w3)),
            dict(shared_w=shared.w2.weight[...], shared_w_scale=_scale(shared.w2)))


# routed assignments up to which `sorted_positions` ranks them by comparing every pair (one reduction, no sort):
# decode-sized steps ("auto" runs "fused" up to FUSED_MAX_ROWS); a forced "fused" prefill sorts
RANK_BY_PAIRS_MAX = MOSAIC_MIN_ROWS


def sorted_positions(keys: jnp.ndarray, groups: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """int32 (N,) where each of `keys` (N,) lands when sorted stably (ties by index), and the count of each
    key below `groups` (keys >= groups sort last and are not counted)."""
    n = keys.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    if n <= RANK_BY_PAIRS_MAX:
        key_j, key_i = keys[None, :], keys[:, None]
        before = (key_j < key_i) | ((key_j == key_i) & (index[None, :] < index[:, None]))
        position = jnp.sum(before, axis=1, dtype=jnp.int32)
    else:
        position = _permuted(index, jnp.argsort(keys, stable=True))
    sizes = jnp.sum(keys[None, :] == jnp.arange(groups, dtype=keys.dtype)[:, None], axis=1, dtype=jnp.int32)
    return position, sizes


def _permuted(values: jnp.ndarray, to: jnp.ndarray) -> jnp.ndarray:
    """values moved to the positions `to` (a permutation): out[to[i]] = values[i]."""
    return jnp.zeros_like(values).at[to].set(values, unique_indices=True)


class Experts(nnx.Module):
    """The routed experts of one MoE layer, stacked (E, out, in) and split over ranks by expert.

    Inside the layer scan the module may hold the weights of all its stack's layers (L, E, out,
    in) with `stack_index` naming its own: the grouped kernel then reads that layer's experts in
    place, where slicing them out in the loop would copy every expert's weights at every layer."""

    def __init__(self, args: ModelArgs, *, stack: tuple[int, ...] = (), param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        common = dict(stack=(*stack, args.n_routed_experts), stack_axes=("layers",) * len(stack) + ("experts",),
                      param_dtype=param_dtype, fp8=args.quantized, rngs=rngs)
        self.w1 = Linear(args.dim, args.moe_inter_dim, axes=("expert_ffn", "embed"), **common)
        self.w2 = Linear(args.moe_inter_dim, args.dim, axes=("embed", "expert_ffn"), **common)
        self.w3 = Linear(args.dim, args.moe_inter_dim, axes=("expert_ffn", "embed"), **common)

    def impl(self, tokens: int, topk: int, ctx: StepContext) -> str:
        """The moe_impl a step of `tokens` tokens runs ("auto" resolved by `auto_moe_impl`)."""
        if ctx.options.moe_impl != "auto":
            return ctx.options.moe_impl
        in_dims = (self.w1.weight.shape[-1], self.w2.weight.shape[-1])
        return auto_moe_impl(tokens * topk, self.w1.weight.shape[-3], grouped_kernel_applies(in_dims))

    def shared_chunks(self, shared: MLP, tokens: int, topk: int, ctx: StepContext) -> int:
        """How many experts of this layer's shape the shared experts `shared` make inside this step's
        grouped kernels (`RunOptions.fuse_shared_experts`), or 0 where they run apart: not a "slots" or
        "fused" step, this rank's shared hidden units not a whole number of experts, or fp8 experts whose
        hidden units are not whole 128-blocks (each chunk needs its own block scales)."""
        inter, width = self.w1.weight.shape[-2], shared.w1.weight.shape[-2]
        if (not ctx.options.fuse_shared_experts or self.impl(tokens, topk, ctx) not in ("slots", "fused")
                or width % inter or (shared.w1.scale is not None and inter % FP8_BLOCK)):
            return 0
        return width // inter

    def __call__(self, x: jnp.ndarray, weights: jnp.ndarray, indices: jnp.ndarray, ctx: StepContext,
                 stack_index=None, shared: MLP | None = None, x_fp8=None) -> jnp.ndarray:
        """This rank's share of sum_k weight_k * expert_k(x): x (N, dim), weights/indices (N, k).

        moe_impl "auto" picks by the step's size (`auto_moe_impl`): on a GPU "slots" for a few
        tokens, "fused" for decode-sized steps, the grouped kernel for prefill; elsewhere it
        gathers the experts in use when they are few (decoding), else runs `ragged_dot` over all
        local experts ("slots": `_slots`, "fused": `_fused`). `shared` (only where `shared_chunks` is not 0):
        the shared experts' MLP, whose output joins this one, computed in the same "slots" or "fused" launches.
        `x_fp8`: x's act_quant made already (by the norm before), for the slot and fused kernels' fp8
        activations."""
        tokens, topk = indices.shape
        stacked = self.w1.weight.ndim == 4
        if stacked != (stack_index is not None):
            raise ValueError("Experts: a stack of layers' weights goes with `stack_index`")
        local_experts = self.w1.weight.shape[-3]
        first = ctx.layout.index("experts") * local_experts
        moe_impl = self.impl(tokens, topk, ctx)
        if moe_impl == "slots":
            return self._slots(x, weights, indices, first, ctx, stack_index, shared, x_fp8)
        if moe_impl == "fused":
            return self._fused(x, weights, indices, first, ctx, stack_index, shared, x_fp8)
        if shared is not None:
            raise ValueError("Experts: the shared experts join the routed ones' kernels in slots and fused steps only")
        local_ids = indices.reshape(-1) - first
        mine = (local_ids >= 0) & (local_ids < local_experts)
        sort_key = jnp.where(mine, local_ids, local_experts)  # foreign assignments sort to the end
        order = jnp.argsort(sort_key, stable=True)
        token_of = order // topk
        group_sizes = jnp.bincount(jnp.where(mine, local_ids, local_experts), length=local_experts + 1)[:-1]
        rows = jnp.take(x, token_of, axis=0)
        # ragged_dot reads every expert's weights whatever the group sizes; the grouped kernel reads
        # only the experts in use, and without it, with few rows, the experts in use are gathered
        # first (ascending, like the sorted rows).
        use_kernel, gather = moe_impl == "kernel", moe_impl == "gather"
        in_layer = (lambda a: a) if not stacked else (  # noqa: E731
            lambda a: jax.lax.dynamic_index_in_dim(a, stack_index, 0, keepdims=False))
        if gather:
            # at most every local expert plus the marker of foreign assignments: the gathered weights
            # never outgrow the layer's own, however many tokens the step holds
            used = jnp.unique(sort_key, size=min(tokens * topk, local_experts + 1), fill_value=local_experts)
            slot_sizes = jnp.where(used < local_experts, group_sizes[jnp.minimum(used, local_experts - 1)], 0)
            select = lambda a: jnp.take(in_layer(a), jnp.minimum(used, local_experts - 1), axis=0)  # noqa: E731
        elif use_kernel:
            slot_sizes, select = group_sizes, lambda a: a  # noqa: E731
        else:
            slot_sizes, select = group_sizes, in_layer

        def gmm(linear: Linear, inputs):
            scale = None if linear.scale is None else select(linear.scale[...])
            return grouped_matmul(inputs, select(linear.weight[...]), scale, slot_sizes.astype(jnp.int32),
                                  **ctx.gemm, use_kernel=use_kernel,
                                  stack_index=stack_index if use_kernel and stacked else None)

        w1 = self.w1.weight[...]
        if use_kernel and self.w1.scale is None and grouped_gemm_backend(rows, w1, out_dtype=x.dtype,
                                                                          swiglu=True) == "mosaic":
            # one wgmma launch for both halves: no float32 product of w1 or w3 in memory
            hidden = grouped_swiglu(rows, w1, self.w3.weight[...], None, None, slot_sizes.astype(jnp.int32),
                                    stack_index=stack_index if stacked else None)
        else:
            hidden = (jax.nn.silu(gmm(self.w1, rows)) * gmm(self.w3, rows)).astype(x.dtype)
        out = gmm(self.w2, hidden) * weights.reshape(-1)[order][:, None]
        out = jnp.where(mine[order][:, None], out, 0.0)  # rows of other ranks' experts were not computed
        return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(out)

    def _fused(self, x, weights, indices, first, ctx: StepContext, stack_index,
               shared: MLP | None, x_fp8=None) -> jnp.ndarray:
        """moe_impl "fused": the (token, choice) assignments sorted by this rank's expert, their rows gathered by
        the first of two Pallas launches: w1, w3 and silu * mul in one (`grouped_gemm_swiglu`), w2 with the routing
        weights applied to its accumulator (`row_scale`); each token's rows gathered back and summed. With
        `shared`, every token has one more assignment per shared expert (`shared_chunks`; weight 1), groups
        past the routed ones that the kernels read from the shared MLP's weights in place, tiles of several
        tokens' rows. Assignments of other ranks' experts sort past every group: the kernels leave them zero."""
        tokens, topk = indices.shape
        local_experts = self.w1.weight.shape[-3]
        chunks, fused, down = _shared_kernel_weights(shared, self.w1.weight.shape[-2])
        local_ids = indices.reshape(-1) - first
        mine = (local_ids >= 0) & (local_ids < local_experts)
        position, sizes = sorted_positions(jnp.where(mine, local_ids, local_experts), local_experts)
        # the rows: this rank's routed assignments by expert, the shared chunks' (chunk-major), the foreign ones
        mine_rows = jnp.sum(sizes)
        row_of = jnp.concatenate([jnp.where(mine, position, position + chunks * tokens),
                                  mine_rows + jnp.arange(chunks * tokens, dtype=position.dtype)])
        token_of = _permuted(jnp.concatenate([jnp.arange(tokens * topk) // topk, jnp.tile(jnp.arange(tokens), chunks)]),
                             row_of)
        row_weights = _permuted(jnp.concatenate([jnp.where(mine, weights.reshape(-1), 0.0).astype(jnp.float32),
                                                 jnp.ones((chunks * tokens,), jnp.float32)]), row_of)
        group_sizes = jnp.concatenate([sizes, jnp.full((chunks,), tokens, jnp.int32)])
        layer = stack_index if self.w1.weight.ndim == 4 else None
        hidden = grouped_swiglu(x, self.w1.weight[...], self.w3.weight[...], _scale(self.w1), _scale(self.w3),
                                group_sizes, **ctx.gemm, stack_index=layer, x_fp8=x_fp8, x_rows=token_of, **fused)
        out = grouped_matmul(hidden, self.w2.weight[...], _scale(self.w2), group_sizes, **ctx.gemm, use_kernel=True,
                             stack_index=layer, row_scale=row_weights, **down)
        # each token's rows gathered and summed in a fixed order: no float32 scatter-add
        routed = jnp.take(out, row_of[:tokens * topk], axis=0).reshape(tokens, topk, -1).sum(axis=1)
        if not chunks:
            return routed
        return routed + jnp.take(out, row_of[tokens * topk:], axis=0).reshape(chunks, tokens, -1).sum(axis=0)

    def _slots(self, x, weights, indices, first, ctx: StepContext, stack_index,
               shared: MLP | None, x_fp8=None) -> jnp.ndarray:
        """moe_impl "slots": the fused kernels over the (token, choice) slots in their own order,
        one row each, found by the kernels from the router's expert ids (`slot_experts`, this rank's
        experts from `first` on), so no argsort, bincount, schedule, row copy or scatter-add runs;
        slots of other ranks' experts come out zero. Each slot reads its expert's weights, so experts
        chosen by several tokens are read several times: for steps of a few tokens. With `shared`,
        each token has one more slot per shared expert (groups past the routed ones, weight 1), after
        the routed slots chunk by chunk; the kernels read the shared MLP's weights in place, several
        tokens' rows to a tile."""
        tokens, topk = weights.shape
        stacked = stack_index if self.w1.weight.ndim == 4 else None
        chunks, fused, down = _shared_kernel_weights(shared, self.w1.weight.shape[-2])
        slots = dict(slot_experts=indices, expert_offset=first, stack_index=stacked, **ctx.gemm)
        hidden = grouped_swiglu(x, self.w1.weight[...], self.w3.weight[...], _scale(self.w1), _scale(self.w3), None,
                                **slots, **fused, x_fp8=x_fp8)
        out = grouped_matmul(hidden, self.w2.weight[...], _scale(self.w2), None, use_kernel=True,
                             row_scale=weights.reshape(-1).astype(jnp.float32), **slots, **down)
        routed = out[:tokens * topk].reshape(tokens, topk, -1).sum(axis=1)
        return routed + out[tokens * topk:].reshape(chunks, tokens, -1).sum(axis=0) if chunks else routed


class MoE(nnx.Module):
    """Gate + routed experts + shared experts; one reduction over the experts' ranks assembles the
    output (`Layout.reduction`: a psum, or, when the batch is split over those ranks too, a gather
    of the rows before and a reduce-scatter after). Shared experts split like the routed experts
    join that reduction (inside the routed experts' grouped kernels where `Experts.shared_chunks` says
    so); replicated ones run on this rank's own rows after it."""

    def __init__(self, args: ModelArgs, *, stack: tuple[int, ...] = (), param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        self.gate = Gate(args, stack=stack, param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(args, stack=stack, param_dtype=param_dtype, rngs=rngs)
        self.shared_experts = (MLP(args.dim, args.n_shared_experts * args.moe_inter_dim, stack=stack,
                                   param_dtype=param_dtype, fp8=args.quantized, rngs=rngs, hidden="shared_ffn")
                               if args.n_shared_experts else None)

    def __call__(self, x: jnp.ndarray, ctx: StepContext, stack_index=None, *, loads: bool = False, x_fp8=None,
                 logits=None):
        """-> the output, the shape of x; with `loads`, also the tokens each routed expert received (E,).
        `x_fp8`: x's act_quant made already (by the norm before), used where no rows are gathered; `logits`: the
        gate's of x's rows, made by the norm before (`gate_in_norm`)."""
        layout = ctx.layout
        shape = x.shape
        local = x.reshape(-1, shape[-1])
        gathered, summed = layout.reduction("experts", "expert_ffn")
        valid = None if ctx.valid is None else jnp.repeat(ctx.valid, shape[1])  # per token
        if valid is not None and gathered:  # the padding flags travel with the rows, in one gather
            both = layout.gather_rows(jnp.concatenate([local, valid[:, None].astype(local.dtype)], -1), gathered)
            flat, valid = both[:, :-1], both[:, -1] > 0
        else:
            flat = layout.gather_rows(local, gathered)
        local_fp8 = None if x_fp8 is None else tuple(a.reshape(local.shape[0], -1) for a in x_fp8)
        flat_fp8 = None if gathered else local_fp8
        with jax.named_scope("gate"):
            router = router_impl(ctx.options.router, flat.shape[0])
            weights, indices = self.gate(flat, router, None if logits is None else logits.reshape(flat.shape[0], -1))
        if valid is not None:  # padding rows' tokens go to no expert (no rank reads an expert for them)
            indices = jnp.where(valid[:, None], indices, -1)
        shared_joins = self.shared_experts is not None and layout.reduction("shared_ffn") == (gathered, summed)
        inside = shared_joins and self.experts.shared_chunks(self.shared_experts, *indices.shape, ctx) > 0
        with jax.named_scope("routed_experts"):
            y = self.experts(flat, weights, indices, ctx, stack_index, self.shared_experts if inside else None,
                             flat_fp8)
        if shared_joins and not inside:
            with jax.named_scope("shared_experts"):
                y = y + self.shared_experts(flat, ctx, layer=stack_index, x_fp8=flat_fp8).astype(jnp.float32)
        y = layout.reduce_rows(y, gathered, summed)
        if self.shared_experts is not None and not shared_joins:
            with jax.named_scope("shared_experts"):
                y = y + self.shared_experts(local, ctx, reduce=True, layer=stack_index,
                                            x_fp8=local_fp8).astype(jnp.float32)
        y = y.astype(x.dtype).reshape(shape)
        if not loads:
            return y
        counted = indices.reshape(-1)  # padding rows' -1 count for no expert
        return y, jnp.bincount(counted, weights=(counted >= 0).astype(jnp.int32), length=self.gate.weight.shape[-2])
