"""Run the `fp8_cast_bf16` checkpoint tool from a checkout, as in the reference: `python convert/fp8_cast_bf16.py --help`.

The tool lives in dsv3_jax/convert/fp8_cast_bf16.py (installed as the console script `dsv3-fp8-cast-bf16`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not
from dsv3_jax.convert.fp8_cast_bf16 import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
