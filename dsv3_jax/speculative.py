"""Speculative decoding with DeepSeek-V3's MTP module as a one-token draft (REFERENCE.md §6).

After the prefill (which also runs the MTP module over the prompt, filling its cache, and drafts a
guess d for the position after the first sampled token), every step is one jitted, shard_mapped
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

The cache (main layers plus the MTP block's layer n_layers) is donated; the only host transfer per
step is a (B, 4) int32 array: the two candidate tokens, how many of them the row emits, and
whether its draft was accepted.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from .cache import cache_specs
from .config import ModelArgs
from .generate import Plan, Timing, _check_options, _check_prompts, distribution, draw, warn_if_cut
from .options import RunOptions, StepContext
from .rope import inverse_frequencies, rotary_angles
from .sharding import Layout


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


def _draft(model, y: jax.Array, temperature, key, top_k: int, top_p: float, layout: Layout):
    """(draft token, its distribution q) from the MTP module's normed outputs y (B, dim)."""
    logits = model.logits(y, layout)
    q = _normalized(distribution(logits, temperature, top_k=top_k, top_p=top_p))
    token = jnp.where(temperature > 0, draw(q, key), jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return token, q


def make_mtp_steps(graphdef: nnx.GraphDef, state_specs, args: ModelArgs, mesh: Mesh, options: RunOptions,
                   layout: Layout):
    """The jitted MTP prefill and speculative step of a model with an MTP module (cache donated);
    `layout` must not split the batch (every device holds every row's state).

    prefill(state, cache, tokens, lengths, budgets, seed, temperature, eos_id, *, kv_len, top_k, top_p)
        -> (SpecState, cache);  step(state, cache, spec_state, *, kv_len, top_k, top_p) -> (SpecState, cache).
    """
    inv_freq = inverse_frequencies(args)
    c_specs = cache_specs(options.attn_impl, layout)

    def context(positions, kv_len, kv_start=0):
        cos, sin = rotary_angles(positions, inv_freq, args.rope_attention_factor)
        return StepContext(positions, cos, sin, kv_len, options, args.scale_fmt, kv_start, layout)

    def local_prefill(state, cache, tokens, lengths, budgets, seed, temperature, eos_id, *, kv_len, top_k, top_p):
        model = nnx.merge(graphdef, state)
        batch, seq = tokens.shape
        rows = jnp.arange(batch)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], (batch, seq))
        hidden, cache = model.hidden(tokens, context(positions, kv_len), cache)
        last = lengths - 1
        logits = model.logits(hidden[rows, last], layout)
        key, first_key, draft_key = jax.random.split(jax.random.key(seed), 3)
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        first = jnp.where(temperature > 0, draw(distribution(logits, temperature, top_k=top_k, top_p=top_p),
                                                first_key), greedy)
        # the MTP module at positions 1..seq: token t_j with the main model's H_{j-1}
        next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], axis=1)
        next_tokens = next_tokens.at[rows, last].set(first)
        y, cache = model.mtp_hidden(next_tokens, hidden, context(positions + 1, kv_len, 1), cache)
        draft, q = _draft(model, y[rows, last], temperature, draft_key, top_k, top_p, layout)
        remaining = budgets - 1
        finished = (first == eos_id) | (remaining <= 0)
        out = jnp.stack([first, jnp.zeros_like(first), jnp.ones_like(first), jnp.zeros_like(first)], axis=1)
        return SpecState(first, draft, q, lengths, finished, remaining, key, temperature, eos_id, out), cache

    def local_step(state, cache, s: SpecState, *, kv_len, top_k, top_p):
        model = nnx.merge(graphdef, state)
        batch = s.token.shape[0]
        rows = jnp.arange(batch)
        positions = s.position[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
        hidden, cache = model.hidden(jnp.stack([s.token, s.draft], axis=1), context(positions, kv_len), cache)
        logits = model.logits(hidden, layout)  # (B, 2, vocab): predictions for p + 1 and p + 2
        key, accept_key, residual_key, bonus_key, draft_key = jax.random.split(s.key, 5)
        sampling = s.temperature > 0
        argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        p_now = _normalized(distribution(logits[:, 0], s.temperature, top_k=top_k, top_p=top_p))
        p_next = distribution(logits[:, 1], s.temperature, top_k=top_k, top_p=top_p)
        p_d, q_d = p_now[rows, s.draft], s.draft_probs[rows, s.draft]
        accept_sampled = jax.random.uniform(accept_key, (batch,)) * q_d < p_d
        residual = jnp.maximum(p_now - s.draft_probs, 0.0)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_now)
        accept = jnp.where(sampling, accept_sampled, argmax[:, 0] == s.draft)
        corrected = jnp.where(sampling, draw(residual, residual_key), argmax[:, 0])
        bonus = jnp.where(sampling, draw(p_next, bonus_key), argmax[:, 1])
        first = jnp.where(accept, s.draft, corrected)
        second = bonus
        active = ~s.finished
        count = jnp.where(accept & (first != s.eos_id), 2, 1)
        count = jnp.where(active, jnp.minimum(count, s.remaining), 0)
        # the MTP module at p + 1 (first, H_p) and p + 2 (second, H_{p+1}); the draft from the last accepted
        y, cache = model.mtp_hidden(jnp.stack([first, second], axis=1), hidden, context(positions + 1, kv_len, 1),
                                    cache)
        advance = jnp.where(accept, 2, 1)
        draft, q = _draft(model, y[rows, advance - 1], s.temperature, draft_key, top_k, top_p, layout)
        remaining = s.remaining - count
        finished = s.finished | (active & ((first == s.eos_id) | ((count == 2) & (second == s.eos_id))
                                           | (remaining <= 0)))
        keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
        out = jnp.stack([first, second, count, (accept & active).astype(jnp.int32)], axis=1)
        return s._replace(token=keep(jnp.where(accept, second, first), s.token), draft=keep(draft, s.draft),
                          draft_probs=keep(q, s.draft_probs), position=keep(s.position + advance, s.position),
                          finished=finished, remaining=remaining, key=key, out=out), cache

    def prefill(state, cache, tokens, lengths, budgets, seed, temperature, eos_id, *, kv_len, top_k, top_p):
        body = functools.partial(local_prefill, kv_len=kv_len, top_k=top_k, top_p=top_p)
        return jax.shard_map(body, mesh=mesh, in_specs=(state_specs, c_specs) + (P(),) * 6,
                             out_specs=(P(), c_specs), check_vma=False)(
            state, cache, tokens, lengths, budgets, seed, temperature, eos_id)

    def step(state, cache, s, *, kv_len, top_k, top_p):
        body = functools.partial(local_step, kv_len=kv_len, top_k=top_k, top_p=top_p)
        return jax.shard_map(body, mesh=mesh, in_specs=(state_specs, c_specs, P()), out_specs=(P(), c_specs),
                             check_vma=False)(state, cache, s)

    statics = ("kv_len", "top_k", "top_p")
    return (jax.jit(prefill, static_argnames=statics, donate_argnums=(1,)),
            jax.jit(step, static_argnames=statics, donate_argnums=(1,)))


def mtp_prefill(model, prompt_tokens, max_new_tokens: int, *, eos_id: int | None = None, temperature: float = 1.0,
                seed: int = 0, top_k: int = 0, top_p: float = 1.0, window: int = 0) -> tuple[SpecState, Plan]:
    """Prefill the main and MTP caches, sample the first tokens and draft the next: (state, plan)."""
    prompts = _check_prompts(model, prompt_tokens)
    _check_options(model, max_new_tokens, temperature, top_k, top_p, seed)
    plan = Plan.make([len(p) for p in prompts], max_new_tokens, model.args.max_seq_len, top_k=top_k,
                     top_p=float(top_p), window=window)
    tokens = np.zeros((len(prompts), plan.bucket), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    prefill, _ = model.mtp_steps
    state, model.cache = prefill(
        model.state, model.cache, tokens, np.asarray(plan.lengths, np.int32), np.asarray(plan.budgets, np.int32),
        np.uint32(seed), np.float32(temperature), np.int32(-1 if eos_id is None else eos_id),
        kv_len=plan.kv_len, top_k=plan.top_k, top_p=plan.top_p)
    return state, plan


def mtp_decode(model, state: SpecState, plan: Plan) -> SpecState:
    """One speculative step (verify the drafts, emit 1-2 tokens per row, draft again); asynchronous."""
    _, step = model.mtp_steps
    state, model.cache = step(model.state, model.cache, state, kv_len=plan.kv_len, top_k=plan.top_k,
                              top_p=plan.top_p)
    return state


def generate_mtp(model, prompt_tokens: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | None,
                 temperature: float = 1.0, seed: int = 0, *, top_k: int = 0, top_p: float = 1.0, window: int = 0,
                 on_tokens: Callable[[list[list[int]]], None] | None = None,
                 stats: dict | None = None, timing: Timing | None = None) -> list[list[int]]:
    """`generate.generate`'s contract, decoding speculatively with the MTP module's one-token drafts.

    `stats` (a dict), when given, receives "drafts" (drafts verified for rows still generating),
    "accepted" (of which accepted), "steps" (model steps after the prefill) and "acceptance".
    `timing` as in `generate.generate`, with the acceptance rate added; a completion max_seq_len cut
    short is named in a `MaxSeqLenWarning`, as there.
    """
    started = time.perf_counter()
    state, plan = mtp_prefill(model, prompt_tokens, max_new_tokens, eos_id=eos_id, temperature=temperature,
                              seed=seed, top_k=top_k, top_p=top_p, window=window)
    if timing is not None:
        state.out.block_until_ready()
        prefilled = time.perf_counter()
        timing.prefill_tokens, timing.prefill_seconds = sum(plan.lengths), prefilled - started
    completions: list[list[int]] = [[] for _ in plan.lengths]
    active = [budget > 0 for budget in plan.budgets]
    drafts = accepted = steps = decoded = 0
    for index in range(plan.max_new_tokens):
        # at most max_new_tokens steps (each emits at least one token per active row)
        following = mtp_decode(model, state, plan) if index + 1 < plan.max_new_tokens else None
        out = np.asarray(state.out)
        if index:
            steps += 1
        for row, (first, second, count, was_accepted) in enumerate(out.tolist()):
            if not active[row]:
                continue
            if index:
                drafts += 1
                accepted += was_accepted
            for token in (first, second)[:count]:
                if token == eos_id:
                    active[row] = False
                    break
                completions[row].append(token)
                decoded += index > 0
                if len(completions[row]) >= plan.budgets[row]:
                    active[row] = False
                    break
        if on_tokens is not None:
            on_tokens(completions)
        if not any(active):
            break
        state = following
    acceptance = accepted / drafts if drafts else 0.0
    if stats is not None:
        stats.update(drafts=drafts, accepted=accepted, steps=steps, acceptance=acceptance)
    if timing is not None:
        timing.decode_tokens, timing.decode_seconds = decoded, time.perf_counter() - prefilled
        timing.acceptance = acceptance
    warn_if_cut(plan, completions, max_new_tokens, model.args.max_seq_len)
    return completions


def warm_up_mtp(model, lengths: Sequence[int], max_new_tokens: int, *, top_k: int = 0, top_p: float = 1.0,
                window: int = 0) -> None:
    """Compile the MTP prefill and speculative step that prompts of these lengths will use."""
    state, plan = mtp_prefill(model, [[0] * n for n in lengths], max_new_tokens, top_k=top_k, top_p=top_p,
                              window=window)
    mtp_decode(model, state, plan).out.block_until_ready()
