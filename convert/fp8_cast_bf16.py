"""Run the `fp8_cast_bf16` checkpoint tool from a checkout, as in the reference: `python convert/fp8_cast_bf16.py --help`.

The tool lives in dsv3_jax/convert/fp8_cast_bf16.py (installed as the console script `dsv3-fp8-cast-bf16`)."""
import sys

from dsv3_jax.convert.fp8_cast_bf16 import cli

if __name__ == "__main__":
    sys.exit(cli())
