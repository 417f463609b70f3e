"""Row-addressed steps over a `Model`'s cache, for a scheduler that gives each request a cache row.

The device keeps one (rows,) int32 array, `last_tokens`: each row's newest token, not yet in the
cache. Two jitted functions advance it (the cache donated to both, nothing read back):

- `decode`: one token for every row of [0, batch) that is decoding (`active`); the other rows of
  the bucket are parked at the cache's last position, which no request ever reads, and keep
  their token. Compiled once per (batch bucket, attention window, sampling mode).
- `prefill`: the next chunk (up to `chunk` tokens) of the prompts in up to `prefill_rows` rows,
  wherever those rows lie: their cache windows are gathered, run through `Model.step`, and
  scattered back; a row whose prompt ends in the chunk gets its first token sampled into
  `last_tokens`. Compiled once per attention window (it samples with every filter: a few rows'
  sort is nothing beside the chunk's forward pass).

`run` takes one scheduler iteration's `StepPlan` (the decode step, then the prefill chunk). The
host reads `results` (here `last_tokens`) once per scheduler iteration (an earlier array, while the
device computes the next); that is the only transfer back. `speculative.SpeculativeEngine` runs the
same plans with the MTP module's drafts.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec as P

from ..model.cache import cache_window
from .plan import DecodeRow, PlanCodec, PrefillRow, RowParams, StepPlan
from .sampling import FILTER, batch_mode, sample_rows


def _pack(params: list[RowParams], positions, active) -> tuple[np.ndarray, np.ndarray]:
    """(ints (B, 4): position, active, top_k, seed; floats (B, 2): temperature, top_p): two transfers."""
    ints = np.zeros((len(params), 4), np.int64)
    floats = np.zeros((len(params), 2), np.float32)
    for i, p in enumerate(params):
        ints[i, 2:] = p.top_k, p.seed
        floats[i] = p.temperature, p.top_p
    ints[:, 0], ints[:, 1] = positions, active
    return ints.astype(np.int32), floats  # seeds < 2**31 (checked at the API)


def _sample(logits, ints, floats, mode):
    return sample_rows(logits, floats[:, 0], ints[:, 2], floats[:, 1], ints[:, 3].astype(jnp.uint32), ints[:, 0],
                       mode=mode)


def _decode(step, replicated, params, cache, last_tokens, ints, floats, *, kv_len: int, mode: str):
    batch = ints.shape[0]
    active = ints[:, 1] > 0
    tokens = last_tokens[:batch]
    logits, cache = step(params, cache, tokens[:, None], ints[:, 0], jnp.zeros((batch,), jnp.int32), kv_len=kv_len)
    sampled = _sample(logits, ints, floats, mode)
    last_tokens = last_tokens.at[:batch].set(jnp.where(active, sampled, tokens))
    return jax.lax.with_sharding_constraint(last_tokens, replicated), cache


def _prefill(step, replicated, params, cache, last_tokens, chunk, rows, starts, last_index, ints, floats, *, kv_len: int,
             mode: str):
    """rows (P,): cache rows (rows >= the cache's rows are padding: nothing read back or written);
    ints[:, 1] > 0 where the row's prompt ends in this chunk (its first token is sampled)."""
    window = {name: jnp.take(array[:, :, :kv_len], rows, axis=1, mode="fill", fill_value=0)
              for name, array in cache.items()}
    logits, window = step(params, window, chunk, starts, last_index, kv_len=kv_len)
    cache = {name: cache[name].at[:, rows, :kv_len].set(window[name], mode="drop") for name in cache}
    sampled = _sample(logits, ints, floats, mode)
    kept = jnp.take(last_tokens, rows, mode="fill", fill_value=0)
    last_tokens = last_tokens.at[rows].set(jnp.where(ints[:, 1] > 0, sampled, kept), mode="drop")
    return jax.lax.with_sharding_constraint(last_tokens, replicated), cache


class Engine:
    """The row-addressed steps of one `Model` (which must not split the batch over devices).

    buckets: the decode batch sizes (ascending, the last one the model's max_batch_size);
    min_window: the smallest attention window (pass max_seq_len for one decode compile per bucket)."""

    def __init__(self, model, *, chunk: int = 512, prefill_rows: int = 1, buckets: tuple[int, ...] | None = None,
                 min_window: int = 0):
        if model.layout.size("batch") > 1:
            raise ValueError(f"the server needs a layout that does not split the batch, not {model.layout.name!r}")
        self.model, self.rows, self.max_seq_len = model, model.args.max_batch_size, model.args.max_seq_len
        self.chunk, self.prefill_rows, self.min_window = min(chunk, self.max_seq_len), prefill_rows, min_window
        self.buckets = buckets or tuple(sorted({min(self.rows, 1 << i) for i in range(self.rows.bit_length() + 1)}))
        if self.buckets[-1] != self.rows or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"decode buckets {self.buckets} must ascend to max_batch_size={self.rows}")
        # placed as the steps return it, so that the first step's output does not compile a second variant
        self.replicated = replicated = NamedSharding(model.mesh, P())
        self.last_tokens = jax.device_put(np.zeros((self.rows,), np.int32), replicated)
        self._decode = jax.jit(functools.partial(_decode, model.step, replicated), static_argnames=("kv_len", "mode"),
                               donate_argnums=(1,))
        self._prefill = jax.jit(functools.partial(_prefill, model.step, replicated),
                                static_argnames=("kv_len", "mode"), donate_argnums=(1,))

    @property
    def plan_codec(self) -> PlanCodec:
        """How this engine's plans travel between processes."""
        return PlanCodec(self.rows, self.prefill_rows, self.chunk)

    def window(self, end: int) -> int:
        """The attention window of a step whose rows end before position `end`."""
        return cache_window(max(end, self.min_window), self.max_seq_len)

    def bucket(self, rows_needed: int) -> int:
        return next(b for b in self.buckets if b >= rows_needed)

    def run(self, plan: StepPlan) -> None:
        """Dispatch the plan's steps: the decode step first, then the prefill chunk."""
        if plan.decode:
            self.decode(plan.decode)
        if plan.prefill:
            self.prefill(plan.prefill)

    def decode_arrays(self, rows: tuple[DecodeRow, ...]) -> tuple[int, np.ndarray, np.ndarray, str]:
        """(bucket, ints, floats, mode) of a decode step for `rows`: the rows of the bucket that do not
        decode are parked at the cache's last position, which no request reads (prompt + max_tokens <=
        max_seq_len: a request's tokens are fed at positions < max_seq_len - 1; the speculative step's
        draft may sit there, written by the pass that reads it); in bounds for the decode kernel."""
        batch = self.bucket(max(d.row for d in rows) + 1)
        row_positions = np.full(batch, self.max_seq_len - 1, np.int64)
        active = np.zeros(batch, np.int64)
        row_params = [RowParams()] * batch
        for d in rows:
            row_positions[d.row], active[d.row], row_params[d.row] = d.position, 1, d.params
        ints, floats = _pack(row_params, row_positions, active)
        return batch, ints, floats, batch_mode(*zip(*[(d.params.temperature, d.params.top_k, d.params.top_p)
                                                      for d in rows]))

    def decode(self, rows: tuple[DecodeRow, ...]) -> None:
        """Dispatch one decode step for `rows` (each at its position, with its parameters)."""
        _, ints, floats, mode = self.decode_arrays(rows)
        model = self.model
        self.last_tokens, model.cache = self._decode(model.state, model.cache, self.last_tokens, ints, floats,
                                                     kv_len=self.window(max(d.position for d in rows) + 1), mode=mode)

    def prefill_arrays(self, rows: tuple[PrefillRow, ...], extra_end: int = 0) -> dict:
        """The arrays of a prefill step for `rows` (padded to `prefill_rows`), and its window `kv_len`
        (covering the chunks' ends, plus `extra_end` positions)."""
        count, chunk = self.prefill_rows, self.chunk
        tokens = np.zeros((count, chunk), np.int32)
        row_index = np.full(count, self.rows, np.int32)
        row_starts, last_index, following, budgets = (np.zeros(count, np.int32) for _ in range(4))
        finishing = np.zeros(count, np.int64)
        for i, p in enumerate(rows):
            tokens[i, :len(p.tokens)] = p.tokens
            row_index[i], row_starts[i], last_index[i] = p.row, p.start, len(p.tokens) - 1
            following[i], finishing[i], budgets[i] = p.following, p.finishing, p.budget
        kv_len = self.window(max(p.start + len(p.tokens) for p in rows) + extra_end)
        row_starts[len(rows):] = kv_len  # padding rows: every position past the window
        row_params = [p.params for p in rows] + [RowParams()] * (count - len(rows))
        ints, floats = _pack(row_params, row_starts + last_index, finishing)
        return dict(chunk=tokens, rows=row_index, starts=row_starts, last_index=last_index, following=following,
                    budgets=budgets, ints=ints, floats=floats, kv_len=kv_len)

    def prefill(self, rows: tuple[PrefillRow, ...]) -> None:
        """Dispatch the rows' prompt chunks; a row whose prompt ends in its chunk gets its first token."""
        a = self.prefill_arrays(rows)
        model = self.model
        self.last_tokens, model.cache = self._prefill(model.state, model.cache, self.last_tokens, a["chunk"],
                                                      a["rows"], a["starts"], a["last_index"], a["ints"],
                                                      a["floats"], kv_len=a["kv_len"], mode=FILTER)

    @property
    def results(self) -> jax.Array:
        """What the host fetches after this iteration's steps (`fetch`)."""
        return self.last_tokens

    @staticmethod
    def fetch(results: jax.Array) -> list[list[int]]:
        """Per cache row, the tokens its latest step emitted (waits for the steps that made `results`)."""
        return [[token] for token in np.asarray(results).tolist()]
