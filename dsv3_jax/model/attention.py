"""Multi-head latent attention (MLA) on an explicit, stacked cache.

Two ways to run it, as in the reference: "naive" expands the latent into per-head keys and values
and caches those; "absorb" (default) folds `wkv_b` into the query and the output and caches only
the normalised latent and the shared rotary key, which is what makes decoding cheap.
The layout splits the heads ("heads": wq/wq_b/wkv_b by output, wo by input, psummed) or the
rows (the cache and the step's rows split by batch, weights replicated), or neither.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import flash_attention, mla_decode
from pallas_kernels.mla import fp8_wkv_b_aligned, mla_absorb_query, mla_decode_output, mla_decode_splits
from pallas_kernels.norm import latent_norm_rope, norm_chunk

from ..config import ModelArgs
from ..options import StepContext
from .layers import Linear, RMSNorm, layer_of, norm_kernel_applies, project
from .rope import apply_rotary


def insert_rows(window: jnp.ndarray, values: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """window (B, T, ...) with values (B, S, ...) placed at [row, positions[row, s]]; positions >= T dropped."""
    batch, seq = positions.shape
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq))
    return window.at[rows, positions].set(values.astype(window.dtype), mode="drop")


def read_cache(cache: jnp.ndarray, layer, batch: int, kv_len: int) -> jnp.ndarray:
    """cache[layer, :batch, :kv_len]."""
    sizes = (1, batch, kv_len) + cache.shape[3:]
    window = jax.lax.dynamic_slice(cache, (layer, 0, 0) + (0,) * (cache.ndim - 3), sizes)
    return window[0]


def write_cache(cache: dict, entries: dict, positions: jnp.ndarray) -> dict:
    """Store every layer's new entries (L, B, S, ...) at cache[:, row, positions[row, s]], in one scatter.

    Done once per step outside the layer scan: inside it, a scatter into the loop-carried stacked
    cache makes XLA copy the whole cache at every layer."""
    batch, seq = positions.shape
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq))
    # entries cover layers [0, L); a cache with an MTP layer has one more, written by write_layer_cache
    return {name: cache[name].at[:entries[name].shape[0], rows, positions].set(
        entries[name].astype(cache[name].dtype), mode="drop") for name in cache}


def write_layer_cache(cache: dict, entries: dict, positions: jnp.ndarray, layer: int) -> dict:
    """Store one layer's new entries (B, S, ...) at cache[layer, row, positions[row, s]]."""
    batch, seq = positions.shape
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq))
    return {name: cache[name].at[layer, rows, positions].set(entries[name].astype(cache[name].dtype), mode="drop")
            for name in cache}


def _einsum(spec: str, a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """A float32-accumulating einsum. XLA:CPU lacks some bf16 x bf16 -> f32 batched dots, so on the
    CPU (tests only) bf16 operands are widened first; on the GPU they go to the tensor cores as is."""
    if jax.default_backend() == "cpu" and (a.dtype == jnp.bfloat16 or b.dtype == jnp.bfloat16):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


class MLA(nnx.Module):
    """Multi-head latent attention for one layer (its parameters may carry a leading layer axis)."""

    def __init__(self, args: ModelArgs, *, stack: tuple[int, ...] = (), param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        self.rope_interleave = args.rope_interleave
        qk_dim, heads = args.qk_head_dim, args.n_heads
        common = dict(stack=stack, param_dtype=param_dtype, fp8=args.quantized, rngs=rngs)
        if args.q_lora_rank == 0:
            self.wq = Linear(args.dim, heads * qk_dim, axes=("heads", "embed"), **common)
        else:
            self.wq_a = Linear(args.dim, args.q_lora_rank, axes=("q_lora", "embed"), **common)
            self.q_norm = RMSNorm(args.q_lora_rank, stack=stack, axis="q_lora")
            self.wq_b = Linear(args.q_lora_rank, heads * qk_dim, axes=("heads", "q_lora"), **common)
        self.wkv_a = Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, axes=("kv_lora", "embed"), **common)
        self.kv_norm = RMSNorm(args.kv_lora_rank, stack=stack, axis="kv_lora")
        self.wkv_b = Linear(args.kv_lora_rank, heads * (self.nope_dim + self.v_dim), axes=("heads", "kv_lora"),
                            **common)
        self.wo = Linear(heads * self.v_dim, args.dim, axes=("embed", "heads"), **common)

    def __call__(self, x: jnp.ndarray, ctx: StepContext, cache: dict | None, layer,
                 stack_index=None, norm: RMSNorm | None = None) -> tuple[jnp.ndarray, dict]:
        """x (B, S, dim) -> (attention output (B, S, dim), summed over the heads' ranks; this chunk's
        cache entries). B is this device's rows (the cache's, when the layout splits the batch).
        `stack_index`: this layer's place in the weight stacks kept whole (`run_stack`): wkv_b's, and the
        projections' and norms' where kernels read them. `norm`: the RMSNorm applied to x first (the block's
        attn_norm), which decode-sized steps run inside the projections' launch (`layers.project`).

        `cache` None: no cache, the chunk attends to itself (a full-sequence pass; `kv_len` unused).
        `cache` is read, not written: attention sees its window with this chunk's entries put in
        place, and the caller stores the returned entries (see `write_cache`)."""
        batch, seq, _ = x.shape
        q, q_pe, kv = self._project(x, ctx, stack_index, norm)
        flash = flash_impl(ctx.options.prefill_attn, seq, cache is not None)
        if self._decodes_in_kernels(q, ctx, cache):
            out, entries = self._decode_in_three_launches(q, q_pe, kv, ctx, cache, layer, stack_index)
        elif ctx.options.attn_impl == "naive":
            out, entries = self._naive(q[..., :self.nope_dim], q_pe, *self._latent_and_rotary_key(kv, ctx, stack_index),
                                       ctx, cache, layer, flash, stack_index)
        else:
            out, entries = self._absorb(q, q_pe, *self._latent_and_rotary_key(kv, ctx, stack_index), ctx, cache,
                                        layer, flash, stack_index)
        (y,) = project([self.wo], out.reshape(batch, seq, -1), reduce=ctx.layout.axes("heads"), layer=stack_index,
                       **ctx.gemm)
        return y, entries

    def _project(self, x: jnp.ndarray, ctx: StepContext, stack_index=None, norm: RMSNorm | None = None):
        """The query (B, S, H, nope + rope; its nope half is q_nope), its rotated rope half (B, S, H, rope)
        and wkv_a's output (B, S, C + rope) of the chunk (x normed by `norm` first)."""
        batch, seq, _ = x.shape
        gemm = dict(ctx.gemm, layer=stack_index)
        if hasattr(self, "wq"):
            q, kv = project([self.wq, self.wkv_a], x, norm=norm, norm_scope="attn_norm", **gemm)
        else:
            q_a, kv = project([self.wq_a, self.wkv_a], x, norm=norm, norm_scope="attn_norm", **gemm)
            (q,) = project([self.wq_b], q_a, norm=self.q_norm, norm_scope="q_norm", **gemm)
        q = q.reshape(batch, seq, -1, self.nope_dim + self.rope_dim)
        q_pe = apply_rotary(q[..., self.nope_dim:], ctx.cos, ctx.sin, self.rope_interleave)
        return q, q_pe, kv

    def _latent_and_rotary_key(self, kv, ctx: StepContext, stack_index):
        """wkv_a's output (B, S, C + rope) split: the normed latent, read in place, and the rotated shared
        key; in decode-sized steps on a GPU one kernel does both."""
        rank, rope = self.kv_lora_rank, self.rope_dim
        if norm_kernel_applies(kv.shape[0] * kv.shape[1]) and norm_chunk(rank) and not rope & (rope - 1):
            weight = self.kv_norm.weight[...]
            return latent_norm_rope(kv, weight, ctx.cos, ctx.sin, eps=self.kv_norm.eps, rank=rank,
                                    layer=stack_index if weight.ndim == 2 else None, interleaved=self.rope_interleave)
        k_pe = apply_rotary(kv[..., rank:], ctx.cos, ctx.sin, self.rope_interleave)
        return self.kv_norm(kv, layer=stack_index, columns=rank), k_pe

    def _naive(self, q_nope, q_pe, latent, k_pe, ctx, cache, layer, flash, stack_index):
        """Per-head keys and values from wkv_b, cached as such."""
        batch, seq, heads, _ = q_nope.shape
        dtype = q_nope.dtype
        kv_full = layer_of(self.wkv_b, stack_index)(latent, **ctx.gemm)
        kv_full = kv_full.reshape(batch, seq, heads, self.nope_dim + self.v_dim)
        k_nope, v = kv_full[..., : self.nope_dim], kv_full[..., self.nope_dim:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], (batch, seq, heads, self.rope_dim))], -1)
        keys, values = _window(cache, "k", layer, ctx, k), _window(cache, "v", layer, ctx, v)
        q_full = jnp.concatenate([q_nope, q_pe], -1)
        if flash:
            out = flash_attention(q_full, keys.astype(dtype), values.astype(dtype), ctx.positions,
                                  scale=self.softmax_scale, kv_start=ctx.kv_start, impl=flash)
        else:
            scores = _einsum("bshd,bthd->bsht", q_full, keys) * self.softmax_scale
            probs = _softmax(scores, _visible(ctx, cache is not None)).astype(dtype)
            out = _einsum("bsht,bthd->bshd", probs, values).astype(dtype)
        return out, dict(k=k, v=v)

    def _absorb(self, q, q_pe, latent, k_pe, ctx, cache, layer, flash, stack_index):
        """The latent cache (q: the whole query, its nope half then q_pe's columns). Single-token and short
        steps fold wkv_b into the query and the output and attend over the latents; prefill chunks expand
        the window's latents into per-head keys and values for flash attention (fewer FLOPs per score, and
        no score buffer)."""
        heads, dtype = q.shape[2], q.dtype
        kernel = decode_kernel(ctx.options.decode_attn) and q.shape[1] == 1 and cache is not None
        q_nope = q[..., :self.nope_dim]
        wkv_b = layer_of(self.wkv_b, stack_index).dequantized(dtype).reshape(heads, self.nope_dim + self.v_dim,
                                                                             self.kv_lora_rank)
        w_k, w_v = wkv_b[:, : self.nope_dim], wkv_b[:, self.nope_dim:]
        entries = dict(kv=latent, pe=k_pe)
        latents, rotary_keys = _window(cache, "kv", layer, ctx, latent), _window(cache, "pe", layer, ctx, k_pe)
        if flash:
            k_nope = _einsum("btc,hdc->bthd", latents, w_k).astype(dtype)
            keys = jnp.concatenate([k_nope, jnp.broadcast_to(rotary_keys[:, :, None, :].astype(dtype),
                                                             k_nope.shape[:3] + (self.rope_dim,))], -1)
            values = _einsum("btc,hdc->bthd", latents, w_v).astype(dtype)
            out = flash_attention(jnp.concatenate([q_nope, q_pe], -1), keys, values, ctx.positions,
                                  scale=self.softmax_scale, kv_start=ctx.kv_start, impl=flash)
            return out, entries
        q_latent = _einsum("bshd,hdc->bshc", q_nope, w_k).astype(dtype)
        if kernel and not ctx.kv_start:
            # read in place: cache positions < p are the row's older tokens, plus its new entry
            out_latent = mla_decode(q_latent[:, 0], q_pe[:, 0], cache["kv"], cache["pe"], layer,
                                    ctx.positions[:, 0], latent[:, 0], k_pe[:, 0], scale=self.softmax_scale,
                                    kv_len=ctx.kv_len)[:, None].astype(dtype)
        else:
            scores = (_einsum("bshc,btc->bsht", q_latent, latents)
                      + _einsum("bshr,btr->bsht", q_pe, rotary_keys)) * self.softmax_scale
            probs = _softmax(scores, _visible(ctx, cache is not None)).astype(dtype)
            out_latent = _einsum("bsht,btc->bshc", probs, latents).astype(dtype)
        return _einsum("bshc,hdc->bshd", out_latent, w_v).astype(dtype), entries

    def _decodes_in_kernels(self, q, ctx: StepContext, cache) -> bool:
        """Whether this step's attention is `_decode_in_three_launches`: single-token steps over a cache
        from position 0, the latent cache, the decode kernel chosen, wkv_b's absorptions in kernels."""
        return (ctx.options.attn_impl != "naive" and decode_kernel(ctx.options.decode_attn) and q.shape[1] == 1
                and cache is not None and not ctx.kv_start and self._absorbs_in_kernels(q.dtype))

    def _absorbs_in_kernels(self, dtype) -> bool:
        """Whether single-token steps run wkv_b's absorptions in Pallas kernels beside the decode
        attention (`_decode_in_three_launches`): a key half of power-of-two width (a Triton tile) and
        weights, once dequantized, in the step's dtype."""
        return (self.nope_dim >= 16 and not self.nope_dim & (self.nope_dim - 1)
                and (self.wkv_b.scale is not None or self.wkv_b.weight.dtype == dtype))

    def _decode_in_three_launches(self, q, q_pe, kv, ctx, cache, layer, stack_index):
        """Absorbed single-token attention as three kernels: the query's absorption into the latent
        space, the attention over the cache read in place (split over its positions), then the splits'
        merge with the new entry and the output's projection through wkv_b's value half. The weights are
        read from their layer stack in place, fp8 ones dequantized tile by tile in the kernels where their
        blocks align (else dequantized first). The query's nope half is read from the whole query in place;
        the first kernel also rotates its rope half (`q_pe`, XLA's rotary, is then unused) and, with the
        weights read from their stacks, norms the latent and rotates the shared key (no launch of their own)."""
        wkv_b, index, scale = self.wkv_b.weight[...], stack_index, None
        if self.wkv_b.scale is not None and fp8_wkv_b_aligned(self.nope_dim, self.v_dim, self.kv_lora_rank):
            scale = self.wkv_b.scale[...]
        elif self.wkv_b.scale is not None:
            wkv_b, index = layer_of(self.wkv_b, stack_index).dequantized(q.dtype), None
        absorb = functools.partial(mla_absorb_query, q[:, 0], wkv_b, index, wkv_b_scale=scale, nope=self.nope_dim)
        rope, rank = (ctx.cos[:, 0], ctx.sin[:, 0], self.rope_interleave), self.kv_lora_rank
        if not (self.rope_dim >= 32 and not self.rope_dim & (self.rope_dim - 1)):  # no Triton tile of rotary columns
            (latent, k_pe), q_pe, q_latent = self._latent_and_rotary_key(kv, ctx, stack_index), q_pe[:, 0], absorb()
        elif index is None or self.kv_norm.weight.ndim != 2 or rank < 16 or rank & (rank - 1):
            (latent, k_pe), (q_latent, q_pe) = self._latent_and_rotary_key(kv, ctx, stack_index), absorb(rope=rope)
        else:
            q_latent, q_pe, latent, k_pe = absorb(rope=rope, latent_norm=(kv[:, 0], self.kv_norm.weight[...],
                                                                          self.kv_norm.eps))
            latent, k_pe = latent[:, None], k_pe[:, None]
        splits = mla_decode_splits(q_latent, q_pe, cache["kv"], cache["pe"], layer, ctx.positions[:, 0],
                                   kv_len=ctx.kv_len, scale=self.softmax_scale)
        out = mla_decode_output(*splits, q_latent, q_pe, latent[:, 0], k_pe[:, 0], wkv_b, index,
                                scale=self.softmax_scale, v_dim=self.v_dim, wkv_b_scale=scale)
        return out[:, None], dict(kv=latent, pe=k_pe)


# Steps of fewer queries (decode, speculative verification) attend over the latents directly: the
# expansion of the whole window through wkv_b costs more than their scores do.
FLASH_MIN_QUERIES = 32
_FLASH_IMPLS = {"auto": "auto", "kernel": "mosaic", "jnp": "jnp"}


def flash_impl(prefill_attn: str, seq: int, cached: bool) -> str | None:
    """The `flash_attention` impl a step of `seq` queries runs, or None for the dense scores: cached
    multi-token steps (prefill chunks) under any `prefill_attn` but "dense". A full-sequence pass
    without a cache (training) keeps the dense form, which has a gradient."""
    if prefill_attn == "dense" or seq < FLASH_MIN_QUERIES or not cached:
        return None
    return _FLASH_IMPLS[prefill_attn]


def _visible(ctx: StepContext, cached: bool) -> jnp.ndarray:
    """(B, S, 1, T) mask: key position t is visible to the query at position p iff kv_start <= t <= p.
    Without a cache (a full-sequence pass) the chunk's own tokens are the keys."""
    key_pos = jnp.arange(ctx.kv_len)[None, None, None, :] if cached else ctx.positions[:, None, None, :]
    visible = key_pos <= ctx.positions[:, :, None, None]
    if ctx.kv_start:  # the MTP block's cache starts at position kv_start
        visible = visible & (key_pos >= ctx.kv_start)
    return visible


def decode_kernel(decode_attn: str) -> bool:
    """Whether single-token steps run the Pallas MLA decode kernel: "auto" on a GPU, where it reads
    the latent cache in place (no slower than XLA's attention at any batch measured; benchmarks/NOTES.md);
    elsewhere it would run interpreted."""
    return decode_attn == "kernel" or (decode_attn == "auto" and jax.default_backend() == "gpu")


def _window(cache: dict | None, name: str, layer, ctx: StepContext, new: jnp.ndarray) -> jnp.ndarray:
    """What attention reads: the cache window [0, kv_len) with this chunk's entries in place, or,
    without a cache, the chunk's entries alone."""
    if cache is None:
        return new
    return insert_rows(read_cache(cache[name], layer, new.shape[0], ctx.kv_len), new, ctx.positions)


def _softmax(scores: jnp.ndarray, visible: jnp.ndarray) -> jnp.ndarray:
    scores = jnp.where(visible, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)
