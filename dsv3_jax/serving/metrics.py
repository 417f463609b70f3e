"""The server's Prometheus metrics, in a registry of its own (one per server, nothing global)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, scheduler):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("dsv3_requests", "HTTP requests answered, by endpoint and status",
                                ("endpoint", "status"), registry=registry)
        self.prompt_tokens = Counter("dsv3_prompt_tokens", "prompt tokens of admitted requests", registry=registry)
        self.generated_tokens = Counter("dsv3_generated_tokens", "tokens generated and sent", registry=registry)
        self.time_to_first_token = Histogram("dsv3_time_to_first_token_seconds", "request arrival to its first token",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("dsv3_inter_token_latency_seconds", "time between a request's tokens",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        Gauge("dsv3_queue_length", "requests waiting for a cache row",
              registry=registry).set_function(lambda: scheduler.waiting)
        Gauge("dsv3_running_rows", "cache rows held by running requests",
              registry=registry).set_function(lambda: scheduler.running)
        Gauge("dsv3_free_rows", "cache rows free", registry=registry).set_function(lambda: scheduler.free_rows)
        Gauge("dsv3_scheduler_iterations", "scheduler iterations that stepped the model",
              registry=registry).set_function(lambda: scheduler.iterations)
        Gauge("dsv3_scheduler_host_seconds", "median over recent iterations of the scheduler's own time "
              "(outside the wait for the device)", registry=registry).set_function(lambda: scheduler.overhead()[0])
        Gauge("dsv3_scheduler_iteration_seconds", "median over recent iterations of an iteration's wall time",
              registry=registry).set_function(lambda: scheduler.overhead()[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)
