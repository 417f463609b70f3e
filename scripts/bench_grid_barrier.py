"""A launch boundary against a barrier across the programs of one persistent launch, per phase, on a Hopper GPU.

    PYTHONPATH=. python3 scripts/bench_grid_barrier.py --programs 16,132 --phases 64,512 --out x.json

A decode step at batch 1 is a chain of a few hundred dependent launches of a few µs each, most of it fixed cost a
launch; the launches that must wait for a whole row of the one before (a sum over heads, a norm, the experts'
add) could instead be phases of one persistent launch a layer, separated by a barrier across its programs. This
times both on the same chain of phases, each phase a step every program of the next one depends on: every
program reads the whole int32 vector the previous phase wrote and writes its own element, `(sum % 2**20) + i`.

- "launches": one Pallas launch a phase (each triggers the next launch early, as the model's decode kernels do).
- "barrier": one launch of every phase, the programs meeting at a barrier after each: arrive on a global
  counter with an atomic add (release: the program's stores first), then poll it with atomic reads (acquire)
  until every program has arrived. It needs every program resident at once, so `programs` stays within one
  wave; a poll limit ends a barrier that never opens, and the run then says so instead of hanging.

Each form runs under a jit with and without XLA's command buffers (the CUDA graphs `generate()` decodes under);
the time a phase is the slope between two phase counts of the time a call (many calls enqueued back to back),
which cancels the call's own overhead. Every result is checked against the chain computed on the host.
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv3_jax.decode.step import COMMAND_BUFFERS
from pallas_kernels._common import launch_dependents, use_interpret

MOD = 1 << 20
POLL_LIMIT = 1 << 20  # polls of the counter before a waiting program stops waiting (a barrier that never opens)
PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=1)


def chain_ref(v0: np.ndarray, phases: int) -> np.ndarray:
    """The host's chain: `phases` times v <- (sum(v) % MOD) + arange."""
    v = np.asarray(v0, np.int64)
    for _ in range(phases):
        v = v.sum() % MOD + np.arange(v.size)
    return v.astype(np.int32)


def _phase(src, dst, row: tuple, i, programs: int) -> None:
    """One phase in program i: the whole vector at `row` of `src` (() for a vector, (p,) for a table's row p),
    its own element of the next at the following row of `dst` (the same row of a vector). Volatile reads: an L1
    line from before a barrier could hold another program's old value (Pallas' "cg" modifier does not lower)."""
    padded = 1 << (programs - 1).bit_length()
    ok = jnp.arange(padded) < programs
    total = jnp.sum(plgpu.load(src.at[(*row, pl.ds(0, padded))], mask=ok, other=0, volatile=True))
    next_row = tuple(r + 1 for r in row)
    plgpu.store(dst.at[(*next_row, pl.ds(i, 1))], jnp.full((1,), total % MOD + i, jnp.int32))


def one_phase(v: jax.Array) -> jax.Array:
    """One launch of one phase over `v` (programs,) int32."""
    programs = v.shape[0]

    def kernel(v_ref, o_ref):
        _phase(v_ref, o_ref, (), launch_dependents(pl.program_id(0)), programs)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(v.shape, jnp.int32), grid=(programs,),
                          compiler_params=PARAMS, interpret=use_interpret(), name="grid_phase")(v)


def chain_of_launches(v0: jax.Array, phases: int) -> jax.Array:
    for _ in range(phases):
        v0 = one_phase(v0)
    return v0


def grid_barrier(counter_ref, target) -> jax.Array:
    """Wait until the counter reaches `target` after this program's arrival; returns the polls it took (at most
    POLL_LIMIT: then the barrier never opened). Triton runs a scalar atomic once a program."""
    plgpu.debug_barrier()  # every thread's stores issued before the arrival releases them
    plgpu.atomic_add(counter_ref, 0, 1)

    def waiting(state):
        seen, polls = state
        return (seen < target) & (polls < POLL_LIMIT)

    def poll(state):
        return plgpu.atomic_add(counter_ref, 0, 0), state[1] + 1

    _, polls = jax.lax.while_loop(waiting, poll, (jnp.int32(0), jnp.int32(0)))
    plgpu.debug_barrier()  # no thread reads the next phase's inputs before the poll saw them all written
    return polls


def persistent(v0: jax.Array, phases: int) -> tuple[jax.Array, jax.Array]:
    """Every phase in one launch, a barrier after each: (the last phase's vector, each program's most polls)."""
    if use_interpret():
        raise RuntimeError("bench_grid_barrier: the barrier needs every program resident on a GPU at once; interpret "
                           "mode runs the programs one after another, so the first barrier would never open")
    programs = v0.shape[0]
    table = jnp.zeros((phases + 1, programs), jnp.int32).at[0].set(v0)

    def kernel(table_in, counter_in, table_ref, counter_ref, polls_ref):
        del table_in, counter_in  # aliased to table_ref, counter_ref
        i = pl.program_id(0)

        def phase(p, most):
            _phase(table_ref, table_ref, (p,), i, programs)
            return jnp.maximum(most, grid_barrier(counter_ref, (p + 1) * programs))

        most = jax.lax.fori_loop(0, phases, phase, jnp.int32(0))
        plgpu.store(polls_ref.at[pl.ds(i, 1)], jnp.full((1,), most, jnp.int32))

    table, _, polls = pl.pallas_call(
        kernel, grid=(programs,), compiler_params=PARAMS, name="grid_persistent",
        out_shape=(jax.ShapeDtypeStruct(table.shape, jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
                   jax.ShapeDtypeStruct((programs,), jnp.int32)),
        input_output_aliases={0: 0, 1: 1},
    )(table, jnp.zeros((1,), jnp.int32))
    return table[phases], polls


def call_us(fn, v0, repeats: int) -> float:
    """µs a call of fn(v0), compiled and warm: `repeats` calls enqueued back to back, then one wait, so that
    the GPU's time is what shows once it exceeds the host's (and the clocks stay up between calls)."""
    jax.block_until_ready(fn(v0))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(v0)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats * 1e6


def measure(form: str, programs: int, phases: tuple[int, int], graphs: bool, repeats: int) -> dict:
    """µs a phase of `form` (the slope between the two phase counts), each count's result checked."""
    v0 = jnp.asarray(np.random.default_rng(programs).integers(0, MOD, programs), jnp.int32)
    options = dict(compiler_options=COMMAND_BUFFERS) if graphs else {}
    times, most_polls = [], 0
    for n in phases:
        fn = jax.jit(functools.partial(chain_of_launches if form == "launches" else persistent, phases=n), **options)
        result = fn(v0)
        if form == "barrier":
            result, polls = result
            most_polls = max(most_polls, int(jnp.max(polls)))
            if most_polls >= POLL_LIMIT:
                raise RuntimeError(f"{programs} programs, {n} phases: a barrier never opened (poll limit reached)")
        if not np.array_equal(np.asarray(result), chain_ref(np.asarray(v0), n)):
            raise RuntimeError(f"{form}, {programs} programs, {n} phases: the result differs from the host's chain")
        times.append(call_us(fn, v0, repeats))
    slope = (times[1] - times[0]) / (phases[1] - phases[0])
    return dict(form=form, programs=programs, graphs=graphs, phases=list(phases), call_us=times, us_per_phase=slope,
                most_polls=most_polls)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default="16,132", help="programs a launch (the barrier: at most one wave)")
    p.add_argument("--phases", default="64,512", help="the two phase counts whose times give the slope")
    p.add_argument("--repeats", type=int, default=50, help="calls per setting, enqueued back to back")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def main() -> None:
    o = parse_args()
    if use_interpret():
        raise SystemExit("bench_grid_barrier: needs a GPU (the barrier's programs must run at once, and interpret "
                         "mode times nothing a GPU does)")
    phases = tuple(int(n) for n in o.phases.split(","))
    if len(phases) != 2 or not 0 < phases[0] < phases[1]:
        raise SystemExit(f"bench_grid_barrier: --phases {o.phases!r}: expected two counts, the first smaller")
    rows = []
    for programs in (int(n) for n in o.programs.split(",")):
        for graphs in (False, True):
            for form in ("launches", "barrier"):
                row = measure(form, programs, phases, graphs, o.repeats)
                rows.append(row)
                print(f"{form:8s} programs={programs:<4d} graphs={str(graphs):5s} {row['us_per_phase']:7.2f} us a phase "
                      f"(calls {row['call_us'][0]:.1f} / {row['call_us'][1]:.1f} us)", flush=True)
    if o.out:
        with open(o.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
