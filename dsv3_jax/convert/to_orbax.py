"""Convert a Hugging Face DeepSeek-V2/V3 checkpoint into an orbax checkpoint of the model state.

    dsv3-to-orbax --hf-ckpt-path HF_DIR --save-path OUT

OUT receives `state/` (orbax: every parameter in the stacked layout the model uses, fp8 weights
kept fp8 with their float32 scales, the multi-token-prediction tensors under "mtp"), the Hugging
Face `config.json` and the tokenizer files; see dsv3_jax/checkpoint/orbax.py. Restore it on any device
count that divides the model with `dsv3_jax.load(OUT, num_devices=N)`.

Peak host memory is about the largest single tensor: each stacked parameter is written one layer
(or one layer's expert) at a time, straight from the memory-mapped source file.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from flax import nnx

from ..checkpoint.export import check_output_path, staging_directory
from ..checkpoint.orbax import STATE_DIR, StreamedArray, save_streamed
from ..checkpoint.schema import (HF_CONFIG, MTP_STATE, CheckedTensors, abstract_state, hf_name, reference_names,
                                 stacked_axes)
from ..cli.common import ArgumentParser
from ..errors import CheckpointError
from .common import check_source, copy_tokenizer_files, load_hf_config, progress, read_tensor, run_tool

EXTRA_FILES = ("generation_config.json",)


def parameter_blocks(key: tuple[str, ...], shape: tuple[int, ...], source: CheckedTensors):
    """[(block index, HF name)] covering one state parameter: a whole tensor, or one per layer
    (and expert) of a stacked parameter."""
    names = reference_names(key, source.args)
    axes = stacked_axes(key)
    if axes == 0:
        return [((), hf_name(names))]
    if axes == 1:
        return [((slice(i, i + 1),), hf_name(names(i))) for i in range(shape[0])]
    return [((slice(i, i + 1), slice(e, e + 1)), hf_name(names(i, e)))
            for i in range(shape[0]) for e in range(shape[1])]


def streamed(source: CheckedTensors, blocks, shape, block_shape, label: str, bar) -> StreamedArray:
    """A StreamedArray whose blocks are read one at a time from the Hugging Face files."""
    index = source.index
    dtypes = {index.dtype(name) for _, name in blocks}
    if len(dtypes) > 1:
        raise CheckpointError(f"the tensors of parameter {label!r} mix dtypes {sorted(map(str, dtypes))}")

    def generate():
        for window, name in blocks:
            yield window, read_tensor(index.location[name], name).reshape(block_shape)
            bar.update(1)

    return StreamedArray(tuple(shape), dtypes.pop(), tuple(block_shape), generate)


def nest(tree: dict, keys, leaf) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = leaf


def to_orbax(hf_ckpt_path: Path, save_path: Path) -> None:
    check_output_path(save_path)
    _, args = load_hf_config(hf_ckpt_path)
    source = check_source(hf_ckpt_path, args)
    total = len(source.model) + len(source.mtp)
    bar = progress(None, desc="convert to orbax", total=total)
    tree: dict = {}
    for path, variable in nnx.to_flat_state(abstract_state(source.args)):
        key = tuple(str(p) for p in path)
        shape = tuple(variable.get_value().shape)
        axes = stacked_axes(key)
        blocks = parameter_blocks(key, shape, source)
        nest(tree, key, streamed(source, blocks, shape, (1,) * axes + shape[axes:], "/".join(key), bar))
    for name in source.mtp:
        shape = tuple(source.index.shape(name))
        keys = (MTP_STATE, *name.removeprefix("model.").split("."))
        nest(tree, keys, streamed(source, [((), name)], shape, shape, name, bar))

    with staging_directory(save_path) as staging:
        save_streamed(staging / STATE_DIR, tree)
        bar.close()
        shutil.copyfile(hf_ckpt_path / HF_CONFIG, staging / HF_CONFIG)
        for extra in EXTRA_FILES:
            if (hf_ckpt_path / extra).is_file():
                shutil.copyfile(hf_ckpt_path / extra, staging / extra)
        copy_tokenizer_files(hf_ckpt_path, staging)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="dsv3-to-orbax", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-ckpt-path", type=Path, required=True,
                        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)")
    parser.add_argument("--save-path", type=Path, required=True, help="output directory (must not exist, or be empty)")
    opts = parser.parse_args(argv)
    to_orbax(opts.hf_ckpt_path, opts.save_path)


def cli() -> int:
    """The `dsv3-to-orbax` console script."""
    return run_tool(main, prog="dsv3-to-orbax")


if __name__ == "__main__":
    sys.exit(cli())
