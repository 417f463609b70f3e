"""Run the `to_orbax` checkpoint tool from a checkout, as in the reference: `python convert/to_orbax.py --help`.

The tool lives in dsv3_jax/convert/to_orbax.py (installed as the console script `dsv3-to-orbax`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not
from dsv3_jax.convert.to_orbax import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
