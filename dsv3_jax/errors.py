"""The package's error for a checkpoint that cannot be read or written as it stands.

It is a `ValueError`: the command-line tools report it as one line (see `dsv3_jax.cli.common`)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it stands; the message names the file or tensor."""
