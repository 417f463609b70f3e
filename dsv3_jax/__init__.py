"""dsv3-jax: DeepSeek-V3 inference in JAX (Flax NNX modules, shard_map TP+EP, Pallas fp8 kernels)."""
from .api import Model, build, load
from .config import ConfigError, ModelArgs, PositionLimitWarning
from .decode import generate
from .decode.generate import MaxSeqLenWarning
from .decode.step import make_step
from .errors import CheckpointError
from .model.cache import cache_window
from .options import RunOptions

__all__ = ["CheckpointError", "ConfigError", "MaxSeqLenWarning", "Model", "ModelArgs", "PositionLimitWarning", "RunOptions", "build",
           "cache_window", "generate", "load", "make_step"]
