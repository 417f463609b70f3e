"""`python -m dsv3_jax.serve`: the OpenAI-compatible server (dsv3_jax.cli.serve, installed as `dsv3-serve`)."""
import sys

from .cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
