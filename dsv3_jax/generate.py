"""Generation: the reference's sampler, a jitted prefill and decode step, and the loop that drives them.

One `generate` call has a fixed `Plan`: the prompts are right-padded to a length bucket (a power
of two, at least 16) for one prefill, and every decode step attends over one cache window
(`cache_window(total_len)`), so a call compiles the prefill once per (batch, bucket, window) and
the decode step once per (batch, window). Sampling is fused into both steps and the per-row
`DecodeState` stays on the device; the cache is donated to each step and updated in place.
Every row advances from its own position, so prompts of unequal length need no teacher-forced
steps: a row's completion starts right after its own prompt.
"""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cache import cache_window

MIN_PREFILL_BUCKET = 16


def sample(logits: jax.Array, temperature: jax.Array, key: jax.Array, *, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
    """One token per row of `logits` (B, vocab), as the reference samples.

    p = softmax(logits / max(T, 1e-5)) and token = argmax(p / E), E ~ Exponential(1) (an exact
    draw from p); T == 0 means argmax. `top_k` > 0 keeps the k most likely tokens and `top_p` < 1
    the smallest set whose probability reaches top_p (both off by default).
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    sampled = draw(distribution(logits, temperature, top_k=top_k, top_p=top_p), key)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def distribution(logits: jax.Array, temperature: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """The distribution `sample` draws from when temperature > 0: softmax(logits / T) with the
    top-k / top-p filters applied and renormalised (float32, the shape of `logits`)."""
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-5)
    if top_k:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if top_p < 1.0:
        ordered = -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(ordered, axis=-1) - ordered
        kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        smallest_kept = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        probs = jnp.where(probs >= smallest_kept, probs, 0.0)
    return probs


def draw(probs: jax.Array, key: jax.Array) -> jax.Array:
    """An exact draw from each row of (unnormalised, non-negative) `probs`: argmax(probs / E),
    E ~ Exponential(1)."""
    noise = jax.random.exponential(key, probs.shape, jnp.float32)
    return jnp.argmax(probs / noise, axis=-1).astype(jnp.int32)


class DecodeState(NamedTuple):
    """Per-row generation state, kept on the device between steps."""

    token: jax.Array  # (B,) int32: the newest token, not yet in the cache
    position: jax.Array  # (B,) int32: where `token` goes
    finished: jax.Array  # (B,) bool: emitted eos or used up its budget; frozen from then on
    remaining: jax.Array  # (B,) int32: how many more tokens the row may emit
    key: jax.Array  # PRNG key for the next draw
    temperature: jax.Array  # () float32
    eos_id: jax.Array  # () int32


@dataclasses.dataclass(frozen=True)
class Plan:
    """What stays fixed for one generation: the prompt lengths, each row's budget of new tokens,
    the padded prefill length, the attention window and the (static) sampling filters."""

    lengths: tuple[int, ...]
    budgets: tuple[int, ...]
    bucket: int
    kv_len: int
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def make(cls, lengths: Sequence[int], max_new_tokens: int, max_seq_len: int, *, top_k: int = 0,
             top_p: float = 1.0, window: int = 0) -> "Plan":
        """The reference's budget: total_len = min(max_seq_len, max_new_tokens + longest prompt), and
        row i may emit min(max_new_tokens, total_len - len_i) tokens. The attention window is the
        power of two (>= 64) covering total_len and at least `window`, capped at max_seq_len."""
        longest = max(lengths)
        total_len = min(max_seq_len, max_new_tokens + longest)
        budgets = tuple(max(0, min(max_new_tokens, total_len - n)) for n in lengths)
        bucket = min(max_seq_len, max(MIN_PREFILL_BUCKET, 1 << (longest - 1).bit_length()))
        kv_len = cache_window(max(total_len, bucket, window), max_seq_len)
        return cls(tuple(lengths), budgets, bucket, kv_len, top_k, top_p)

    @property
    def max_new_tokens(self) -> int:
        return max(self.budgets)


@functools.partial(jax.jit, static_argnames=("step", "kv_len", "top_k", "top_p"), donate_argnums=(1,))
def prefill_step(params, cache, tokens, lengths, budgets, seed, temperature, eos_id, *, step, kv_len: int,
                 top_k: int, top_p: float) -> tuple[DecodeState, dict]:
    """Run the right-padded prompts (B, bucket) from position 0 and sample each row's first token
    from the logits at its last prompt position. `step` is a model's jitted step (`Model.step`)."""
    batch = tokens.shape[0]
    logits, cache = step(params, cache, tokens, jnp.zeros((batch,), jnp.int32), lengths - 1, kv_len=kv_len)
    key, draw = jax.random.split(jax.random.key(seed))
    token = sample(logits, temperature, draw, top_k=top_k, top_p=top_p)
    remaining = budgets - 1
    finished = (token == eos_id) | (remaining <= 0)
    return DecodeState(token, lengths, finished, remaining, key, temperature, eos_id), cache


@functools.partial(jax.jit, static_argnames=("step", "kv_len", "top_k", "top_p"), donate_argnums=(1,))
def decode_step(params, cache, state: DecodeState, *, step, kv_len: int, top_k: int,
                top_p: float) -> tuple[DecodeState, dict]:
    """Feed every row's newest token at its own position and sample the next one; finished rows
    keep their token and position (their cache writes only touch their own finished row)."""
    logits, cache = step(params, cache, state.token[:, None], state.position, jnp.zeros_like(state.position),
                         kv_len=kv_len)
    key, draw = jax.random.split(state.key)
    sampled = sample(logits, state.temperature, draw, top_k=top_k, top_p=top_p)
    active = ~state.finished
    token = jnp.where(active, sampled, state.token)
    remaining = state.remaining - active.astype(jnp.int32)
    finished = state.finished | (token == state.eos_id) | (remaining <= 0)
    position = state.position + active.astype(jnp.int32)
    return state._replace(token=token, position=position, finished=finished, remaining=remaining, key=key), cache


def _token_lists(prompt_tokens) -> list:
    """The prompts as a list of rows: a list (or tuple) of token lists or 1-D arrays, or a 2-D
    integer array (batch, seq) as `Model.forward` takes; anything else is a one-line error."""
    if hasattr(prompt_tokens, "ndim"):  # a numpy or jax array
        array = np.asarray(prompt_tokens)
        if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"prompt_tokens as an array must be 2-D integer (batch, seq), got {array.dtype} "
                             f"{array.shape}")
        return array.tolist()
    if not isinstance(prompt_tokens, (list, tuple)) or not prompt_tokens:
        raise ValueError("prompt_tokens must be a non-empty list of token lists (one per prompt)")
    for i, prompt in enumerate(prompt_tokens):
        if isinstance(prompt, (str, bytes)) or not (isinstance(prompt, (list, tuple)) or hasattr(prompt, "ndim")):
            raise ValueError(f"prompt_tokens must be a list of token lists (one per prompt), but prompt_tokens[{i}] "
                             f"is {type(prompt).__name__} {prompt!r:.30}: one prompt is [[id, id, ...]]")
    return list(prompt_tokens)


def _check_prompts(model, prompt_tokens) -> list[list[int]]:
    args = model.args
    prompt_tokens = _token_lists(prompt_tokens)
    if len(prompt_tokens) > args.max_batch_size:
        raise ValueError(f"{len(prompt_tokens)} prompts exceed max_batch_size={args.max_batch_size}")
    prompts = []
    for i, prompt in enumerate(prompt_tokens):
        values = np.asarray(prompt).reshape(-1) if hasattr(prompt, "ndim") else prompt
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in values):
            raise ValueError(f"prompt {i} holds values that are not integer token ids")
        ids = [int(t) for t in values]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) > args.max_seq_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_seq_len={args.max_seq_len}")
        if min(ids) < 0 or max(ids) >= args.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {args.vocab_size})")
        prompts.append(ids)
    return prompts


def _check_options(model, max_new_tokens, temperature, top_k, top_p, seed) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.number)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if not isinstance(top_k, int) or not 0 <= top_k <= model.args.vocab_size:
        raise ValueError(f"top_k must be an int in [0, {model.args.vocab_size}] (0: off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1] (1: off), got {top_p}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must lie in [0, 2**32), got {seed}")


def prefill(model, prompt_tokens: Sequence[Sequence[int]], max_new_tokens: int, *, eos_id: int | None = None,
            temperature: float = 1.0, seed: int = 0, top_k: int = 0, top_p: float = 1.0,
            window: int = 0) -> tuple[DecodeState, Plan]:
    """Prefill `model`'s cache with the prompts and sample the first tokens: (state, plan) for `decode`.

    window: a minimum attention window for the whole call (see `Plan.make`); a caller that passes
    the same window every time (the chat passes max_seq_len) reuses one compiled decode step."""
    prompts = _check_prompts(model, prompt_tokens)
    _check_options(model, max_new_tokens, temperature, top_k, top_p, seed)
    plan = Plan.make([len(p) for p in prompts], max_new_tokens, model.args.max_seq_len, top_k=top_k,
                     top_p=float(top_p), window=window)
    tokens = np.zeros((len(prompts), plan.bucket), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    state, model.cache = prefill_step(
        model.state, model.cache, tokens, np.asarray(plan.lengths, np.int32), np.asarray(plan.budgets, np.int32),
        np.uint32(seed), np.float32(temperature), np.int32(-1 if eos_id is None else eos_id),
        step=model.step, kv_len=plan.kv_len, top_k=plan.top_k, top_p=plan.top_p)
    return state, plan


def decode(model, state: DecodeState, plan: Plan) -> DecodeState:
    """One decode step for every unfinished row (asynchronous: nothing waits for the device)."""
    state, model.cache = decode_step(model.state, model.cache, state, step=model.step, kv_len=plan.kv_len,
                                     top_k=plan.top_k, top_p=plan.top_p)
    return state


class MaxSeqLenWarning(UserWarning):
    """Some completion stopped because its prompt and completion filled max_seq_len, before eos and
    before max_new_tokens. `generate` and `generate_mtp` warn with it; `warnings.simplefilter("ignore",
    MaxSeqLenWarning)` silences it (the chat CLI does, and says the same in its own words)."""


def warn_if_cut(plan: Plan, completions: list[list[int]], max_new_tokens: int, max_seq_len: int) -> None:
    """Warn (MaxSeqLenWarning) naming the rows whose completion max_seq_len cut short."""
    cut = [row for row, (budget, completion) in enumerate(zip(plan.budgets, completions))
           if budget < max_new_tokens and len(completion) == budget]
    if cut:
        warnings.warn(f"the completions of prompts {cut} stopped at max_seq_len={max_seq_len} (prompt plus "
                      f"completion), before max_new_tokens={max_new_tokens}", MaxSeqLenWarning, stacklevel=3)


@dataclasses.dataclass
class Timing:
    """Where a `generate` call spent its time: the prefill (prompt tokens in, first tokens out) and
    the decode steps (every later token), each measured up to its results being ready."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    acceptance: float | None = None  # speculative decoding: the share of MTP drafts accepted

    def __str__(self) -> str:
        def rate(tokens, seconds):
            return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "- tok/s"

        accepted = "" if self.acceptance is None else f" · MTP acceptance {self.acceptance:.0%}"
        return (f"[prefill {self.prefill_tokens} tokens {rate(self.prefill_tokens, self.prefill_seconds)} · "
                f"decode {self.decode_tokens} tokens {rate(self.decode_tokens, self.decode_seconds)}{accepted}]")


def generate(model, prompt_tokens: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | None,
             temperature: float = 1.0, seed: int = 0, *, top_k: int = 0, top_p: float = 1.0, window: int = 0,
             on_tokens: Callable[[list[list[int]]], None] | None = None,
             timing: Timing | None = None) -> list[list[int]]:
    """Complete every prompt; the reference's contract with per-row positions.

    Row i emits at most min(max_new_tokens, total_len - len_i) tokens (total_len =
    min(max_seq_len, max_new_tokens + longest prompt)); its completion stops before its first
    `eos_id` (None: no eos); the loop ends when every row is finished. `on_tokens(completions)`
    is called after every step with the completions so far (for streaming). The next step is
    dispatched before the newest tokens are fetched, so the one small transfer per step overlaps
    the device's work. `timing`, when given, receives the prefill's and the decode steps' tokens
    and seconds (it waits for the prefill to finish: compile before timing, e.g. with `warm_up`).
    A completion that max_seq_len cut short (prompt plus completion reached it before eos and
    max_new_tokens) is named in a `MaxSeqLenWarning`.
    """
    started = time.perf_counter()
    state, plan = prefill(model, prompt_tokens, max_new_tokens, eos_id=eos_id, temperature=temperature, seed=seed,
                          top_k=top_k, top_p=top_p, window=window)
    if timing is not None:
        state.token.block_until_ready()
        prefilled = time.perf_counter()
        timing.prefill_tokens, timing.prefill_seconds = sum(plan.lengths), prefilled - started
    completions: list[list[int]] = [[] for _ in plan.lengths]
    active = [budget > 0 for budget in plan.budgets]
    decoded = 0  # tokens kept from decode steps (the first of each row comes from the prefill)
    for index in range(plan.max_new_tokens):
        following = decode(model, state, plan) if index + 1 < plan.max_new_tokens else None
        tokens = np.asarray(state.token)
        for row, token in enumerate(tokens.tolist()):
            if not active[row]:
                continue
            if token == eos_id:
                active[row] = False
                continue
            completions[row].append(token)
            decoded += index > 0
            active[row] = len(completions[row]) < plan.budgets[row]
        if on_tokens is not None:
            on_tokens(completions)
        if not any(active):
            break
        state = following
    if timing is not None:
        timing.decode_tokens, timing.decode_seconds = decoded, time.perf_counter() - prefilled
    warn_if_cut(plan, completions, max_new_tokens, model.args.max_seq_len)
    return completions


def warm_up(model, lengths: Sequence[int], max_new_tokens: int, *, top_k: int = 0, top_p: float = 1.0,
            window: int = 0) -> None:
    """Compile the prefill and decode steps that prompts of these lengths will use (one step each)."""
    state, plan = prefill(model, [[0] * n for n in lengths], max_new_tokens, top_k=top_k, top_p=top_p,
                          window=window)
    decode(model, state, plan).token.block_until_ready()
