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
from .safetensors_io import CheckpointError, SafetensorsFile, TensorIndex
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
            weight = naming(name[: -len("scale")] + "weight") if name.endswith(".scale") else None
            if weight is not None and weight in index:
                raise CheckpointError(f"fp8 weight {weight!r} has no scale tensor {stored!r} in {index.directory}")
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
        filled.append((path, variable.replace(_place_shards(target.shape, sharding, callback))))
    return nnx.from_flat_state(filled)


def _place_shards(shape, sharding: NamedSharding, read) -> jax.Array:
    """Build a global array shard by shard: read one device's window on the host, copy it to the
    device, drop it, go on. Host memory holds one shard at a time (not the whole parameter, as
    `jax.make_array_from_callback` would), and devices sharing a window share one read."""
    windows: dict[tuple, list] = {}
    for device, window in sharding.addressable_devices_indices_map(shape).items():
        windows.setdefault(tuple((s.start, s.stop, s.step) for s in window), []).append((device, window))
    shards = []
    for group in windows.values():
        host = read(group[0][1])
        placed = [jax.device_put(host, device) for device, _ in group]
        jax.block_until_ready(placed)  # the host copy is released before the next read
        shards += placed
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def find_config(directory: Path) -> Path:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {directory} (pass config= with a reference JSON)")
    return path


# ------------------------------------------------------------------ the reference's per-rank layout
# reference module -> the dimension convert.py cuts it along over ranks (others are copied to every rank,
# routed experts go whole to the rank that owns them)
REFERENCE_SPLIT_DIM = {"embed": 0, "wq": 0, "wq_b": 0, "wkv_b": 0, "wo": 1, "w1": 0, "w2": 1, "w3": 0, "head": 0}
_ROUTED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")
_RANK_FILE = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")


def reference_naming(reference_name: str) -> str:
    """Names in the reference's per-rank files are the reference names themselves."""
    return reference_name


def routed_expert(reference_name: str) -> int | None:
    """The expert index of a routed-expert tensor (`layers.3.ffn.experts.17.w1.weight` -> 17), else None."""
    match = _ROUTED_EXPERT.match(reference_name)
    return int(match.group(1)) if match else None


def split_dim(reference_name: str) -> int | None:
    """The dimension a tensor (weight or its fp8 `scale`) is cut along over ranks; None when not cut."""
    if routed_expert(reference_name) is not None:
        return None
    return REFERENCE_SPLIT_DIM.get(reference_name.split(".")[-2])


def rank_files(directory: Path) -> dict[int, Path]:
    """The per-rank files `model{r}-mp{MP}.safetensors` of a reference-layout directory, by rank (empty if none)."""
    found: dict[int, dict[int, Path]] = {}
    for path in Path(directory).glob("model*-mp*.safetensors"):
        match = _RANK_FILE.match(path.name)
        if match:
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    if not found:
        return {}
    if len(found) > 1:
        raise CheckpointError(f"{directory} mixes per-rank files of several model-parallel sizes {sorted(found)}")
    (world, files), = found.items()
    missing = [r for r in range(world) if r not in files]
    if missing or len(files) != world:
        raise CheckpointError(f"{directory} lacks model{missing[0] if missing else '?'}-mp{world}.safetensors "
                              f"(a reference checkpoint for {world} ranks needs ranks 0..{world - 1})")
    return files


class _RankSplitTensor:
    """A tensor cut into equal pieces along `dim`, one per rank file, read as one global array.

    Indexing with a tuple of unit-step slices reads only the files whose pieces the window overlaps.
    """

    def __init__(self, name: str, files: list[SafetensorsFile], dim: int):
        self.name, self.files, self.dim = name, files, dim
        self.dtype = files[0].dtype(name)
        shape = list(files[0].shape(name))
        self.piece = shape[dim]
        shape[dim] *= len(files)
        self.shape = tuple(shape)
        self.ndim = len(shape)

    def __getitem__(self, window) -> np.ndarray:
        window = tuple(window) if isinstance(window, tuple) else (window,)
        window = window + (slice(None),) * (self.ndim - len(window))
        bounds = []
        for size, item in zip(self.shape, window):
            if not isinstance(item, slice):
                raise TypeError(f"tensor {self.name!r}: only slices can index a rank-split tensor")
            start, stop, step = item.indices(size)
            if step != 1:
                raise TypeError(f"tensor {self.name!r}: rank-split tensors are read with unit-step slices")
            bounds.append((start, max(start, stop)))
        start, stop = bounds[self.dim]
        parts = []
        for rank in range(start // self.piece, -(-stop // self.piece)):
            offset = rank * self.piece
            local = [slice(a, b) for a, b in bounds]
            local[self.dim] = slice(max(start, offset) - offset, min(stop, offset + self.piece) - offset)
            parts.append(np.asarray(self.files[rank].tensor(self.name)[tuple(local)]))
        if not parts:
            return np.zeros([b - a for a, b in bounds], self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self.dim)


class ReferenceLayoutIndex:
    """The reference's per-rank checkpoint (`model{r}-mp{MP}.safetensors`, written by convert/convert.py)
    presented like a `TensorIndex` of global tensors under their reference names.

    A tensor cut along a dimension reads, for a window, only the rank files the window overlaps: a
    model loaded on MP devices reads each device's shard from its own rank's file. Routed experts are
    read from their owner's file; tensors every rank holds a copy of are read from `home_rank`'s file
    (pick the rank of this process's first device so that each host reads its own file).
    """

    def __init__(self, directory: str | Path, n_routed_experts: int, home_rank: int = 0):
        self.directory = Path(directory)
        paths = rank_files(self.directory)
        if not paths:
            raise CheckpointError(f"no model{{rank}}-mp{{MP}}.safetensors files in {self.directory}")
        self.world = len(paths)
        if n_routed_experts % self.world:
            raise CheckpointError(f"{self.world} rank files cannot hold {n_routed_experts} routed experts evenly")
        self.experts_per_rank = n_routed_experts // self.world
        self.home_rank = min(max(home_rank, 0), self.world - 1)
        self.files = [SafetensorsFile(paths[r]) for r in range(self.world)]
        holders: dict[str, list[int]] = {}
        for rank, file in enumerate(self.files):
            for name in file.keys():
                holders.setdefault(name, []).append(rank)
        self._entries: dict[str, tuple[str, int | None]] = {}  # name -> (kind, owner rank or split dim)
        for name, ranks in holders.items():
            expert = routed_expert(name)
            if expert is not None:
                owner = expert // max(self.experts_per_rank, 1)
                if ranks != [owner]:
                    raise CheckpointError(f"routed expert tensor {name!r} should be in {paths[owner].name} only, "
                                          f"found in {', '.join(paths[r].name for r in ranks)}")
                self._entries[name] = ("owned", owner)
                continue
            if len(ranks) != self.world:
                absent = next(r for r in range(self.world) if r not in ranks)
                raise CheckpointError(f"tensor {name!r} is missing from {paths[absent].name}")
            shapes = {(self.files[r].shape(name), self.files[r].dtype(name)) for r in ranks}
            if len(shapes) > 1:
                raise CheckpointError(f"tensor {name!r} has different shapes or dtypes in the rank files")
            dim = split_dim(name)
            self._entries[name] = ("split", dim) if dim is not None and self.world > 1 else ("copied", None)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str):
        kind, where = self._entries[name]
        if kind == "owned":
            return self.files[where].tensor(name)
        if kind == "copied":
            return self.files[self.home_rank].tensor(name)
        return _RankSplitTensor(name, self.files, where)

    def shape(self, name: str) -> tuple[int, ...]:
        kind, where = self._entries[name]
        shape = list(self.files[where if kind == "owned" else 0].shape(name))
        if kind == "split":
            shape[where] *= self.world
        return tuple(shape)

    def dtype(self, name: str) -> np.dtype:
        kind, where = self._entries[name]
        return self.files[where if kind == "owned" else 0].dtype(name)


def home_rank(mesh: Mesh, world: int) -> int:
    """The rank file whose copies of replicated tensors this process reads: the one matching the
    mesh position of its first device (each host reads its own file when the mesh has `world` devices)."""
    devices = list(mesh.devices.flat)
    position = next((i for i, d in enumerate(devices) if d.process_index == jax.process_index()), 0)
    return position * world // len(devices)
