"""Continuous batching: a thread that owns the cache's rows and steps every running request together.

Each iteration (1) takes the new requests and drops the cancelled ones (their rows are freed at
once), (2) admits waiting requests into free rows, lowest first, (3) dispatches one decode step for
every row that is decoding, then the next prompt chunk of up to `Engine.prefill_rows` rows that are
prefilling, and (4) reads the tokens of the *previous* iteration's steps (the one host sync), while
the device runs this iteration's. A row whose request ended at eos thus runs one extra step whose
token is dropped; a request is never stepped past its `max_tokens`. Tokens go to the requests'
`deliver` callbacks, batched once per iteration (`on_events`).
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

from .engine import Engine, RowParams

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
    dispatched: int = 0  # generated tokens whose step has been dispatched
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
                 max_queue: int = 256):
        self.engine, self.eos_id, self.on_events, self.max_queue = engine, eos_id, on_events, max_queue
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
        except Exception:  # noqa: BLE001 -- the device state is gone: fail every request, say why
            self.error = "the model step failed: " + traceback.format_exc().strip().splitlines()[-1]
            traceback.print_exc()
            self._fail_all()

    def _iterate(self) -> bool:
        """One iteration; False when there was nothing to do."""
        started = time.perf_counter()
        events: list[Event] = []
        self._take_inbox()
        self._drop_cancelled(events)
        self._admit()
        stepped = self._dispatch_decode() + self._dispatch_prefill()
        tokens = self.engine.last_tokens if stepped else None
        host = time.perf_counter() - started
        if self._pending is not None:
            self._collect(*self._pending, events)  # waits for the previous iteration's steps
        self._pending = (tokens, stepped) if stepped else None
        waited = time.perf_counter()
        if events:
            self.on_events(events)
        if stepped:
            self.iterations += 1
            self.timings.append((host + time.perf_counter() - waited, time.perf_counter() - started))
        return bool(stepped or events or self._pending)

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

    def _dispatch_decode(self) -> list[Request]:
        rows = [r for r in self._running if r.decoding and r.dispatched < r.max_tokens]
        if rows:
            # the row feeds its newest token, generated token number `dispatched`, at its position
            self.engine.decode([r.row for r in rows], [len(r.prompt) + r.dispatched - 1 for r in rows],
                               [r.params for r in rows])
            for request in rows:
                request.dispatched += 1
        return rows

    def _dispatch_prefill(self) -> list[Request]:
        rows = [r for r in self._running if not r.decoding][:self.engine.prefill_rows]
        if not rows:
            return []
        finished = self.engine.prefill([r.row for r in rows], [r.prompt for r in rows], [r.prefilled for r in rows],
                                       [r.params for r in rows])
        for request in rows:
            request.prefilled = min(len(request.prompt), request.prefilled + self.engine.chunk)
        done = [r for r, d in zip(rows, finished) if d]
        for request in done:
            request.dispatched = 1
        return done

    def _collect(self, tokens, requests: list[Request], events: list[Event]) -> None:
        values = self.engine.fetch(tokens)
        for request in requests:
            if request.finish_reason is not None:
                continue
            token = int(values[request.row])
            if token == self.eos_id and not request.ignore_eos:
                self._finish(request, STOP)
                events.append((request, [], STOP))
                continue
            request.tokens.append(token)
            reason = LENGTH if len(request.tokens) >= request.max_tokens else None
            if reason:
                self._finish(request, reason)
            events.append((request, [token], reason))

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
