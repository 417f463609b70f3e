"""Run the `convert` checkpoint tool from a checkout, as in the reference: `python convert/convert.py --help`.

The tool lives in dsv3_jax/convert/convert.py (installed as the console script `dsv3-convert`)."""
import sys

from dsv3_jax.convert.convert import cli

if __name__ == "__main__":
    sys.exit(cli())
