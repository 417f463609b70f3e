"""dsv3-jax: DeepSeek-V3 inference in JAX (Flax NNX modules, shard_map TP+EP, Pallas fp8 kernels)."""
from .api import Model, build, cache_window, load, make_step
from .config import ConfigError, ModelArgs
from .safetensors_io import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "Model", "ModelArgs", "build", "cache_window", "load", "make_step"]
