"""XLA:CPU's backend optimisation for the few test programs whose run, not their compile, is the cost.

The suite compiles with the optimisation off (tests/conftest.py), which halves XLA:CPU's compile times;
programs that then run thousands of tokens (long prefills, whole evaluation windows) run several times
slower for it. These helpers compile such a program with the optimisation on: the same program, with
the same arguments, donation and results."""
import jax

OPTIMISED = {"xla_backend_optimization_level": 2}


def optimised(jitted, **jit_options):
    """`jitted` (a jitted function) compiled with the optimisation on; `jit_options`: its own static
    arguments and donation, which the wrapper keeps."""
    return jax.jit(jitted, compiler_options=OPTIMISED, **jit_options)
