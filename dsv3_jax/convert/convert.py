"""Convert a Hugging Face DeepSeek-V2/V3 checkpoint into the reference's per-rank layout.

    dsv3-convert --hf-ckpt-path HF_DIR --save-path OUT --n-experts 256 --model-parallel 8

OUT receives `model{r}-mp{MP}.safetensors` for each rank r < MP and the tokenizer files. Names are
the reference's (`model.` dropped, `self_attn`->`attn`, `q_b_proj`->`wq_b`, `weight_scale_inv`->
`scale`, ...); the multi-token-prediction layer is skipped, as the reference does, unless
--keep-mtp is given: then its module (enorm, hnorm, eh_proj, shared_head.norm and its block, under
reference names at layer n_layers; not its copies of the embedding and head) goes into the files by
the same rules, for `dsv3_jax.load(OUT, config=..., mtp=True)`. Routed experts go whole to the rank
that owns them (experts [r*E/MP, (r+1)*E/MP)); embed, wq, wq_b, wkv_b, w1, w3 and head are cut
into MP equal parts along dim 0, wo and w2 along dim 1, the fp8 block scales of a cut weight
along the same dimension in whole 128-blocks; everything else is copied to every rank.

Load the result with `dsv3_jax.load(OUT, config=<reference JSON or ModelArgs>, num_devices=N)`.
Each source tensor is read once and each rank's part written straight to that rank's file, so
host memory stays near the largest tensor whatever the model size.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..checkpoint.export import check_output_path, staging_directory
from ..checkpoint.safetensors import SafetensorsWriter
from ..checkpoint.schema import (MTP_STATE, abstract_state, expected_tensors, hf_name, rank_file_name, routed_expert,
                      split_dim)
from ..cli.common import ArgumentParser
from ..config import ModelArgs
from ..sharding import check_divisible
from .common import (ToolError, check_source, copy_tokenizer_files, in_file_order, load_hf_config, progress,
                     read_tensor, run_tool)


def check_model_parallel(args: ModelArgs, n_experts: int, world: int) -> None:
    """--n-experts must agree with the config, and every tensor the reference cuts over ranks must
    cut evenly (the same rules as a mesh of `world` devices)."""
    if world < 1:
        raise ToolError(f"--model-parallel must be positive, got {world}")
    if args.n_moe_layers and n_experts != args.n_routed_experts:
        raise ToolError(f"--n-experts {n_experts} contradicts the config's n_routed_experts={args.n_routed_experts}")
    check_divisible(args, world, "ranks of --model-parallel")


def rank_parts(name: str, shape: tuple[int, ...], args: ModelArgs, world: int):
    """[(rank, window)] of the ranks that receive part of tensor `name` (reference name)."""
    expert = routed_expert(name)
    if expert is not None:
        return [(expert // (args.n_routed_experts // world), ())]
    dim = split_dim(name)
    if dim is None or world == 1:
        return [(rank, ()) for rank in range(world)]
    part = shape[dim] // world  # whole parts (and fp8 blocks): check_model_parallel
    return [(rank, (slice(None),) * dim + (slice(rank * part, (rank + 1) * part),)) for rank in range(world)]


def part_shape(shape: tuple[int, ...], window: tuple) -> tuple[int, ...]:
    out = list(shape)
    for axis, item in enumerate(window):
        start, stop, _ = item.indices(shape[axis])
        out[axis] = stop - start
    return tuple(out)


def mtp_tensors(source) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (reference name, shape) of the MTP module's tensors the model runs (layer n_layers)."""
    args, index = source.args, source.index
    if args.n_mtp_layers < 1 or hf_name(f"layers.{args.n_layers}.eh_proj.weight") not in index:
        raise ToolError(f"--keep-mtp: {index.directory} holds no MTP layer (layer {args.n_layers})")
    found = {}
    for path, ref, shape in expected_tensors(abstract_state(args, mtp=True), args):
        if path[0] != MTP_STATE:
            continue
        hf = hf_name(ref)
        if hf not in index:
            raise ToolError(f"--keep-mtp: missing MTP tensor {hf!r} in {index.directory}")
        if tuple(index.shape(hf)) != tuple(shape):
            raise ToolError(f"--keep-mtp: MTP tensor {hf!r} has shape {tuple(index.shape(hf))}, "
                            f"the config implies {tuple(shape)}")
        found[hf] = (ref, tuple(shape))
    return found


def convert(hf_ckpt_path: Path, save_path: Path, n_experts: int, world: int, keep_mtp: bool = False) -> None:
    check_output_path(save_path)
    _, args = load_hf_config(hf_ckpt_path)
    source = check_source(hf_ckpt_path, args)
    check_model_parallel(source.args, n_experts, world)
    index = source.index
    reference_of = {hf: ref for ref, hf in source.model.items()}
    if keep_mtp:
        for hf, (ref, shape) in mtp_tensors(source).items():
            reference_of[hf], source.shapes[ref] = ref, shape

    plan = []  # (HF name, reference name, [(rank, window)]) in the order the files are read
    layouts: list[list] = [[] for _ in range(world)]
    for hf in in_file_order(index, reference_of):
        ref = reference_of[hf]
        parts = rank_parts(ref, source.shapes[ref], source.args, world)
        for rank, window in parts:
            layouts[rank].append((ref, index.dtype(hf), part_shape(source.shapes[ref], window)))
        plan.append((hf, ref, parts))

    with staging_directory(save_path) as staging, contextlib.ExitStack() as files:
        writers = [files.enter_context(SafetensorsWriter(staging / rank_file_name(rank, world), layouts[rank]))
                   for rank in range(world)]
        for hf, ref, parts in progress(plan, desc=f"convert to {world} ranks"):
            file = index.location[hf]
            copied = read_tensor(file, hf) if len(parts) > 1 and parts[0][1] == () else None  # read once
            for rank, window in parts:
                writers[rank].write(ref, copied if copied is not None else read_tensor(file, hf, window))
        files.close()
        copy_tokenizer_files(hf_ckpt_path, staging)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="dsv3-convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-ckpt-path", type=Path, required=True,
                        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)")
    parser.add_argument("--save-path", type=Path, required=True, help="output directory (must not exist, or be empty)")
    parser.add_argument("--n-experts", type=int, required=True, help="routed experts (must match the config)")
    parser.add_argument("--model-parallel", type=int, required=True, help="ranks to split over (MP)")
    parser.add_argument("--keep-mtp", action="store_true",
                        help="keep the multi-token-prediction layer (the reference skips it)")
    opts = parser.parse_args(argv)
    convert(opts.hf_ckpt_path, opts.save_path, opts.n_experts, opts.model_parallel, opts.keep_mtp)


def cli() -> int:
    """The `dsv3-convert` console script."""
    return run_tool(main, prog="dsv3-convert")


if __name__ == "__main__":
    sys.exit(cli())
