"""The server's speculative steps: `Engine`'s rows, decoded with the MTP module's one-token drafts.

The math is `dsv3_jax.decode.speculative`'s (verify [t, d] at [p, p + 1], accept d by its rule,
draft again with the MTP module at [p + 1, p + 2]), with per-row sampling parameters and keys (a
row's keys split from fold_in(key(seed), p)), and rows addressed as `Engine` addresses them. The
device keeps each row's state (`SpecRows`: newest token, draft and its distribution q, position,
remaining budget); the host sends only which rows step and with what parameters, and reads one
(rows, 3) int32 array per iteration: each row's two candidate tokens and how many it emitted.

A row emits 1 or 2 tokens per step, never more than its budget; the device ignores eos (the host
ends the request there and drops what follows, as it drops a plain row's one extra step).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..decode.sampling import distribution, draw, row_keys
from ..decode.speculative import accept_draft, draft_tokens
from ..model.transformer import step_context
from .engine import Engine
from .plan import DecodeRow, PrefillRow
from .sampling import GREEDY, row_filters


class SpecRows(NamedTuple):
    """Each cache row's speculative state, on the device (replicated)."""

    token: jax.Array  # (R,) int32: the newest token, not yet in the cache, at `position`
    draft: jax.Array  # (R,) int32: the MTP module's guess for position + 1
    draft_probs: jax.Array  # (R, vocab) float32: the distribution q the draft was drawn from
    position: jax.Array  # (R,) int32
    remaining: jax.Array  # (R,) int32: how many more tokens the row may emit


def _keys(ints, positions, count: int) -> tuple[jax.Array, ...]:
    """`count` per-row keys split from fold_in(key(seed), position) (seeds in ints[:, 3])."""
    keys = jax.vmap(lambda key: jax.random.split(key, count))(row_keys(ints[:, 3].astype(jnp.uint32), positions))
    return tuple(keys[:, i] for i in range(count))


def _context(parts, positions, kv_len: int, kv_start: int = 0):
    return step_context(parts.args, positions, kv_len, parts.options, parts.layout, kv_start)


def _put(field: jax.Array, rows, where, values) -> jax.Array:
    """field with field[rows[i]] = values[i] where `where[i]` (rows past the field's end dropped)."""
    kept = jnp.take(field, rows, axis=0, mode="fill", fill_value=0)
    mask = where.reshape((-1,) + (1,) * (values.ndim - 1))
    return field.at[rows].set(jnp.where(mask, values, kept), mode="drop")


def _verify(parts, state, cache, s: SpecRows, out, ints, floats, *, kv_len: int, mode: str):
    """One speculative step for the active rows of [0, B) (ints[:, 1]; the others are parked at the
    cache's last position and keep their state). Returns (state, out, cache)."""
    model, layout = nnx.merge(parts.graphdef, state), parts.layout
    batch = ints.shape[0]
    rows = jnp.arange(batch)
    active = (ints[:, 1] > 0) & (s.remaining[:batch] > 0)
    position = jnp.where(active, s.position[:batch], parts.args.max_seq_len - 1)
    positions = position[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
    draft = s.draft[:batch]
    with parts.options.precision_scope():
        hidden, cache = model.hidden(jnp.stack([s.token[:batch], draft], axis=1), _context(parts, positions, kv_len),
                                     cache)
        logits = model.logits(hidden, layout)  # (B, 2, vocab): predictions for p + 1 and p + 2
        temperature = floats[:, 0]
        top_k, top_p = row_filters(ints[:, 2], floats[:, 1], mode)
        accept_key, residual_key, bonus_key, draft_key = _keys(ints, position, 4)
        accept, first, second = accept_draft(logits, draft, s.draft_probs[:batch], temperature,
                                             (accept_key, residual_key, bonus_key), top_k, top_p,
                                             greedy=mode == GREEDY)
        y, cache = model.mtp_hidden(jnp.stack([first, second], axis=1), hidden,
                                    _context(parts, positions + 1, kv_len, 1), cache)
        advance = jnp.where(accept, 2, 1)
        y = y[rows, advance - 1]  # the MTP output at the last accepted position drafts the next token
        if mode == GREEDY:  # q is read only for sampled rows: a greedy batch leaves it
            new_draft, q = jnp.argmax(model.logits(y, layout), axis=-1).astype(jnp.int32), None
        else:
            new_draft, q = draft_tokens(model, y, temperature, draft_key, top_k, top_p, layout)
    count = jnp.where(active, jnp.minimum(advance, s.remaining[:batch]), 0)

    def put(field, values):  # rows [0, batch): the active ones take their new values
        mask = active.reshape((-1,) + (1,) * (values.ndim - 1))
        return field.at[:batch].set(jnp.where(mask, values, field[:batch]))

    s = SpecRows(put(s.token, values=jnp.where(accept, second, first)), put(s.draft, values=new_draft),
                 s.draft_probs if q is None else put(s.draft_probs, values=q), put(s.position, values=position + advance),
                 put(s.remaining, values=s.remaining[:batch] - count))
    return s, out.at[:batch].set(jnp.stack([first, second, count], axis=1)), cache


def _prefill_rows(parts, state, window, s: SpecRows, out, chunk, following, rows, starts, last_index, budgets, ints,
                  floats, *, kv_len: int):
    """The prompt chunks (P, C) of `rows` on their gathered cache window: the main model, then the
    MTP module one position later (position j + 1 taking prompt token j + 1 with H_j; at a row's last
    prompt index, its first token). A row whose prompt ends here (ints[:, 1]) gets its first token,
    draft and q, sampled with its own parameters. Returns (state, out, window)."""
    model, layout = nnx.merge(parts.graphdef, state), parts.layout
    count, size = chunk.shape
    index = jnp.arange(count)
    positions = starts[:, None] + jnp.arange(size, dtype=jnp.int32)[None]
    finishing = ints[:, 1] > 0
    temperature, top_k, top_p = floats[:, 0], ints[:, 2], floats[:, 1]
    with parts.options.precision_scope():
        hidden, window = model.hidden(chunk, _context(parts, positions, kv_len), window)
        logits = model.logits(hidden[index, last_index], layout)
        first_key, draft_key = _keys(ints, ints[:, 0], 2)
        first = jnp.where(temperature > 0, draw(distribution(logits, temperature, top_k=top_k, top_p=top_p), first_key),
                          jnp.argmax(logits, axis=-1).astype(jnp.int32))
        next_tokens = jnp.concatenate([chunk[:, 1:], following[:, None]], axis=1)
        next_tokens = next_tokens.at[index, last_index].set(jnp.where(finishing, first, next_tokens[index, last_index]))
        y, window = model.mtp_hidden(next_tokens, hidden, _context(parts, positions + 1, kv_len, 1), window)
        draft, q = draft_tokens(model, y[index, last_index], temperature, draft_key, top_k, top_p, layout)
    put = functools.partial(_put, rows=rows, where=finishing)
    s = SpecRows(put(s.token, values=first), put(s.draft, values=draft), put(s.draft_probs, values=q),
                 put(s.position, values=starts + last_index + 1), put(s.remaining, values=budgets - 1))
    out = put(out, values=jnp.stack([first, jnp.zeros_like(first), jnp.ones_like(first)], axis=1))
    return s, out, window


def _decode_step(parts, state, cache, s, out, ints, floats, *, kv_len: int, mode: str):
    body = functools.partial(_verify, parts, kv_len=kv_len, mode=mode)
    return jax.shard_map(body, mesh=parts.mesh, in_specs=(parts.state_specs, parts.cache_specs) + (P(),) * 4,
                         out_specs=(P(), P(), parts.cache_specs), check_vma=False)(state, cache, s, out, ints, floats)


def _prefill_step(parts, state, cache, s, out, chunk, following, rows, starts, last_index, budgets, ints, floats, *,
                  kv_len: int):
    window = {name: jnp.take(array[:, :, :kv_len], rows, axis=1, mode="fill", fill_value=0)
              for name, array in cache.items()}
    body = functools.partial(_prefill_rows, parts, kv_len=kv_len)
    s, out, window = jax.shard_map(body, mesh=parts.mesh, in_specs=(parts.state_specs, parts.cache_specs) + (P(),) * 10,
                                   out_specs=(P(), P(), parts.cache_specs), check_vma=False)(
        state, window, s, out, chunk, following, rows, starts, last_index, budgets, ints, floats)
    cache = {name: cache[name].at[:, rows, :kv_len].set(window[name], mode="drop") for name in cache}
    return s, out, cache


class SpeculativeEngine(Engine):
    """`Engine`'s rows and plans, stepped speculatively with the model's MTP module (load it with mtp=True)."""

    def __init__(self, model, **kwargs):
        if not model.has_mtp:
            raise ValueError("speculative serving needs the model's MTP module: load it with mtp=True")
        super().__init__(model, **kwargs)
        # one row more than the cache: a step of every row then still updates part of the state (an XLA:CPU
        # compile of the full update crashes on meshes of several devices); the spare row is never read
        rows, vocab = self.rows + 1, model.args.vocab_size

        def zeros(shape, dtype):
            return jax.device_put(np.zeros(shape, dtype), self.replicated)

        self.spec_rows = SpecRows(zeros((rows,), np.int32), zeros((rows,), np.int32), zeros((rows, vocab), np.float32),
                                  zeros((rows,), np.int32), zeros((rows,), np.int32))
        self.out = zeros((rows, 3), np.int32)
        parts = model.parts
        self._spec_decode = jax.jit(functools.partial(_decode_step, parts), static_argnames=("kv_len", "mode"),
                                    donate_argnums=(1, 2))
        self._spec_prefill = jax.jit(functools.partial(_prefill_step, parts), static_argnames=("kv_len",),
                                     donate_argnums=(1, 2))

    def decode(self, rows: tuple[DecodeRow, ...]) -> None:
        _, ints, floats, mode = self.decode_arrays(rows)
        # the host's positions lag the device's by up to one token (the step in flight may have accepted
        # its draft); the verify pass reads up to p + 1 and the MTP module up to p + 2
        kv_len = self.window(max(d.position for d in rows) + 4)
        model = self.model
        self.spec_rows, self.out, model.cache = self._spec_decode(model.state, model.cache, self.spec_rows, self.out,
                                                                  ints, floats, kv_len=kv_len, mode=mode)

    def prefill(self, rows: tuple[PrefillRow, ...]) -> None:
        a = self.prefill_arrays(rows, extra_end=1)  # the MTP module runs one position later
        model = self.model
        self.spec_rows, self.out, model.cache = self._spec_prefill(
            model.state, model.cache, self.spec_rows, self.out, a["chunk"], a["following"], a["rows"], a["starts"],
            a["last_index"], a["budgets"], a["ints"], a["floats"], kv_len=a["kv_len"])

    @property
    def results(self) -> jax.Array:
        return self.out

    def fetch(self, results: jax.Array) -> list[list[int]]:
        return [[first, second][:count] for first, second, count in np.asarray(results)[:self.rows].tolist()]
