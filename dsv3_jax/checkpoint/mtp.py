"""The multi-token-prediction module in a checkpoint: its names, its Hugging Face tensors, and a reader.

The checkpoint stores the module at layer index `num_hidden_layers` (`model.layers.{L}.enorm.weight`,
`hnorm`, `eh_proj`, `shared_head.norm`, the block under the usual names, and copies of the
embedding and head as `embed_tokens` and `shared_head.head`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelArgs
from ..errors import CheckpointError
from ..model.mtp import MTP
from .safetensors import TensorIndex
from .schema import hf_name


def mtp_reference_names(state: nnx.State, layer: int) -> Iterator[tuple[tuple, str | None, int]]:
    """(state path, reference-style name or a per-expert pattern with '{e}', number of experts or 0)."""
    for path, variable in nnx.to_flat_state(state):
        path = tuple(str(p) for p in path)
        parts = list(path[1:]) if path[0] == "block" else list(path)
        if parts[:2] == ["ffn", "experts"]:
            yield path, f"layers.{layer}.ffn.experts.{{e}}." + ".".join(parts[2:]), variable.get_value().shape[0]
        else:
            yield path, f"layers.{layer}." + ".".join(parts), 0


def mtp_hf_tensors(state: nnx.State, args: ModelArgs, embed: np.ndarray | None = None,
                   head: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The MTP module's tensors under Hugging Face names at layer `args.n_layers` (numpy, as stored in
    `state`); with `embed`/`head`, also their copies `embed_tokens` and `shared_head.head`."""
    layer = args.n_layers
    tensors = {}
    for path, name, experts in mtp_reference_names(state, layer):
        value = np.asarray(_leaf(state, path))
        if experts:
            for e in range(experts):
                tensors[hf_name(name.format(e=e))] = value[e]
        else:
            tensors[hf_name(name)] = value
    if embed is not None:
        tensors[f"model.layers.{layer}.embed_tokens.weight"] = np.asarray(embed)
    if head is not None:
        tensors[f"model.layers.{layer}.shared_head.head.weight"] = np.asarray(head)
    return tensors


def _leaf(state: nnx.State, path: tuple):
    node = state
    for key in path:
        node = node[int(key) if key.isdigit() and not isinstance(node, dict) else key]
    return node.get_value() if isinstance(node, nnx.Variable) else node


def load_mtp(directory: str | Path, args: ModelArgs, *, param_dtype=jnp.bfloat16) -> MTP:
    """The MTP module of a Hugging Face checkpoint (layer `num_hidden_layers`), on the default device.

    Tensors are cast to the module's dtypes (fp8 weights need `args.dtype == "fp8"`)."""
    if args.n_mtp_layers < 1:
        raise CheckpointError(f"the config of {directory} has no MTP layer (num_nextn_predict_layers = 0)")
    index = TensorIndex(directory)
    module = nnx.eval_shape(lambda: MTP(args, param_dtype=param_dtype))
    graphdef, state = nnx.split(module)
    filled = []
    for path, name, experts in mtp_reference_names(state, args.n_layers):
        target = _leaf(state, path)
        names = [hf_name(name.format(e=e)) for e in range(experts)] if experts else [hf_name(name)]
        for stored in names:
            if stored not in index:
                raise CheckpointError(f"missing MTP tensor {stored!r} in {directory}")
        arrays = [np.asarray(index.tensor(n)).astype(np.dtype(target.dtype)) for n in names]
        value = np.stack(arrays) if experts else arrays[0]
        if value.shape != tuple(target.shape):
            raise CheckpointError(f"MTP tensor {names[0]!r} has shape {value.shape[1 if experts else 0:]}, "
                                  f"the config implies {tuple(target.shape)[1 if experts else 0:]}")
        filled.append((path, jnp.asarray(value)))
    flat = dict(nnx.to_flat_state(state))
    new = nnx.from_flat_state([(p, flat[_key(flat, p)].replace(v)) for p, v in filled])
    return nnx.merge(graphdef, new)


def _key(flat: dict, path: tuple):
    for key in flat:
        if tuple(str(k) for k in key) == path:
            return key
    raise KeyError(path)
