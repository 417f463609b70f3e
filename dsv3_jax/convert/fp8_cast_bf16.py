"""Dequantize a block-wise fp8 Hugging Face checkpoint (DeepSeek-V3's released weights) to bf16.

    dsv3-fp8-cast-bf16 --input-fp8-hf-path FP8_DIR --output-bf16-hf-path BF16_DIR

As the reference: every float8_e4m3fn tensor whose `<name>_scale_inv` partner exists (found
through the index, possibly in another file) is written as bf16 = weight * scale per 128x128
block (`pallas_kernels.weight_dequant`); a weight without a partner is copied unchanged with a
warning; the `_scale_inv` tensors and their index entries are dropped. Each output file mirrors an
input file. Beyond the reference, the other files of the directory are copied too, with
`quantization_config` removed from config.json, so the output is a loadable bf16 checkpoint.

One tensor is in memory at a time (plus its bf16 result); files are written tensor by tensor.
"""
from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from pallas_kernels import FP8_BLOCK, cdiv, weight_dequant

from ..checkpoint.export import check_output_path, staging_directory
from ..checkpoint.safetensors import SafetensorsWriter
from ..checkpoint.schema import FP8, HF_CONFIG, HF_INDEX
from ..cli.common import ArgumentParser
from ..errors import CheckpointError
from .common import ToolError, check_source, load_hf_config, progress, read_tensor, run_tool

SCALE_SUFFIX = "_scale_inv"
BF16 = np.dtype(ml_dtypes.bfloat16)


def make_dequantizer():
    """weight (M, N) e4m3 + scale (ceil(M/128), ceil(N/128)) float32 -> bf16 numpy, jitted per shape."""
    dequant = jax.jit(weight_dequant, static_argnames=("block_size", "out_dtype"))
    return lambda weight, scale: np.asarray(dequant(weight, scale, block_size=FP8_BLOCK))


def plan_file(index, file, warn) -> list[tuple[str, str | None]]:
    """[(tensor, its scale's name or None)] for the tensors of one file that the output keeps."""
    plan = []
    for name in sorted(file.keys(), key=lambda n: file.entries[n][2]):
        if name.endswith(SCALE_SUFFIX):
            continue
        dtype = file.dtype(name)
        scale = name + SCALE_SUFFIX
        if dtype.itemsize != 1:
            plan.append((name, None))
        elif scale not in index:
            warn(f"warning: no {scale} for fp8 tensor {name}; copied as {dtype}")
            plan.append((name, None))
        else:
            if dtype != FP8:
                raise CheckpointError(f"tensor {name!r} is {dtype}; only float8_e4m3fn block-scaled weights "
                                      "can be dequantized")
            rows, cols = file.shape(name)
            expected = (cdiv(rows, FP8_BLOCK), cdiv(cols, FP8_BLOCK))
            if tuple(index.shape(scale)) != expected or index.dtype(scale) != np.float32:
                raise CheckpointError(f"tensor {scale!r} is {index.dtype(scale)} {tuple(index.shape(scale))}, the "
                                      f"weight {name!r} {(rows, cols)} needs float32 {expected}")
            plan.append((name, scale))
    return plan


def output_config(config: dict) -> dict:
    return {key: value for key, value in config.items() if key != "quantization_config"}


def cast(input_dir: Path, output_dir: Path) -> None:
    check_output_path(output_dir)
    config, args = load_hf_config(input_dir)
    # Checked against the bf16 model the config describes: scales are this tool's business.
    source = check_source(input_dir, args.replace(dtype="bf16"), set_aside=lambda n: n.endswith(SCALE_SUFFIX))
    index = source.index
    for scale in source.set_aside:
        if scale[: -len(SCALE_SUFFIX)] not in index:
            raise CheckpointError(f"unknown tensor {scale!r}: no weight {scale[:-len(SCALE_SUFFIX)]!r} to scale")
    warn = functools.partial(tqdm.write, file=sys.stderr)
    plans = {file_name: plan_file(index, file, warn) for file_name, file in index.files.items()}
    if not any(scale for plan in plans.values() for _, scale in plan):
        raise ToolError(f"no fp8 tensors in {input_dir}: nothing to cast")
    dequantize = make_dequantizer()
    total = sum(len(plan) for plan in plans.values())
    weight_map, total_bytes = {}, 0
    with staging_directory(output_dir) as staging:
        bar = progress(None, desc="fp8 -> bf16", total=total)
        for file_name, plan in plans.items():
            file = index.files[file_name]
            layout = [(name, BF16 if scale else file.dtype(name), file.shape(name)) for name, scale in plan]
            with SafetensorsWriter(staging / file_name, layout, file.metadata or None) as writer:
                for name, scale in plan:
                    tensor = read_tensor(file, name)
                    if scale is not None:
                        tensor = dequantize(tensor, read_tensor(index.location[scale], scale))
                    writer.write(name, tensor)
                    weight_map[name] = file_name
                    total_bytes += tensor.nbytes
                    bar.update(1)
        bar.close()
        if (input_dir / HF_INDEX).is_file():
            original = json.loads((input_dir / HF_INDEX).read_text())
            metadata = {**original.get("metadata", {}), "total_size": total_bytes}
            (staging / HF_INDEX).write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2))
        (staging / HF_CONFIG).write_text(json.dumps(output_config(config), indent=2))
        for path in sorted(input_dir.iterdir()):
            if path.is_file() and path.suffix != ".safetensors" and path.name not in (HF_INDEX, HF_CONFIG):
                shutil.copyfile(path, staging / path.name)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="dsv3-fp8-cast-bf16", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-fp8-hf-path", type=Path, required=True,
                        help="block-wise fp8 Hugging Face checkpoint directory")
    parser.add_argument("--output-bf16-hf-path", type=Path, required=True,
                        help="output directory (must not exist, or be empty)")
    opts = parser.parse_args(argv)
    if opts.input_fp8_hf_path.absolute() == opts.output_bf16_hf_path.absolute():
        raise ToolError("the output path must differ from the input path")
    cast(opts.input_fp8_hf_path, opts.output_bf16_hf_path)


def cli() -> int:
    """The `dsv3-fp8-cast-bf16` console script."""
    return run_tool(main, prog="dsv3-fp8-cast-bf16")


if __name__ == "__main__":
    sys.exit(cli())
