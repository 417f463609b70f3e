"""Runs that span processes: the `jax.distributed` start-up from flags or environment, the console
that lets process 0 read and print for all, and the check that every process was given the same flags.
Used by the chat CLI and the benchmark scripts."""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from .common import UsageError, one_line


def start_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize when flags or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID ask for it (unset values are left to jax's cluster detection, e.g. SLURM)."""

    def setting(flag, variable):
        if flag is not None:
            return flag
        value = os.environ.get(variable)
        if value is None or variable == "JAX_COORDINATOR_ADDRESS":
            return value
        try:
            return int(value)
        except ValueError:
            raise UsageError(f"{variable}={value!r} is not an integer") from None

    address = setting(args.coordinator_address, "JAX_COORDINATOR_ADDRESS")
    processes = setting(args.num_processes, "JAX_NUM_PROCESSES")
    process_id = setting(args.process_id, "JAX_PROCESS_ID")
    if address is None and processes is None and process_id is None:
        return
    keep_native_output_off_stdout()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(address, processes, process_id)
    except ValueError as err:  # what neither the flags nor a cluster manager jax knows supplied
        missing = [f"{flag} (or {variable})" for flag, variable, value in (
            ("--coordinator-address", "JAX_COORDINATOR_ADDRESS", address),
            ("--num-processes", "JAX_NUM_PROCESSES", processes), ("--process-id", "JAX_PROCESS_ID", process_id))
            if value is None]
        hint = f": give {' and '.join(missing)}" if missing else ""
        raise UsageError(f"cannot start a multi-process run ({one_line(err)}){hint}") from None


def keep_native_output_off_stdout() -> None:
    """Point file descriptor 1 at stderr and keep `sys.stdout` on the real standard output: native
    libraries write there (gloo reports every connection), which would land inside the answers."""
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(io.FileIO(stdout, "w"), encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                                  line_buffering=True)


class Console:
    """Terminal I/O of a run that may span processes: process 0 reads and prints, and every text
    it reads is broadcast so that all processes take the same turn."""

    def __init__(self):

        self.processes = jax.process_count()
        self.leader = jax.process_index() == 0

    def share(self, text: str | None) -> str | None:
        """Process 0's `text` (None for end of input) on every process."""
        if self.processes == 1:
            return text

        data = np.frombuffer(text.encode("utf-8"), np.uint8) if self.leader and text is not None else None
        size = np.array([-1 if data is None else data.size], np.int32) if self.leader else np.zeros(1, np.int32)
        size = int(np.asarray(multihost_utils.broadcast_one_to_all(size))[0])
        if size < 0:
            return None
        # padded to a power of two: the broadcast compiles once per size class, not once per turn
        buffer = np.zeros(max(64, 1 << (size - 1).bit_length()), np.uint8)
        if self.leader:
            buffer[:size] = data
        shared = np.asarray(multihost_utils.broadcast_one_to_all(buffer)).astype(np.uint8)
        return bytes(shared[:size]).decode("utf-8")

    def read_line(self, prompt: str) -> str | None:
        line, undecodable = None, False
        if self.leader:
            try:
                line = input(prompt)
            except EOFError:
                print(flush=True)
            except UnicodeDecodeError:
                undecodable = True
                print(flush=True)
            else:
                # a terminal's surrogate-escaped bytes are no text either, and the tokenizer rejects them
                undecodable = not _is_text(line)
                line = None if undecodable else line
        line = self.share(line)  # the others end their input too rather than wait for a turn
        if undecodable:
            raise UsageError("standard input is not UTF-8 text")
        return line

    def read_all(self) -> str:
        """All of standard input (process 0's, shared), which must be UTF-8 text."""
        text, undecodable = None, False
        if self.leader:
            try:
                text = sys.stdin.read()
            except UnicodeDecodeError:
                undecodable = True
            else:  # surrogate-escaped bytes (a C locale's stdin) are no text either
                undecodable = not _is_text(text)
            text = None if undecodable else text
        text = self.share(text)
        if text is None:
            raise UsageError("standard input is not UTF-8 text")
        return text

    def write(self, text: str) -> None:
        if self.leader:
            sys.stdout.write(text)
            sys.stdout.flush()

    def note(self, text: str) -> None:
        """One line on stderr, beside the conversation or the completions."""
        if self.leader:
            print(text, file=sys.stderr, flush=True)


def _is_text(line: str) -> bool:
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_same_settings(args: argparse.Namespace, console: Console) -> None:
    """Every process must run the same generation (they take each step together): compare a digest
    of the flags across processes, so that a mismatch is one clear error on every process rather
    than a hang at the first step that differs."""
    if console.processes == 1:
        return


    ignored = {"coordinator_address", "num_processes", "process_id"}
    settings = repr(sorted((k, str(v)) for k, v in vars(args).items() if k not in ignored))
    digest = np.frombuffer(hashlib.sha256(settings.encode()).digest()[:8], np.int32).copy()
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(console.processes, -1)
    differing = [i for i in range(console.processes) if not np.array_equal(every[i], every[0])]
    if differing:
        raise UsageError(f"processes {differing} were started with other flags than process 0; "
                        "every process needs the same command line")
