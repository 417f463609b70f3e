"""`python -m dsv3_jax.chat`: the chat CLI (dsv3_jax.cli.chat, installed as `dsv3-chat`)."""
import sys

from .cli.chat import main

if __name__ == "__main__":
    sys.exit(main())
