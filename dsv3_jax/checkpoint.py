"""Load checkpoints onto a mesh, tensor by tensor, each device reading only its own shard.

Names: every parameter has a reference name (the reference's `model.py` names, e.g.
`layers.3.ffn.experts.17.w1.weight`), and `hf_name` maps it to the Hugging Face hub name
(`model.layers.3.mlp.experts.17.gate_proj.weight`) with one table. Stacked parameters (leading
layer, and for routed experts expert, axes) are assembled from the per-layer tensors.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterator

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from .config import ModelArgs
from .safetensors_io import CheckpointError, TensorIndex
from .sharding import partition_specs

# reference module name -> Hugging Face module name (component by component)
HF_COMPONENTS = {
    "embed": "embed_tokens", "attn": "self_attn", "ffn": "mlp", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
    "wo": "o_proj", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj", "scale": "weight_scale_inv",
    "bias": "e_score_correction_bias",
}
STACKS = ("dense_layers", "moe_layers")


def hf_name(reference_name: str) -> str:
    """`layers.0.attn.wq.weight` -> `model.layers.0.self_attn.q_proj.weight`; `head.weight` -> `lm_head.weight`."""
    if reference_name.startswith("head."):
        return "lm_head." + reference_name[len("head."):]
    return "model." + ".".join(HF_COMPONENTS.get(part, part) for part in reference_name.split("."))


def reference_names(path: tuple[str, ...], args: ModelArgs) -> Callable[..., str] | str:
    """The reference name of a state leaf: a string, or for stacked leaves a function of
    (layer index within the stack[, expert index])."""
    if path[0] not in STACKS:
        return ".".join(path)
    first = 0 if path[0] == "dense_layers" else args.n_dense_layers
    rest = list(path[1:])
    if rest[:2] == ["ffn", "experts"]:
        tail = ".".join(rest[2:])
        return lambda layer, expert: f"layers.{first + layer}.ffn.experts.{expert}.{tail}"
    tail = ".".join(rest)
    return lambda layer: f"layers.{first + layer}.{tail}"


def stacked_axes(path: tuple[str, ...]) -> int:
    """How many leading axes of a leaf index layers (and experts)."""
    if path[0] not in STACKS:
        return 0
    return 2 if path[1:3] == ("ffn", "experts") else 1


def expected_tensors(state: nnx.State, args: ModelArgs) -> Iterator[tuple[tuple, str, tuple[int, ...]]]:
    """(state path, reference name, per-tensor shape) for every tensor the model needs."""
    for path, variable in nnx.to_flat_state(state):
        path = tuple(str(p) for p in path)
        shape = tuple(variable.get_value().shape)
        names = reference_names(path, args)
        axes = stacked_axes(path)
        if axes == 0:
            yield path, names, shape
        elif axes == 1:
            for layer in range(shape[0]):
                yield path, names(layer), shape[1:]
        else:
            for layer in range(shape[0]):
                for expert in range(shape[1]):
                    yield path, names(layer, expert), shape[2:]


_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def check_checkpoint(index: TensorIndex, state: nnx.State, args: ModelArgs, naming: Callable[[str], str]) -> None:
    """Every needed tensor present with its shape; nothing else but MTP layers (ignored for now)."""
    needed = set()
    for _, name, shape in expected_tensors(state, args):
        stored = naming(name)
        needed.add(stored)
        if stored not in index:
            raise CheckpointError(f"missing tensor {stored!r} in {index.directory}")
        if tuple(index.shape(stored)) != tuple(shape):
            raise CheckpointError(f"tensor {stored!r} has shape {tuple(index.shape(stored))}, "
                                  f"the config implies {tuple(shape)}")
    for name in index.names():
        if name in needed:
            continue
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= args.n_layers:
            continue  # multi-token-prediction module
        if name.endswith("rotary_emb.inv_freq"):
            continue
        raise CheckpointError(f"unexpected tensor {name!r} in {index.directory} (not part of this config)")


def _read_block(index: TensorIndex, name: str, window: tuple[slice, ...], dtype) -> np.ndarray:
    tensor = index.tensor(name)
    if tensor.dtype.itemsize == 1 and np.dtype(dtype).itemsize != 1:
        raise CheckpointError(f"tensor {name!r} is {tensor.dtype} but the model expects {np.dtype(dtype)} "
                              "(an fp8 checkpoint needs dtype 'fp8' in its config)")
    if np.dtype(dtype).itemsize == 1 and tensor.dtype != np.dtype(dtype):
        raise CheckpointError(f"tensor {name!r} is {tensor.dtype}, the fp8 model expects {np.dtype(dtype)}")
    return np.asarray(tensor[window]).astype(dtype, copy=False)


def load_state(index: TensorIndex, abstract_state: nnx.State, args: ModelArgs, mesh: Mesh,
               naming: Callable[[str], str] = hf_name) -> nnx.State:
    """Fill the abstract state from the checkpoint: each device's shard read by its own callback."""
    check_checkpoint(index, abstract_state, args, naming)
    spec_of = {tuple(str(p) for p in path): spec for path, spec in nnx.to_flat_state(partition_specs(abstract_state))}
    filled = []
    for path, variable in nnx.to_flat_state(abstract_state):
        key = tuple(str(p) for p in path)
        target = variable.get_value()
        names = reference_names(key, args)
        axes = stacked_axes(key)
        dtype = np.dtype(target.dtype)

        def callback(window, names=names, axes=axes, dtype=dtype, shape=target.shape):
            window = tuple(window) + (slice(None),) * (len(shape) - len(tuple(window)))
            inner = window[axes:]
            if axes == 0:
                return _read_block(index, naming(names), inner, dtype)
            layers = range(shape[0])[window[0]]
            if axes == 1:
                return np.stack([_read_block(index, naming(names(l)), inner, dtype) for l in layers])
            experts = range(shape[1])[window[1]]
            return np.stack([np.stack([_read_block(index, naming(names(l, e)), inner, dtype) for e in experts])
                             for l in layers])

        sharding = NamedSharding(mesh, spec_of[key])
        array = jax.make_array_from_callback(target.shape, sharding, callback)
        filled.append((path, variable.replace(array)))
    return nnx.from_flat_state(filled)


def find_config(directory: Path) -> Path:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {directory} (pass config= with a reference JSON)")
    return path
