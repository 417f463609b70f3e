"""One scheduler iteration's plan: which rows decode, which prompt chunks prefill, with what parameters.

The scheduler makes a `StepPlan` and an engine runs it (`Engine.run`). When the mesh spans several
processes, process 0's scheduler sends every plan to the others (`PlanChannel`), which run it too:
all processes then call the same jitted steps with the same arguments in the same order. A plan
travels as one int32 array of a size fixed by the engine's shape (floats as their bits), broadcast
with `jax.experimental.multihost_utils` as the chat shares its input; that compiles one broadcast.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jax.experimental import multihost_utils

RUN, IDLE, STOP = 0, 1, 2  # what a received plan asks of the other processes
_DECODE_FIELDS, _PREFILL_FIELDS = 6, 10  # ints per decode row / per prefill row (see `PlanCodec`)


@dataclasses.dataclass(frozen=True)
class RowParams:
    """A request's sampling parameters, as the steps take them."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # < 2**31 (checked at the API)


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """A decoding row: the position of its newest token (plain steps; a lower bound for speculative
    ones, whose rows advance on the device) and its request's parameters."""

    row: int
    position: int
    params: RowParams


@dataclasses.dataclass(frozen=True)
class PrefillRow:
    """A prompt chunk for a row: prompt[start:start + len(tokens)], the prompt token after it
    (`following`, 0 past the prompt), whether the prompt ends in it, the request's token budget."""

    row: int
    start: int
    tokens: tuple[int, ...]
    following: int
    finishing: bool
    budget: int
    params: RowParams


@dataclasses.dataclass(frozen=True)
class StepPlan:
    decode: tuple[DecodeRow, ...] = ()
    prefill: tuple[PrefillRow, ...] = ()


def _float_bits(value: float) -> int:
    return int(np.array(value, np.float32).view(np.int32))


def _bits_float(value) -> float:
    return float(np.array(value, np.int32).view(np.float32))


def _params(fields) -> RowParams:
    top_k, seed, temperature, top_p = (int(v) for v in fields)
    return RowParams(_bits_float(temperature), top_k, _bits_float(top_p), seed)


def _param_fields(p: RowParams) -> list[int]:
    return [p.top_k, p.seed, _float_bits(p.temperature), _float_bits(p.top_p)]


@dataclasses.dataclass(frozen=True)
class PlanCodec:
    """A plan as a fixed-size int32 array: [command, decode rows, prefill rows], then `rows` decode
    records (row, position, top_k, seed, temperature bits, top_p bits), then `prefill_rows` prefill
    records (row, start, length, following, finishing, budget, the four parameters), then their tokens."""

    rows: int
    prefill_rows: int
    chunk: int

    @property
    def size(self) -> int:
        return 3 + self.rows * _DECODE_FIELDS + self.prefill_rows * (_PREFILL_FIELDS + self.chunk)

    def encode(self, plan: StepPlan | None, command: int = RUN) -> np.ndarray:
        data = np.zeros(self.size, np.int32)
        if plan is None:
            data[0] = command
            return data
        data[:3] = command, len(plan.decode), len(plan.prefill)
        decode = data[3:3 + self.rows * _DECODE_FIELDS].reshape(self.rows, _DECODE_FIELDS)
        for i, d in enumerate(plan.decode):
            decode[i] = [d.row, d.position, *_param_fields(d.params)]
        prefill = data[3 + self.rows * _DECODE_FIELDS:].reshape(self.prefill_rows, _PREFILL_FIELDS + self.chunk)
        for i, p in enumerate(plan.prefill):
            prefill[i, :_PREFILL_FIELDS] = [p.row, p.start, len(p.tokens), p.following, p.finishing, p.budget,
                                            *_param_fields(p.params)]
            prefill[i, _PREFILL_FIELDS:_PREFILL_FIELDS + len(p.tokens)] = p.tokens
        return data

    def decode(self, data: np.ndarray) -> tuple[int, StepPlan | None]:
        """(command, the plan or None)."""
        command, decoding, prefilling = (int(v) for v in data[:3])
        if command != RUN:
            return command, None
        decode = data[3:3 + self.rows * _DECODE_FIELDS].reshape(self.rows, _DECODE_FIELDS)
        prefill = data[3 + self.rows * _DECODE_FIELDS:].reshape(self.prefill_rows, _PREFILL_FIELDS + self.chunk)
        plan = StepPlan(
            tuple(DecodeRow(int(r[0]), int(r[1]), _params(r[2:6])) for r in decode[:decoding]),
            tuple(PrefillRow(int(r[0]), int(r[1]), tuple(int(t) for t in r[_PREFILL_FIELDS:_PREFILL_FIELDS + r[2]]),
                             int(r[3]), bool(r[4]), int(r[5]), _params(r[6:10])) for r in prefill[:prefilling]))
        return command, plan


class PlanChannel:
    """Process 0's plans on every process. Each `share` is a collective over all processes: process 0
    passes its plan (or a command, IDLE or STOP), the others pass nothing, and all get the plan back
    as it travelled, so that process 0 runs exactly what the others run (its floats as float32)."""

    def __init__(self, codec: PlanCodec, leader: bool):
        self.codec, self.leader = codec, leader

    def share(self, plan: StepPlan | None = None, command: int = RUN) -> tuple[int, StepPlan | None]:
        data = self.codec.encode(plan, command) if self.leader else np.zeros(self.codec.size, np.int32)
        return self.codec.decode(np.asarray(multihost_utils.broadcast_one_to_all(data)))


def follow(engine, channel: PlanChannel) -> None:
    """A process other than 0: run every plan process 0 shares, in order, until it says STOP."""
    while True:
        command, plan = channel.share()
        if command == STOP:
            return
        if command == RUN:
            engine.run(plan)
