"""Continuous batching: a thread that owns the cache's rows and steps every running request together.

Each iteration (1) takes the new requests and drops the cancelled ones (their rows are freed at
once), (2) admits waiting requests into free rows, lowest first, (3) runs a `StepPlan`: one decode
step for every row that is decoding, then the next prompt chunk of up to `Engine.prefill_rows` rows
that are prefilling, and (4) reads the tokens of the *previous* iteration's steps (the one host
sync), while the device runs this iteration's. A row whose request ended at eos thus runs one extra
step whose tokens are dropped; a request never gets more than its `max_tokens` (a speculative step
emits 1 or 2 tokens, capped on the device by the row's budget). Tokens go to the requests'
`deliver` callbacks, batched once per iteration (`on_events`). With a `PlanChannel` (several
processes), each plan is shared with the other processes before it runs, an IDLE command goes out
every wait of an idle server, and STOP when the scheduler stops.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import statistics
import threading
import time
import traceback
from typing import Callable

from .engine import Engine
from .plan import IDLE, STOP as STOP_COMMAND, DecodeRow, PlanChannel, PrefillRow, RowParams, StepPlan

STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"


class QueueFull(Exception):
    """The waiting queue is at its limit."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation: the prompt's token ids, its budget and sampling parameters, and its progress."""

    prompt: list[int]
    max_tokens: int
    params: RowParams = RowParams()
    tag: object = None  # the caller's handle, passed back with every event
    ignore_eos: bool = False  # run to max_tokens (benchmarks)
    row: int | None = None
    prefilled: int = 0  # prompt tokens dispatched
    dispatched: int = 0  # generated tokens the dispatched steps are sure to emit (speculative ones: 1 or 2 each)
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


Event = tuple[Request, list[int], "str | None"]  # (request, new tokens, finish reason or None)


class Scheduler:
    """Runs `engine` in its own thread; `submit` and `cancel` may be called from any thread.

    on_events(list[Event]) is called from the scheduler thread once per iteration that produced
    something; it must only hand the events over (e.g. loop.call_soon_threadsafe)."""

    def __init__(self, engine: Engine, eos_id: int | None, on_events: Callable[[list[Event]], None], *,
                 max_queue: int = 256, channel: PlanChannel | None = None):
        self.engine, self.eos_id, self.on_events, self.max_queue = engine, eos_id, on_events, max_queue
        self.channel = channel  # several processes: process 0's plans go to the others (`plan.follow`)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: collections.deque[Request] = collections.deque()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._free = set(range(engine.rows))
        self._pending = None  # (device tokens, requests whose token they hold) of the last iteration
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="dsv3-scheduler", daemon=True)
        self.error: str | None = None
        self.iterations = 0
        # per stepping iteration, the recent ones: (scheduler time outside the wait for the device, wall time)
        self.timings: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)

    # ---------------------------------------------------------------- any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join()

    def submit(self, request: Request) -> None:
        """Queue a request; QueueFull when `max_queue` requests are already waiting for a row (the
        ones that free rows will take do not count)."""
        if self.error is not None:
            raise RuntimeError(self.error)
        with self._lock:
            if len(self._inbox) + len(self._waiting) >= self.max_queue + len(self._free):
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            self._inbox.append(request)
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """Stop a request (client gone, stop string seen); its row is freed in the next iteration."""
        request.cancelled = True
        self._wake.set()

    def overhead(self) -> tuple[float, float]:
        """Medians over the recent stepping iterations: (host seconds, iteration seconds). The host
        time is the scheduler's own work (the first iteration of a new step shape includes its compile)."""
        if not self.timings:
            return 0.0, 0.0
        host, total = zip(*list(self.timings))
        return statistics.median(host), statistics.median(total)

    @property
    def waiting(self) -> int:
        return len(self._inbox) + len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def free_rows(self) -> int:
        return len(self._free)

    # ---------------------------------------------------------------- scheduler thread
    def _loop(self) -> None:
        try:
            while not self._stopped:
                if not self._iterate():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    if self.channel is not None:
                        self.channel.share(command=IDLE)  # the others wait in a collective: keep it short
        except Exception:  # noqa: BLE001 -- the device state is gone: fail every request, say why
            self.error = "the model step failed: " + traceback.format_exc().strip().splitlines()[-1]
            traceback.print_exc()
            self._fail_all()
        if self.channel is not None:
            self.channel.share(command=STOP_COMMAND)  # the other processes end their loops

    def _iterate(self) -> bool:
        """One iteration; False when there was nothing to do."""
        started = time.perf_counter()
        events: list[Event] = []
        self._take_inbox()
        self._drop_cancelled(events)
        self._admit()
        stepped = self._dispatch()
        results = self.engine.results if stepped else None
        host = time.perf_counter() - started
        if self._pending is not None:
            self._collect(*self._pending, events)  # waits for the previous iteration's steps
        self._pending = (results, stepped) if stepped else None
        waited = time.perf_counter()
        if events:
            self.on_events(events)
        if stepped is not None:
            self.iterations += 1
            self.timings.append((host + time.perf_counter() - waited, time.perf_counter() - started))
        return bool(stepped is not None or events or self._pending)

    def _take_inbox(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()

    def _drop_cancelled(self, events: list[Event]) -> None:
        for request in [r for r in itertools.chain(self._waiting, self._running) if r.cancelled]:
            self._finish(request, CANCELLED)
            events.append((request, [], CANCELLED))

    def _admit(self) -> None:
        while self._waiting and self._free:
            request = self._waiting.popleft()
            request.row = min(self._free)
            self._free.remove(request.row)
            self._running.append(request)

    def _plan(self) -> tuple[StepPlan, list[Request], list[Request]]:
        """This iteration's plan: one decode step for every decoding row that may still emit a token
        (`dispatched` counts the tokens its steps are sure to emit), the next chunk of the first
        `prefill_rows` prefilling ones. Returns (plan, decoding requests, prefilling requests)."""
        decoding = [r for r in self._running if r.decoding and r.dispatched < r.max_tokens]
        prefilling = [r for r in self._running if not r.decoding][:self.engine.prefill_rows]
        chunk = self.engine.chunk
        # the row feeds its newest token, generated token number `dispatched`, at its position
        decode = tuple(DecodeRow(r.row, len(r.prompt) + r.dispatched - 1, r.params) for r in decoding)
        prefill = []
        for r in prefilling:
            end = min(len(r.prompt), r.prefilled + chunk)
            prefill.append(PrefillRow(r.row, r.prefilled, tuple(r.prompt[r.prefilled:end]),
                                      r.prompt[end] if end < len(r.prompt) else 0, end == len(r.prompt),
                                      r.max_tokens, r.params))
        return StepPlan(decode, tuple(prefill)), decoding, prefilling

    def _dispatch(self) -> list[Request] | None:
        """Run this iteration's plan; the requests whose tokens its results hold (None: nothing ran)."""
        plan, decoding, prefilling = self._plan()
        if not plan.decode and not plan.prefill:
            return None
        if self.channel is not None:
            _, plan = self.channel.share(plan)  # every process runs the plan as it travelled
        self.engine.run(plan)
        for request in decoding:
            request.dispatched += 1
        done = []
        for request, chunk in zip(prefilling, plan.prefill):
            request.prefilled = chunk.start + len(chunk.tokens)
            if chunk.finishing:
                request.dispatched = 1
                done.append(request)
        return decoding + done

    def _collect(self, results, requests: list[Request], events: list[Event]) -> None:
        emitted = self.engine.fetch(results)
        for request in requests:
            if request.finish_reason is not None:
                continue
            tokens = emitted[request.row]
            request.dispatched += len(tokens) - 1  # a speculative step may emit 2 tokens, or none past the budget
            kept, reason = [], None
            for token in tokens:
                if token == self.eos_id and not request.ignore_eos:
                    reason = STOP
                    break
                kept.append(token)
                if len(request.tokens) + len(kept) >= request.max_tokens:
                    reason = LENGTH
                    break
            request.tokens.extend(kept)
            if reason:
                self._finish(request, reason)
            if kept or reason:
                events.append((request, kept, reason))

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        if request.row is not None and request in self._running:
            self._running.remove(request)
            self._free.add(request.row)
        elif request in self._waiting:
            self._waiting.remove(request)

    def _fail_all(self) -> None:
        self._take_inbox()
        failed = list(itertools.chain(self._waiting, self._running))
        for request in failed:
            self._finish(request, ERROR)
        if failed:
            self.on_events([(r, [], ERROR) for r in failed])
