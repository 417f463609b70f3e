"""scripts/bench_l2_prefetch.py: its touch launch reads the rows it names (interpret mode, against numpy), and as
sm_90 PTX its loads carry the L2 eviction hint it was given and no other."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from script_modules import load_script
from test_ptx_registers import ptx_for_sm90, triton_modules

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
load_script("profile_step")  # imported by the script as sibling modules
load_script("bench_model")
bench = load_script("bench_l2_prefetch")


def test_touch_returns_each_programs_maximum_over_its_rows():
    rows = 3 * bench.ROWS_PER_PROGRAM
    values = np.random.default_rng(0).uniform(-400, 400, (rows + bench.ROWS_PER_PROGRAM, bench.K))
    w = jnp.asarray(values, jnp.float8_e4m3fn)  # one block of rows past the touched ones, which must not count
    w = w.at[rows:].set(jnp.asarray(448.0, jnp.float8_e4m3fn))
    got = jax.jit(lambda w: bench.touch(w, rows, "evict_last"))(w)
    want = np.asarray(w[:rows].astype(jnp.float32)).reshape(3, -1).max(axis=1)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (want < 448).all()


@pytest.mark.parametrize("policy, hint", [("evict_last", "L2::cache_hint"), (None, None)])
def test_touch_loads_carry_the_eviction_hint(policy, hint, tmp_path):
    [ir] = triton_modules(lambda w: bench.touch(w, 64, policy),
                          jax.ShapeDtypeStruct((bench.N, bench.K), jnp.float8_e4m3fn))
    loads = [line.strip() for line in ptx_for_sm90(ir, tmp_path).splitlines() if "ld.global" in line]
    assert loads
    assert all(("L2::cache_hint" in line) == (hint is not None) for line in loads), loads
