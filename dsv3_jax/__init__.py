"""dsv3-jax: DeepSeek-V3 inference in JAX (Flax NNX modules, shard_map TP+EP, Pallas fp8 kernels)."""
from . import generate
from .api import Model, build, load, make_step
from .cache import cache_window
from .config import ConfigError, ModelArgs
from .generate import MaxSeqLenWarning
from .options import RunOptions
from .safetensors_io import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "MaxSeqLenWarning", "Model", "ModelArgs", "RunOptions", "build",
           "cache_window", "generate", "load", "make_step"]
