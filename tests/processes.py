"""Helpers for the tests that start several jax processes (jax.distributed over gloo on 127.0.0.1)."""
import contextlib
import os
import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_device_env() -> dict[str, str]:
    """This environment with two host devices a process and backend optimisation off (quicker compiles,
    as the test session's own, conftest), and no jax.distributed settings of its own."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0")
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return env


@contextlib.contextmanager
def killed_on_exit(*processes):
    """Within: the processes run; on leaving (by an error too), any of them still running is killed."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
