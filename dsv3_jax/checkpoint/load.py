"""Load checkpoints onto a mesh, tensor by tensor, each device reading only its own shard.

What a checkpoint must hold and under which names is `schema.py`'s business; here the tensors
are read: stacked parameters (leading layer, and for routed experts expert, axes) are assembled
from the per-layer tensors, and the reference's per-rank files are presented as one index.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from pallas_kernels import cdiv

from ..config import ModelArgs
from ..errors import CheckpointError
from ..progress import progress_bar
from .safetensors import SafetensorsFile, TensorIndex
from .schema import HF_CONFIG, check_tensors, hf_name, rank_files, reference_names, routed_expert, split_dim, \
    stacked_axes
from ..sharding import Layout, partition_specs


def _read_block(index: TensorIndex, name: str, window: tuple[slice, ...], dtype) -> np.ndarray:
    tensor = index.tensor(name)
    if tensor.dtype.itemsize == 1 and np.dtype(dtype).itemsize != 1:
        raise CheckpointError(f"tensor {name!r} is {tensor.dtype} but the model expects {np.dtype(dtype)} "
                              "(an fp8 checkpoint needs dtype 'fp8' in its config)")
    return np.asarray(tensor[window]).astype(dtype, copy=False)


def load_state(index: TensorIndex, abstract_state: nnx.State, args: ModelArgs, mesh: Mesh, layout: Layout,
               naming: Callable[[str], str] = hf_name, progress: bool | None = None) -> nnx.State:
    """Fill the abstract state from the checkpoint: each device's shard (as `layout` splits the
    parameters over `mesh`) read by its own callback.
    progress: draw a bar of the bytes and tensors read (see `progress_bar`)."""
    check_tensors(index, args, naming, state=abstract_state)
    specs = nnx.to_flat_state(partition_specs(abstract_state, layout))
    spec_of = {tuple(str(p) for p in path): spec for path, spec in specs}
    flat = list(nnx.to_flat_state(abstract_state))
    total = sum(variable.get_value().size * np.dtype(variable.get_value().dtype).itemsize for _, variable in flat)
    bar = progress_bar(total, desc="loading", unit="B", enabled=progress, unit_scale=True, unit_divisor=1024)
    filled = []
    for number, (path, variable) in enumerate(flat, 1):
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
            stack_indices = range(shape[0])[window[0]]
            if axes == 1:
                return np.stack([_read_block(index, naming(names(i)), inner, dtype) for i in stack_indices])
            experts = range(shape[1])[window[1]]
            return np.stack([np.stack([_read_block(index, naming(names(i, e)), inner, dtype) for e in experts])
                             for i in stack_indices])

        sharding = NamedSharding(mesh, spec_of[key])
        filled.append((path, variable.replace(_place_shards(target.shape, sharding, callback))))
        bar.set_postfix_str(f"{number}/{len(flat)} tensors", refresh=False)
        bar.update(target.size * dtype.itemsize)
    bar.close()
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


# How a caller supplies a config the checkpoint lacks, in the terms of both the API and the CLI.
CONFIG_HINT = "pass config= (Python) or --config (command line) with a reference or Hugging Face JSON"


def find_config(directory: Path) -> Path:
    path = Path(directory) / HF_CONFIG
    if not path.is_file():
        raise CheckpointError(f"no config.json in {directory}: {CONFIG_HINT}")
    return path


# ------------------------------------------------------------------ the reference's per-rank layout
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
        for rank in range(start // self.piece, cdiv(stop, self.piece)):
            offset = rank * self.piece
            local = [slice(a, b) for a, b in bounds]
            local[self.dim] = slice(max(start, offset) - offset, min(stop, offset + self.piece) - offset)
            parts.append(np.asarray(self.files[rank].tensor(self.name)[tuple(local)]))
        if not parts:
            return np.zeros([b - a for a, b in bounds], self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self.dim)


class ReferenceLayoutIndex:
    """The reference's per-rank checkpoint (`model{r}-mp{MP}.safetensors`, written by `dsv3-convert`)
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
