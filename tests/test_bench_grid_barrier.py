"""scripts/bench_grid_barrier.py: its chain of launches against the host's chain (interpret mode), its barrier as
sm_90 PTX (one arrival a program, polls and reads that bypass L1), and on a GPU the persistent launch against the
host's chain."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from script_modules import load_script
from test_ptx_registers import ptx_for_sm90, triton_modules

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
bench = load_script("bench_grid_barrier")


def start_vector(programs: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(programs).integers(0, bench.MOD, programs), jnp.int32)


def test_host_chain_by_hand():
    assert bench.chain_ref(np.array([3, 5]), 1).tolist() == [8, 9]
    assert bench.chain_ref(np.array([3, 5]), 2).tolist() == [17, 18]
    assert bench.chain_ref(np.array([bench.MOD - 1, 2]), 1).tolist() == [1, 2]  # the sum wraps at MOD


@pytest.mark.parametrize("programs", [5, 16])
def test_chain_of_launches_matches_the_host_chain(programs):
    v0 = start_vector(programs)
    got = jax.jit(lambda v: bench.chain_of_launches(v, 3))(v0)
    np.testing.assert_array_equal(np.asarray(got), bench.chain_ref(np.asarray(v0), 3))


def test_persistent_launch_refuses_interpret_mode():
    if not bench.use_interpret():
        pytest.skip("a GPU: the launch runs (test_persistent_launch_matches_the_host_chain)")
    with pytest.raises(RuntimeError, match="interpret mode runs the programs one after another"):
        bench.persistent(start_vector(4), 2)


def test_barrier_arrives_once_a_program_and_reads_past_l1(tmp_path):
    phases = 3
    [ir] = triton_modules(lambda v: bench.persistent(v, phases), jax.ShapeDtypeStruct((132,), jnp.int32))
    ptx = ptx_for_sm90(ir, tmp_path)
    code = [line.strip() for line in ptx.splitlines()
            if line.strip() and not line.strip().startswith(("//", ".loc", "$L"))]
    at = [n for n, line in enumerate(code) if "atom.global" in line]
    # per phase one arrival and one poll site, each on one thread (a predicate), acquire-release at GPU scope
    assert len(at) == 2 * phases, [code[n] for n in at]
    assert all(code[n].startswith("@%p") and ".gpu.acq_rel.add" in code[n] for n in at), [code[n] for n in at]
    # the whole program synchronised just before each: every thread's stores issued before the arrival
    assert all(any("bar.sync" in line for line in code[n - 4:n]) for n in at), [code[n - 4:n + 1] for n in at]
    assert "ld.volatile.global" in ptx


def test_each_chained_launch_triggers_the_next(tmp_path):
    irs = triton_modules(lambda v: bench.chain_of_launches(v, 2), jax.ShapeDtypeStruct((16,), jnp.int32))
    assert len(irs) == 2
    assert all("griddepcontrol.launch_dependents" in ptx_for_sm90(ir, tmp_path) for ir in irs)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [16, 132])
def test_persistent_launch_matches_the_host_chain(programs):
    v0 = start_vector(programs)
    got, polls = jax.jit(lambda v: bench.persistent(v, 6))(v0)
    np.testing.assert_array_equal(np.asarray(got), bench.chain_ref(np.asarray(v0), 6))
    assert int(jnp.max(polls)) < bench.POLL_LIMIT
