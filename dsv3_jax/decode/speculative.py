"""Speculative decoding with DeepSeek-V3's MTP module as a one-token draft: the jitted steps' math.

After the prefill (which also runs the MTP module over the prompt, filling its cache, and drafts a
guess d for the position after the first sampled token; chunk by chunk, as `generate.prefill`
drives it: per chunk the main model, then the MTP module over the same positions shifted by one),
every step is one jitted, shard_mapped
function of fixed shapes:

1. verify: one main-model pass over [t, d] at positions [p, p + 1] of each row (t the newest
   token, not yet cached), giving the main logits for p + 1 and p + 2 and the normed hidden
   states H_p, H_{p+1};
2. accept d: greedy (T == 0) iff d is the main model's argmax at p + 1; else with probability
   min(1, p(d) / q(d)) and, on rejection, draw from normalize(max(p - q, 0)) instead, which keeps
   the output distribution exactly the main model's; on acceptance also draw the bonus token from
   the logits at p + 2. A row emits one or two tokens and advances by as many;
3. draft: the MTP module runs at positions [p + 1, p + 2] on (emitted tokens, [H_p, H_{p+1}])
   (its cache entries at both, the second one harmlessly overwritten next step when the draft was
   rejected), and the output at the last accepted position gives the next draft and its
   distribution q.

The cache (main layers plus the MTP block's layer n_layers) and the state are donated; the only host
transfer per step is a copy of the (B, 4) int32 `out`: the two candidate tokens, how many of them
the row emits, and whether its draft was accepted. The generation loop that drives these steps is
`generate.generate`'s.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..model.transformer import step_context
from ..sharding import Layout
from .sampling import distribution, draw, random_rows
from .step import StepParts, decode_step_parts, step_builder


class SpecState(NamedTuple):
    """Per-row speculative-decoding state, kept on the device between steps."""

    token: jax.Array  # (B,) int32: the newest token, not yet in the main cache, at `position`
    draft: jax.Array  # (B,) int32: the MTP module's guess for position + 1
    draft_probs: jax.Array  # (B, vocab) float32: the distribution q the draft was drawn from
    position: jax.Array  # (B,) int32
    finished: jax.Array  # (B,) bool
    remaining: jax.Array  # (B,) int32: how many more tokens the row may emit
    key: jax.Array  # PRNG key
    temperature: jax.Array  # () float32
    eos_id: jax.Array  # () int32
    out: jax.Array  # (B, 4) int32: [first token, second token, tokens emitted (0-2), draft accepted]


def _normalized(probs: jax.Array) -> jax.Array:
    return probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)


def draft_tokens(model, y: jax.Array, temperature, key, top_k, top_p, layout: Layout):
    """(draft token, its distribution q) from the MTP module's normed outputs y (B, dim); the
    parameters and key one for all rows or one per row, as `sampling.distribution` and `draw` take them."""
    logits = model.logits(y, layout)
    q = _normalized(distribution(logits, temperature, top_k=top_k, top_p=top_p))
    token = jnp.where(temperature > 0, draw(q, key), jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return token, q


def _prefill_chunk(parts: StepParts, state, cache, tokens, following, start, lengths, carry, seed, temperature, *,
                   kv_len: int, mtp_kv_len: int, top_k: int, top_p: float) -> tuple[tuple, dict]:
    """One chunk (B, C) of the right-padded prompts at positions [start, start + C): the main model
    over it, then the MTP module at positions start + 1 .. start + C, position j + 1 taking token
    t_{j+1} (`following`: the token at start + C, the next chunk's first) with the main model's H_j,
    and at each row's last prompt index (lengths - 1) its first token, sampled here when this chunk
    holds that index. Returns ((first token, draft, draft distribution q) per row, the cache): from
    this chunk for the rows whose last index it holds, else from `carry` (the previous chunks';
    None for the first chunk, whose other rows hold meaningless values until their chunk comes)."""
    model, layout = nnx.merge(parts.graphdef, state), parts.layout
    batch, size = tokens.shape
    rows = jnp.arange(batch)
    positions = start + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32)[None], (batch, size))
    hidden, cache = model.hidden(tokens, _context(parts, positions, kv_len), cache)
    last = lengths - 1 - start
    holds = (last >= 0) & (last < size)
    last = jnp.clip(last, 0, size - 1)
    logits = model.logits(hidden[rows, last], layout)
    _, first_key, draft_key = jax.random.split(jax.random.key(seed), 3)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    first = jnp.where(temperature > 0, draw(distribution(logits, temperature, top_k=top_k, top_p=top_p),
                                            first_key), greedy)
    next_tokens = jnp.concatenate([tokens[:, 1:], following[:, None].astype(tokens.dtype)], axis=1)
    next_tokens = next_tokens.at[rows, last].set(jnp.where(holds, first, next_tokens[rows, last]))
    y, cache = model.mtp_hidden(next_tokens, hidden, _context(parts, positions + 1, mtp_kv_len, 1), cache)
    draft, q = draft_tokens(model, y[rows, last], temperature, draft_key, top_k, top_p, layout)
    if carry is None:
        return (first, draft, q), cache
    keep = lambda new, old: jnp.where(holds.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    return tuple(keep(new, old) for new, old in zip((first, draft, q), carry)), cache


@jax.jit
def start_speculating(carry, lengths, budgets, seed, temperature, eos_id) -> SpecState:
    """The state the speculative steps start from, given each row's (first token, draft, q) from
    the prefill chunks (`_prefill_chunk`)."""
    first, draft, q = carry
    key = jax.random.split(jax.random.key(seed), 3)[0]
    remaining = budgets - 1
    finished = (first == eos_id) | (remaining <= 0)
    out = jnp.stack([first, jnp.zeros_like(first), jnp.ones_like(first), jnp.zeros_like(first)], axis=1)
    return SpecState(first, draft, q, lengths, finished, remaining, key, temperature, eos_id, out)


def accept_draft(logits: jax.Array, draft: jax.Array, draft_probs: jax.Array, temperature, keys, top_k, top_p,
                 *, greedy: bool = False):
    """Step 2 of the module docstring: (accepted, the token at p + 1, the bonus token at p + 2) per row,
    from the main logits (B, 2, vocab) at p + 1 and p + 2 and the draft with its distribution q.
    temperature, the filters and the three keys (accept, residual, bonus) are one for all rows or
    one per row; greedy (static): every row has T == 0, so only the argmaxes are computed."""
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return argmax[:, 0] == draft, argmax[:, 0], argmax[:, 1]
    accept_key, residual_key, bonus_key = keys
    rows = jnp.arange(draft.shape[0])
    sampling = temperature > 0
    p_now = _normalized(distribution(logits[:, 0], temperature, top_k=top_k, top_p=top_p))
    p_next = distribution(logits[:, 1], temperature, top_k=top_k, top_p=top_p)
    p_d, q_d = p_now[rows, draft], draft_probs[rows, draft]
    accept_sampled = random_rows(jax.random.uniform, accept_key, rows.shape) * q_d < p_d
    residual = jnp.maximum(p_now - draft_probs, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_now)
    accept = jnp.where(sampling, accept_sampled, argmax[:, 0] == draft)
    corrected = jnp.where(sampling, draw(residual, residual_key), argmax[:, 0])
    bonus = jnp.where(sampling, draw(p_next, bonus_key), argmax[:, 1])
    return accept, jnp.where(accept, draft, corrected), bonus


def _step(parts: StepParts, state, cache, s: SpecState, *, kv_len: int, top_k: int,
          top_p: float) -> tuple[SpecState, dict]:
    """Verify each row's draft, emit one or two tokens, and draft again (the module docstring's 1-3)."""
    model, layout = nnx.merge(parts.graphdef, state), parts.layout
    rows = jnp.arange(s.token.shape[0])
    positions = s.position[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
    hidden, cache = model.hidden(jnp.stack([s.token, s.draft], axis=1), _context(parts, positions, kv_len), cache)
    logits = model.logits(hidden, layout)  # (B, 2, vocab): predictions for p + 1 and p + 2
    key, accept_key, residual_key, bonus_key, draft_key = jax.random.split(s.key, 5)
    accept, first, second = accept_draft(logits, s.draft, s.draft_probs, s.temperature,
                                         (accept_key, residual_key, bonus_key), top_k, top_p)
    active = ~s.finished
    count = jnp.where(accept & (first != s.eos_id), 2, 1)
    count = jnp.where(active, jnp.minimum(count, s.remaining), 0)
    # the MTP module at p + 1 (first, H_p) and p + 2 (second, H_{p+1}); the draft from the last accepted
    y, cache = model.mtp_hidden(jnp.stack([first, second], axis=1), hidden,
                                _context(parts, positions + 1, kv_len, 1), cache)
    advance = jnp.where(accept, 2, 1)
    draft, q = draft_tokens(model, y[rows, advance - 1], s.temperature, draft_key, top_k, top_p, layout)
    remaining = s.remaining - count
    finished = s.finished | (active & ((first == s.eos_id) | ((count == 2) & (second == s.eos_id))
                                       | (remaining <= 0)))
    keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    out = jnp.stack([first, second, count, (accept & active).astype(jnp.int32)], axis=1)
    return s._replace(token=keep(jnp.where(accept, second, first), s.token), draft=keep(draft, s.draft),
                      draft_probs=keep(q, s.draft_probs), position=keep(s.position + advance, s.position),
                      finished=finished, remaining=remaining, key=key, out=out), cache


def _context(parts: StepParts, positions, kv_len: int, kv_start: int = 0):
    return step_context(parts.args, positions, kv_len, parts.options, parts.layout, kv_start)


@step_builder
def make_mtp_steps(parts: StepParts):
    """The jitted MTP prefill chunk and speculative step of a model with an MTP module (cache
    donated); `parts.layout` must not split the batch (every device holds every row's state).

    prefill(state, cache, tokens, following, start, lengths, carry, seed, temperature, *, kv_len, mtp_kv_len,
            top_k, top_p) -> ((first, draft, q), cache)  (`_prefill_chunk`; `start_speculating` then makes the
        SpecState);  step(state, cache, spec_state, *, kv_len, top_k, top_p) -> (SpecState, cache), with
        spec_state donated too.
    """
    c_specs = parts.cache_specs
    step_parts, compiler_options = decode_step_parts(parts)  # decode graphs, as the plain decode step

    def prefill(state, cache, tokens, following, start, lengths, carry, seed, temperature, *, kv_len, mtp_kv_len,
                top_k, top_p):
        body = functools.partial(_prefill_chunk, parts, kv_len=kv_len, mtp_kv_len=mtp_kv_len, top_k=top_k,
                                 top_p=top_p)
        return jax.shard_map(body, mesh=parts.mesh, in_specs=(parts.state_specs, c_specs) + (P(),) * 7,
                             out_specs=(P(), c_specs), check_vma=False)(
            state, cache, tokens, following, start, lengths, carry, seed, temperature)

    def step(state, cache, s, *, kv_len, top_k, top_p):
        body = functools.partial(_step, step_parts, kv_len=kv_len, top_k=top_k, top_p=top_p)
        return jax.shard_map(body, mesh=parts.mesh, in_specs=(parts.state_specs, c_specs, P()),
                             out_specs=(P(), c_specs), check_vma=False)(state, cache, s)

    return (jax.jit(prefill, static_argnames=("kv_len", "mtp_kv_len", "top_k", "top_p"), donate_argnums=(1,)),
            # keep_unused: the state's `out`, which the step only writes, is donated too (its buffer reused)
            jax.jit(step, static_argnames=("kv_len", "top_k", "top_p"), donate_argnums=(1, 2), keep_unused=True,
                    compiler_options=compiler_options))
