"""Generation: jitted prefill and decode steps, and the one loop that drives them, for plain and
speculative decoding (`speculative`: the MTP steps' math).

One `generate` call has a fixed `Plan`: the prompts are right-padded to a length bucket (a power
of two, at least 16, capped at max_seq_len) and prefilled from position 0 in chunks of at most
`RunOptions.prefill_chunk` tokens per row (one chunk when the bucket fits in one; bucket and chunk
are powers of two, so the chunks tile it), each chunk attending over the cache window that covers
its end. A chunk step is compiled once per (batch, chunk, window), so prompts of any length
compile a bounded set of prefill steps; each row keeps the logits at its last prompt token from
the chunk that holds it, and one small step then samples the first tokens. Every decode step
attends over one cache window (`cache_window(total_len)`) and is compiled once per (batch, window).
Sampling runs on the device and the per-row `DecodeState` stays there; the cache and the state are
donated to each step and updated in place (a step whose buffers sit where the previous one's did
replays its CUDA graph as recorded, with no update of the graph's arguments). Every row advances
from its own position, so prompts of unequal length need no teacher-forced steps: a row's
completion starts right after its own prompt.
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

from ..model.cache import cache_window
from ..options import RunOptions
from .sampling import sample
from .speculative import SpecState, start_speculating
from .step import StepParts, decode_step_parts, make_step, step_builder

MIN_PREFILL_BUCKET = 16


class DecodeState(NamedTuple):
    """Per-row generation state, kept on the device between steps."""

    token: jax.Array  # (B,) int32: the newest token, not yet in the cache
    position: jax.Array  # (B,) int32: where `token` goes
    finished: jax.Array  # (B,) bool: emitted eos or used up its budget; frozen from then on
    remaining: jax.Array  # (B,) int32: how many more tokens the row may emit
    key: jax.Array  # PRNG key for the next draw
    temperature: jax.Array  # () float32
    eos_id: jax.Array  # () int32


class PrefillChunk(NamedTuple):
    """One prefill step of a plan: its first position and the cache windows it attends over."""

    start: int
    kv_len: int  # the main model's window: covers positions < start + chunk
    mtp_kv_len: int  # the MTP module's (one position later): covers positions <= start + chunk


def prefill_chunks(bucket: int, chunk: int, max_seq_len: int) -> tuple[PrefillChunk, ...]:
    """The chunks of `chunk` positions that cover [0, bucket), in order. They tile it when chunk
    divides bucket (both powers of two); a bucket capped at a max_seq_len that is not a power of
    two ends with a chunk that starts at bucket - chunk and redoes part of the one before it."""
    starts = sorted({min(start, bucket - chunk) for start in range(0, bucket, chunk)})
    return tuple(PrefillChunk(start, cache_window(start + chunk, max_seq_len),
                              cache_window(start + chunk + 1, max_seq_len)) for start in starts)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What stays fixed for one generation: the prompt lengths, each row's budget of new tokens,
    the padded prefill length and its chunks, the attention window and the (static) sampling filters."""

    lengths: tuple[int, ...]
    budgets: tuple[int, ...]
    bucket: int
    kv_len: int
    chunk: int  # tokens per row of one prefill step
    chunks: tuple[PrefillChunk, ...]
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def make(cls, lengths: Sequence[int], max_new_tokens: int, max_seq_len: int, *, top_k: int = 0,
             top_p: float = 1.0, window: int = 0, prefill_chunk: int = RunOptions.prefill_chunk) -> "Plan":
        """The reference's budget: total_len = min(max_seq_len, max_new_tokens + longest prompt), and
        row i may emit min(max_new_tokens, total_len - len_i) tokens. The attention window is the
        power of two (>= 64) covering total_len and at least `window`, capped at max_seq_len. The
        bucket is prefilled in chunks of min(bucket, prefill_chunk) positions."""
        longest = max(lengths)
        total_len = min(max_seq_len, max_new_tokens + longest)
        budgets = tuple(max(0, min(max_new_tokens, total_len - n)) for n in lengths)
        bucket = min(max_seq_len, max(MIN_PREFILL_BUCKET, 1 << (longest - 1).bit_length()))
        kv_len = cache_window(max(total_len, bucket, window), max_seq_len)
        chunk = min(bucket, prefill_chunk)
        return cls(tuple(lengths), budgets, bucket, kv_len, chunk, prefill_chunks(bucket, chunk, max_seq_len),
                   top_k, top_p)

    @property
    def max_new_tokens(self) -> int:
        return max(self.budgets)


@functools.partial(jax.jit, static_argnames=("step", "kv_len"), donate_argnums=(1,))
def prefill_chunk_step(params, cache, tokens, start, lengths, logits, *, step, kv_len: int) -> tuple[jax.Array, dict]:
    """One chunk (B, C) of the right-padded prompts at positions [start, start + C) into the cache.

    Returns (B, vocab) float32: for each row whose last prompt token (lengths - 1) lies in this
    chunk, the logits there; for the others, their row of `logits`, the previous chunks' (None: this
    is the first chunk, and those rows hold meaningless logits until the chunk with their last
    token). `step` is a model's jitted step (`Model.step`)."""
    batch, size = tokens.shape
    last = lengths - 1 - start
    chunk_logits, cache = step(params, cache, tokens, jnp.full((batch,), start, jnp.int32),
                               jnp.clip(last, 0, size - 1), kv_len=kv_len)
    if logits is None:
        return chunk_logits, cache
    holds = (last >= 0) & (last < size)
    return jnp.where(holds[:, None], chunk_logits, logits), cache


@functools.partial(jax.jit, static_argnames=("top_k", "top_p"))
def start_decoding(logits, lengths, budgets, seed, temperature, eos_id, *, top_k: int,
                   top_p: float) -> DecodeState:
    """Each row's first token, sampled from `logits` (those at its last prompt token), and the
    state the decode steps start from."""
    key, draw = jax.random.split(jax.random.key(seed))
    token = sample(logits, temperature, draw, top_k=top_k, top_p=top_p)
    remaining = budgets - 1
    finished = (token == eos_id) | (remaining <= 0)
    return DecodeState(token, lengths, finished, remaining, key, temperature, eos_id)


@step_builder
def make_decode_step(parts: StepParts):
    """The jitted decode step of a model: `(params, cache, state, *, kv_len, top_k, top_p) -> (state, cache)`,
    `sample_step` around the model's step, the cache and the state donated. With decode graphs (`decode_step_parts`) its
    layer scans are unrolled and it is compiled with XLA command buffers, so that one CUDA graph replays
    the whole step's kernels: a launch per step instead of one per kernel."""
    step_parts, compiler_options = decode_step_parts(parts)
    return jax.jit(functools.partial(sample_step, make_step(step_parts)), static_argnames=("kv_len", "top_k", "top_p"),
                   donate_argnums=(1, 2), compiler_options=compiler_options)


def sample_step(step, params, cache, state: DecodeState, *, kv_len: int, top_k: int,
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
            temperature: float = 1.0, seed: int = 0, top_k: int = 0, top_p: float = 1.0, window: int = 0,
            mtp: bool = False, every_chunk: bool = True) -> tuple[DecodeState | SpecState, Plan]:
    """Prefill `model`'s cache with the prompts and sample the first tokens: (state, plan) for `decode`.

    window: a minimum attention window for the whole call (see `Plan.make`); a caller that passes
    the same window every time (the chat passes max_seq_len) reuses one compiled decode step.
    mtp: also run the MTP module over the prompts and draft the next tokens (speculative decoding).
    every_chunk False (`warm_up`): run only one chunk per compiled prefill step, which compiles
    everything the plan uses but leaves a meaningless cache and state."""
    mtp_chunk_step = model.mtp_steps[0] if mtp else None
    prompts = _check_prompts(model, prompt_tokens)
    _check_options(model, max_new_tokens, temperature, top_k, top_p, seed)
    plan = Plan.make([len(p) for p in prompts], max_new_tokens, model.args.max_seq_len, top_k=top_k,
                     top_p=float(top_p), window=window, prefill_chunk=model.options.prefill_chunk)
    tokens = np.zeros((len(prompts), plan.bucket + 1), np.int32)  # a zero past the bucket: the MTP's next token
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    lengths, budgets = np.asarray(plan.lengths, np.int32), np.asarray(plan.budgets, np.int32)
    seed, temperature, eos_id = np.uint32(seed), np.float32(temperature), np.int32(-1 if eos_id is None else eos_id)
    chunks = plan.chunks if every_chunk else _one_per_compilation(plan.chunks, mtp)
    carry = None
    for chunk in chunks:
        piece, start = tokens[:, chunk.start:chunk.start + plan.chunk], np.int32(chunk.start)
        if mtp:
            carry, model.cache = mtp_chunk_step(
                model.state, model.cache, piece, tokens[:, chunk.start + plan.chunk], start, lengths, carry, seed,
                temperature, kv_len=chunk.kv_len, mtp_kv_len=chunk.mtp_kv_len, top_k=plan.top_k, top_p=plan.top_p)
        else:
            carry, model.cache = prefill_chunk_step(model.state, model.cache, piece, start, lengths, carry,
                                                    step=model.step, kv_len=chunk.kv_len)
    if mtp:
        return start_speculating(carry, lengths, budgets, seed, temperature, eos_id), plan
    return start_decoding(carry, lengths, budgets, seed, temperature, eos_id, top_k=plan.top_k,
                          top_p=plan.top_p), plan


def _one_per_compilation(chunks: Sequence[PrefillChunk], mtp: bool) -> list[PrefillChunk]:
    """The first chunk of each compiled prefill step: one per window (two windows with the MTP
    module), the first chunk apart (it has no previous chunks' results)."""
    kept, seen = [], set()
    for index, chunk in enumerate(chunks):
        compiled = (index == 0, chunk.kv_len, chunk.mtp_kv_len if mtp else 0)
        if compiled not in seen:
            seen.add(compiled)
            kept.append(chunk)
    return kept


def decode(model, state: DecodeState | SpecState, plan: Plan) -> DecodeState | SpecState:
    """One decode step for every unfinished row (asynchronous: nothing waits for the device); a
    speculative state takes a speculative step (verify the drafts, emit 1-2 tokens per row, draft again).
    `state` is donated, as the cache is: read what it holds before passing it (`read_out`)."""
    step = model.mtp_steps[1] if isinstance(state, SpecState) else model.decode_step
    state, model.cache = step(model.state, model.cache, state, kv_len=plan.kv_len, top_k=plan.top_k,
                              top_p=plan.top_p)
    return state


@jax.jit
def read_out(state: DecodeState | SpecState) -> jax.Array:
    """A copy of what the step that made `state` emitted, which outlives the state's donation to the
    next step: the tokens (B,) of a `DecodeState`, the `out` rows (B, 4) of a `SpecState`."""
    return jnp.copy(state.out if isinstance(state, SpecState) else state.token)


def emitted(read: jax.Array) -> list[tuple[list[int], int]]:
    """Per row, what a step emitted (its `read_out`): (its tokens, 1 if a draft was accepted)."""
    rows = np.asarray(read).tolist()
    if np.ndim(read) == 2:  # a speculative step's [first, second, count, accepted]
        return [([first, second][:count], accepted) for first, second, count, accepted in rows]
    return [([token], 0) for token in rows]


class MaxSeqLenWarning(UserWarning):
    """Some completion stopped because its prompt and completion filled max_seq_len, before eos and
    before max_new_tokens. `generate` warns with it; `warnings.simplefilter("ignore",
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


@dataclasses.dataclass
class _Progress:
    """The host's side of a generation: completions so far, which rows still run, and the counts."""

    completions: list[list[int]]
    active: list[bool]
    decoded: int = 0  # tokens kept from decode steps (the first of each row comes from the prefill)
    drafts: int = 0  # speculative: drafts verified for rows still generating
    accepted: int = 0
    steps: int = 0  # model steps after the prefill

    def take(self, read: jax.Array, plan: Plan, eos_id: int | None, after_prefill: bool) -> None:
        """Append what the newest step emitted (its `read_out`) to each active row, up to its eos or budget."""
        self.steps += after_prefill
        for row, (tokens, was_accepted) in enumerate(emitted(read)):
            if not self.active[row]:
                continue
            self.drafts += after_prefill
            self.accepted += was_accepted if after_prefill else 0
            for token in tokens:
                if token == eos_id:
                    self.active[row] = False
                    break
                self.completions[row].append(token)
                self.decoded += after_prefill
                if len(self.completions[row]) >= plan.budgets[row]:
                    self.active[row] = False
                    break

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0


def generate(model, prompt_tokens: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | None,
             temperature: float = 1.0, seed: int = 0, *, top_k: int = 0, top_p: float = 1.0, window: int = 0,
             on_tokens: Callable[[list[list[int]]], None] | None = None, timing: Timing | None = None,
             mtp: bool = False, stats: dict | None = None) -> list[list[int]]:
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

    mtp: decode speculatively with the MTP module's one-token drafts (same outputs when greedy, the
    same distribution when sampling). `stats` (a dict) then receives "drafts" (drafts verified for
    rows still generating), "accepted" (of which accepted), "steps" (model steps after the prefill)
    and "acceptance"; `timing` its acceptance rate.
    """
    started = time.perf_counter()
    state, plan = prefill(model, prompt_tokens, max_new_tokens, eos_id=eos_id, temperature=temperature, seed=seed,
                          top_k=top_k, top_p=top_p, window=window, mtp=mtp)
    if timing is not None:
        jax.block_until_ready(state)
        prefilled = time.perf_counter()
        timing.prefill_tokens, timing.prefill_seconds = sum(plan.lengths), prefilled - started
    progress = _Progress([[] for _ in plan.lengths], [budget > 0 for budget in plan.budgets])
    # at most max_new_tokens steps (each emits at least one token per active row)
    for index in range(plan.max_new_tokens):
        read = read_out(state)  # before the next step, to which `state` is donated
        following = decode(model, state, plan) if index + 1 < plan.max_new_tokens else None
        progress.take(read, plan, eos_id, after_prefill=index > 0)
        if on_tokens is not None:
            on_tokens(progress.completions)
        if not any(progress.active):
            break
        state = following
    if mtp and stats is not None:
        stats.update(drafts=progress.drafts, accepted=progress.accepted, steps=progress.steps,
                     acceptance=progress.acceptance)
    if timing is not None:
        timing.decode_tokens, timing.decode_seconds = progress.decoded, time.perf_counter() - prefilled
        if mtp:
            timing.acceptance = progress.acceptance
    warn_if_cut(plan, progress.completions, max_new_tokens, model.args.max_seq_len)
    return progress.completions


def warm_up(model, lengths: Sequence[int], max_new_tokens: int, *, top_k: int = 0, top_p: float = 1.0,
            window: int = 0, mtp: bool = False) -> None:
    """Compile the prefill and decode steps that prompts of these lengths will use (running each
    compiled step once; the cache then holds meaningless entries, overwritten by the next prefill)."""
    state, plan = prefill(model, [[0] * n for n in lengths], max_new_tokens, top_k=top_k, top_p=top_p,
                          window=window, mtp=mtp, every_chunk=False)
    jax.block_until_ready(decode(model, state, plan))
