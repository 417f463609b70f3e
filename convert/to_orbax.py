"""Run the `to_orbax` checkpoint tool from a checkout, as in the reference: `python convert/to_orbax.py --help`.

The tool lives in dsv3_jax/convert/to_orbax.py (installed as the console script `dsv3-to-orbax`)."""
import sys

from dsv3_jax.convert.to_orbax import cli

if __name__ == "__main__":
    sys.exit(cli())
