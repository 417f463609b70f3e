"""Checkpoints: the tensor names of every format (schema), safetensors and Orbax readers and writers,
and the loader that fills a sharded model from either."""
