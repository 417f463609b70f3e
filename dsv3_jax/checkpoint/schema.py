"""The checkpoint schema: which tensors a model needs, under which names, in which layouts.

The loader (`checkpoint.py`) and the converters (`dsv3_jax.convert`) both read checkpoints
through this module, so that names, layouts, probes and checks are written once.

Names: every parameter has a reference name (the reference's `model.py` names, e.g.
`layers.3.ffn.experts.17.w1.weight`); `hf_name` maps it to the Hugging Face hub name
(`model.layers.3.mlp.experts.17.gate_proj.weight`) with one table. The model's state stacks the
layers of each kind (and the routed experts) on leading axes; `reference_names` and
`stacked_axes` say which per-layer tensors a stacked parameter is made of.

Layouts: a Hugging Face directory (config.json, *.safetensors, an optional index), and the
reference's per-rank files `model{r}-mp{MP}.safetensors` (`rank_file_name`), in which routed
experts go whole to their owner and the tensors of `REFERENCE_SPLIT_DIM` are cut over ranks.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from flax import nnx

from pallas_kernels import FP8_DTYPE

from ..config import ModelArgs
from ..errors import CheckpointError
from ..model.transformer import Transformer

HF_CONFIG = "config.json"
HF_INDEX = "model.safetensors.index.json"
FP8 = np.dtype(FP8_DTYPE)

# reference module name -> Hugging Face module name (component by component)
HF_COMPONENTS = {
    "embed": "embed_tokens", "attn": "self_attn", "ffn": "mlp", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
    "wo": "o_proj", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj", "scale": "weight_scale_inv",
    "bias": "e_score_correction_bias",
}
STACKS = ("dense_layers", "moe_layers")
MTP_STATE = "mtp"  # the MTP module's subtree: of the state (Transformer(mtp=True)) and of an orbax checkpoint
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def hf_name(reference_name: str) -> str:
    """`layers.0.attn.wq.weight` -> `model.layers.0.self_attn.q_proj.weight`; `head.weight` -> `lm_head.weight`."""
    if reference_name.startswith("head."):
        return "lm_head." + reference_name[len("head."):]
    return "model." + ".".join(HF_COMPONENTS.get(part, part) for part in reference_name.split("."))


def layer_number(name: str) -> int | None:
    """The layer a tensor belongs to (`model.layers.3.` or `layers.3.` -> 3), None outside the layers."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def reference_names(path: tuple[str, ...], args: ModelArgs) -> Callable[..., str] | str:
    """The reference name of a state leaf: a string, or for stacked leaves a function of
    (the layer's index within its stack[, expert index])."""
    if path[0] == MTP_STATE:  # the MTP module: layer n_layers, its block's modules at the layer's top level
        rest = list(path[2:]) if path[1] == "block" else list(path[1:])
        if rest[:2] == ["ffn", "experts"]:
            tail = ".".join(rest[2:])
            return lambda expert: f"layers.{args.n_layers}.ffn.experts.{expert}.{tail}"
        return f"layers.{args.n_layers}." + ".".join(rest)
    if path[0] not in STACKS:
        return ".".join(path)
    first = 0 if path[0] == "dense_layers" else args.n_dense_layers
    rest = list(path[1:])
    if rest[:2] == ["ffn", "experts"]:
        tail = ".".join(rest[2:])
        return lambda stack_index, expert: f"layers.{first + stack_index}.ffn.experts.{expert}.{tail}"
    tail = ".".join(rest)
    return lambda stack_index: f"layers.{first + stack_index}.{tail}"


def stacked_axes(path: tuple[str, ...]) -> int:
    """How many leading axes of a leaf index layers (and experts)."""
    if path[0] == MTP_STATE:
        return 1 if path[1:4] == ("block", "ffn", "experts") else 0
    if path[0] not in STACKS:
        return 0
    return 2 if path[1:3] == ("ffn", "experts") else 1


def abstract_state(args: ModelArgs, param_dtype=None, mtp: bool = False) -> nnx.State:
    """The model's parameters as shapes only (no memory): the config's list of tensors and shapes
    (with `mtp`, the MTP module's too)."""
    dtype = {} if param_dtype is None else dict(param_dtype=param_dtype)
    return nnx.split(nnx.eval_shape(lambda: Transformer(args, mtp=mtp, **dtype)))[1]


def mtp_probe(args: ModelArgs) -> str:
    """The reference name whose presence says a checkpoint holds the MTP module."""
    return f"layers.{args.n_layers}.eh_proj.weight"


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
            for stack_index in range(shape[0]):
                yield path, names(stack_index), shape[1:]
        else:
            for stack_index in range(shape[0]):
                for expert in range(shape[1]):
                    yield path, names(stack_index, expert), shape[2:]


def with_gate_bias(args: ModelArgs, has_tensor: Callable[[str], bool]) -> ModelArgs:
    """`args` with `gate_bias` decided, when the config leaves it open, by whether the first MoE
    layer's gate has a score-correction bias (`has_tensor` takes a reference name)."""
    if args.gate_bias is not None:
        return args
    present = args.n_moe_layers > 0 and has_tensor(f"layers.{args.n_dense_layers}.ffn.gate.bias")
    return args.replace(gate_bias=present)


@dataclasses.dataclass
class CheckedTensors:
    """A checkpoint matched against the model its config describes.

    `model`: reference name -> stored name for every tensor the model needs (all present, with the
    shapes the config implies; fp8 weights float8_e4m3fn, their scales float32). `mtp`: stored
    names of the multi-token-prediction layers (index >= n_layers), which the model does not run.
    `set_aside`: names the caller checks and handles itself. Anything else is an error.
    """

    index: object  # TensorIndex or ReferenceLayoutIndex: names(), shape(), dtype(), `in`, directory
    args: ModelArgs
    model: dict[str, str] = dataclasses.field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    mtp: list[str] = dataclasses.field(default_factory=list)
    set_aside: list[str] = dataclasses.field(default_factory=list)


def check_tensors(index, args: ModelArgs, naming: Callable[[str], str] = hf_name,
                  set_aside: Callable[[str], bool] | None = None, state: nnx.State | None = None) -> CheckedTensors:
    """Match every tensor of `index` to the model of `args` (gate bias probed when open); errors name the tensor.

    `naming` maps reference names to the stored ones (`str` where they are stored as they are, as
    in the reference's per-rank files); `state` is the model's abstract state (made from `args`
    when not given)."""
    args = with_gate_bias(args, lambda name: naming(name) in index)
    checked = CheckedTensors(index, args)
    for _, name, shape in expected_tensors(abstract_state(args) if state is None else state, args):
        stored = naming(name)
        checked.model[name], checked.shapes[name] = stored, tuple(shape)
        if stored not in index:
            weight = naming(name[: -len("scale")] + "weight") if name.endswith(".scale") else None
            if weight is not None and weight in index:
                raise CheckpointError(f"fp8 weight {weight!r} has no scale tensor {stored!r} in {index.directory}")
            raise CheckpointError(f"missing tensor {stored!r} in {index.directory}")
        if tuple(index.shape(stored)) != tuple(shape):
            raise CheckpointError(f"tensor {stored!r} has shape {tuple(index.shape(stored))}, "
                                  f"the config implies {tuple(shape)}")
    for name, stored in checked.model.items():
        _check_dtype(index, stored, name, checked.shapes)
    needed = set(checked.model.values())
    for name in index.names():
        if name in needed:
            continue
        layer = layer_number(name)
        if set_aside is not None and set_aside(name):
            checked.set_aside.append(name)
        elif layer is not None and layer >= args.n_layers:
            checked.mtp.append(name)
        elif not name.endswith("rotary_emb.inv_freq"):
            raise CheckpointError(f"unexpected tensor {name!r} in {index.directory} "
                                  "(not part of the model its config describes)")
    return checked


def _check_dtype(index, stored: str, name: str, shapes: dict) -> None:
    """fp8 configs: block scales are float32 and the weights they scale are float8_e4m3fn."""
    dtype = index.dtype(stored)
    if name.endswith(".scale") and dtype != np.float32:
        raise CheckpointError(f"tensor {stored!r} is {dtype}, fp8 block scales must be float32")
    if name.endswith(".weight") and name[: -len("weight")] + "scale" in shapes and dtype != FP8:
        raise CheckpointError(f"tensor {stored!r} is {dtype}, the fp8 config expects float8_e4m3fn")


# ------------------------------------------------------------------ the reference's per-rank layout
# reference module -> the dimension the reference's convert.py cuts it along over ranks (others are
# copied to every rank, routed experts go whole to the rank that owns them)
REFERENCE_SPLIT_DIM = {"embed": 0, "wq": 0, "wq_b": 0, "wkv_b": 0, "wo": 1, "w1": 0, "w2": 1, "w3": 0, "head": 0}
_ROUTED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")
_RANK_FILE = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")


def rank_file_name(rank: int, world: int) -> str:
    return f"model{rank}-mp{world}.safetensors"


def routed_expert(name: str) -> int | None:
    """The expert index of a routed-expert tensor (`layers.3.ffn.experts.17.w1.weight` -> 17), else None."""
    match = _ROUTED_EXPERT.match(name)
    return int(match.group(1)) if match else None


def split_dim(name: str) -> int | None:
    """The dimension a tensor (weight or its fp8 `scale`) is cut along over ranks; None when not cut."""
    if routed_expert(name) is not None:
        return None
    return REFERENCE_SPLIT_DIM.get(name.split(".")[-2])


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
