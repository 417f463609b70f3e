"""The package's errors for what the user can fix: a checkpoint that cannot be read or written as it
stands, a model that does not fit the devices.

Each is a `ValueError`: the command-line tools report it as one line (see `dsv3_jax.cli.common`)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it stands; the message names the file or tensor."""


class MemoryPlanError(ValueError):
    """A model, cache and prefill chunk that do not fit the devices; the message says what does."""


class NoMTPLayerError(CheckpointError):
    """load(..., mtp=True) of a checkpoint without a multi-token-prediction layer."""
