"""The JAX-native checkpoint: the model state in its stacked layout as an orbax checkpoint.

Layout of a directory written by `dsv3-to-orbax` (dsv3_jax/convert/to_orbax.py):

    config.json         the Hugging Face config (ModelArgs.from_file reads it)
    tokenizer*          the tokenizer files
    state/              orbax (OCDBT + zarr3): {"embed": {"weight"}, "dense_layers": {...},
                        "moe_layers": {...}, "norm": ..., "head": ..., "mtp": {...}}

Every model parameter is stored under its state path with the model's own shape (leading layer
axis, and expert axis for routed experts), in the checkpoint's storage dtype (fp8 weights stay
float8_e4m3fn beside their float32 `scale`). The multi-token-prediction tensors, which the model
does not run, are kept under "mtp", nested by their Hugging Face names without "model."
(`mtp/layers/61/eh_proj/weight`). Restoring reads, on each device,
only the part of each array its shard covers (orbax + TensorStore with target shardings), so a
checkpoint restores onto any device count that divides the model.

Writing never holds a whole stacked parameter: a `StreamedArray` leaf names its shape and a
generator of blocks (one layer, or one layer's expert: one Hugging Face tensor each), and
`StreamedArrayHandler` writes the blocks one after another, committing them in TensorStore
transactions of about the largest block's size. Peak host memory is therefore about twice the
largest tensor (e.g. the embedding) plus TensorStore's fixed working set, whatever the model size.
Each block is one zarr shard, split into read chunks of at most CHUNK_BYTES, so a device restoring
its shard reads little more than its own bytes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ..config import ModelArgs
from ..errors import CheckpointError
from ..sharding import Layout, partition_specs
from .schema import MTP_STATE

STATE_DIR = "state"
CHUNK_BYTES = 4 << 20  # TensorStore read chunk inside each written block: a device reads whole chunks


def is_orbax_checkpoint(directory: str | Path) -> bool:
    """A directory written by `dsv3-to-orbax` (an orbax checkpoint in `state/`)."""
    return (Path(directory) / STATE_DIR / "_CHECKPOINT_METADATA").is_file()


# ------------------------------------------------------------------ writing block by block
@dataclasses.dataclass(frozen=True)
class StreamedArray:
    """An array to save that is never whole in memory: `blocks()` yields (index, block) pairs,
    each block of shape `block_shape`, that together cover `shape`."""

    shape: tuple[int, ...]
    dtype: np.dtype
    block_shape: tuple[int, ...]
    blocks: Callable[[], Iterator[tuple[tuple[slice, ...], np.ndarray]]]


def _streamed_array_handler(flush_bytes: int):
    # orbax and tensorstore take seconds to import: only orbax checkpoints pay for them
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    class StreamedArrayHandler(ocp.type_handlers.NumpyHandler):
        """Saves `StreamedArray` leaves as orbax's numpy arrays (so any orbax reader restores them),
        writing one block at a time, leaf after leaf. Blocks are committed in TensorStore
        transactions of about `flush_bytes` (fewer, larger OCDBT commits than one per block, with
        memory bounded by the batch)."""

        async def serialize(self, values, infos, args=None):
            args = args or [ocp.type_handlers.SaveArgs()] * len(values)
            return [ocp.future.CommitFutureAwaitingContractedSignals(self._write(values, infos, args),
                                                                     name="streamed_array_handler")]

        async def _write(self, values, infos, args):
            if jax.process_index() != 0:
                return
            # orbax's default context caches up to 100 MB of OCDBT nodes and copies on many threads;
            # a stream of block writes needs neither.
            context = ts.Context({"file_io_concurrency": {"limit": 16}, "data_copy_concurrency": {"limit": 1},
                                  "cache_pool#ocdbt": {"total_bytes_limit": 0}})
            transaction, pending = ts.Transaction(), 0
            for value, info, arg in zip(values, infos, args):
                await info.await_path_creation()
                spec = ts_utils.build_array_write_spec(
                    info=info, arg=arg, global_shape=value.shape, local_shape=value.block_shape, dtype=value.dtype,
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint))
                array = await ts.open(ts.Spec(spec.json), create=True, open=True, context=context)
                for index, block in value.blocks():
                    await array.with_transaction(transaction)[index].write(block)
                    pending += block.nbytes
                    del block  # before the generator reads the next one
                    if pending >= flush_bytes:
                        await transaction.commit_async()
                        transaction, pending = ts.Transaction(), 0
            await transaction.commit_async()

    return StreamedArrayHandler()


def save_streamed(directory: str | Path, tree: dict) -> None:
    """Save a nested dict of `StreamedArray` leaves as an orbax checkpoint at `directory`.

    Peak host memory: about twice the largest block (one block being read, plus the write batch,
    which is committed once it reaches the largest block's size).
    """
    import orbax.checkpoint as ocp  # slow to import: see _streamed_array_handler

    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, StreamedArray))
    largest = max(int(np.prod(leaf.block_shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
    registry = ocp.type_handlers.create_type_handler_registry(
        (StreamedArray, _streamed_array_handler(largest)), (jax.Array, ocp.type_handlers.ArrayHandler()))
    save_args = jax.tree.map(lambda leaf: ocp.type_handlers.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree,
                             is_leaf=lambda x: isinstance(x, StreamedArray))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, type_handler_registry=registry)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(Path(directory).absolute(), args=ocp.args.PyTreeSave(tree, save_args=save_args))


# ------------------------------------------------------------------ reading onto a mesh
def stored_arrays(directory: str | Path) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
    """(path -> (shape, dtype)) of every array in the checkpoint, read from its metadata only."""
    import orbax.checkpoint as ocp  # slow to import: see _streamed_array_handler

    state_dir = Path(directory).absolute() / STATE_DIR
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            tree = checkpointer.metadata(state_dir).item_metadata.tree
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"unreadable orbax checkpoint {state_dir}: {err}") from None
    flat = {}
    for keys, meta in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]:
        path = tuple(str(getattr(k, "key", k)) for k in keys)
        flat[path] = (tuple(meta.shape), np.dtype(meta.dtype))
    return flat


def has_array(directory: str | Path, path: tuple[str, ...]) -> bool:
    return tuple(path) in stored_arrays(directory)


def restore_state(directory: str | Path, abstract_state: nnx.State, args: ModelArgs, mesh: Mesh,
                  layout: Layout) -> nnx.State:
    """Restore the model parameters onto `mesh`, split as `layout` says, each device reading only
    its shard of each array.

    The stored arrays must match the config: every parameter present with the model's shape, fp8
    weights stored as fp8; other stored dtypes are cast to the model's. Only "mtp" may hold extra
    arrays (they are not read).
    """
    import orbax.checkpoint as ocp  # slow to import: see _streamed_array_handler

    stored = stored_arrays(directory)
    specs = {tuple(str(p) for p in path): spec
             for path, spec in nnx.to_flat_state(partition_specs(abstract_state, layout))}
    item, restore_args, wanted = {}, {}, []
    for path, variable in nnx.to_flat_state(abstract_state):
        key = tuple(str(p) for p in path)
        target = variable.get_value()
        name = "/".join(key)
        if key not in stored:
            raise CheckpointError(f"orbax checkpoint {directory} lacks parameter {name!r}")
        shape, dtype = stored[key]
        if shape != tuple(target.shape):
            raise CheckpointError(f"parameter {name!r} has shape {shape} in {directory}, the config implies "
                                  f"{tuple(target.shape)}")
        fp8_target = np.dtype(target.dtype).itemsize == 1
        if fp8_target != (dtype.itemsize == 1) or (fp8_target and dtype != np.dtype(target.dtype)):
            raise CheckpointError(f"parameter {name!r} is {dtype} in {directory}, the model expects "
                                  f"{np.dtype(target.dtype)} (the config's dtype decides fp8 or not)")
        sharding = NamedSharding(mesh, specs[key])
        node, args_node = item, restore_args
        for part in key[:-1]:
            node, args_node = node.setdefault(part, {}), args_node.setdefault(part, {})
        node[key[-1]] = 0
        args_node[key[-1]] = ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=sharding, global_shape=shape,
                                                  dtype=None if fp8_target else np.dtype(target.dtype))
        wanted.append((path, variable, key))
    extra = [p for p in stored if p[0] != MTP_STATE and p not in {k for _, _, k in wanted}]
    if extra:
        raise CheckpointError(f"unexpected array {'/'.join(extra[0])!r} in {directory} (not part of this config)")
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(Path(directory).absolute() / STATE_DIR,
                                        args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                                    partial_restore=True))
    filled = []
    for path, variable, key in wanted:
        node = restored
        for part in key:
            node = node[part]
        filled.append((path, variable.replace(node)))
    return nnx.from_flat_state(filled)


class OrbaxMTPIndex:
    """The MTP tensors of an orbax checkpoint (stored under "mtp" by their Hugging Face names, one
    array per tensor) presented like a `TensorIndex`, for `checkpoint.load_state`. The arrays are
    restored to the host on first use (the MTP layer only; the main model never passes through here)."""

    def __init__(self, directory: str | Path, args: ModelArgs):
        self.directory = Path(directory)
        stored = stored_arrays(directory)
        self._keys = {"model." + ".".join(key[1:]): key for key in stored if key[0] == MTP_STATE}
        self._meta = {name: stored[key] for name, key in self._keys.items()}
        self._arrays: dict[str, np.ndarray] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._keys

    def names(self) -> list[str]:
        return list(self._keys)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> np.dtype:
        return self._meta[name][1]

    def tensor(self, name: str) -> np.ndarray:
        if self._arrays is None:
            self._arrays = self._restore()
        return self._arrays[name]

    def _restore(self) -> dict[str, np.ndarray]:
        import orbax.checkpoint as ocp  # slow to import: see _streamed_array_handler

        item, restore_args = {}, {}
        for key in self._keys.values():
            node, args_node = item, restore_args
            for part in key[:-1]:
                node, args_node = node.setdefault(part, {}), args_node.setdefault(part, {})
            node[key[-1]] = 0
            args_node[key[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(self.directory.absolute() / STATE_DIR,
                                            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                                        partial_restore=True))
        arrays = {}
        for name, key in self._keys.items():
            node = restored
            for part in key:
                node = node[part]
            arrays[name] = np.asarray(node)
        return arrays
