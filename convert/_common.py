"""What the three checkpoint tools share: the command-line wrapper, the staging directory that is
renamed into place only when everything is written, a streaming safetensors writer, and the
check of a Hugging Face checkpoint against the model its config describes.

Memory: tensors are read from memory-mapped files one at a time and copied out only as far as
the output needs; `read_tensor` drops the file mapping after each copy so that pages touched in
the input do not accumulate in the process. Outputs are written tensor by tensor
(`SafetensorsWriter`, orbax's per-block writes), so peak host memory is about the largest tensor.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import ml_dtypes
import numpy as np

from dsv3_jax.config import ModelArgs
from dsv3_jax.safetensors_io import DTYPE_NAMES, CheckpointError, SafetensorsFile, TensorIndex

HF_CONFIG = "config.json"
HF_INDEX = "model.safetensors.index.json"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
TOKENIZER_GLOB = "*token*"  # tokenizer.json, tokenizer_config.json, tokenizer.model, ... (as the reference)


class ToolError(ValueError):
    """Bad input to a tool, reported as one line."""


# ------------------------------------------------------------------ command line
def run_tool(main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> int:
    """Run a tool's `main`; bad input (config, checkpoint, arguments, files) exits 1 with one line."""
    try:
        main(argv)
    except (ValueError, OSError) as err:  # CheckpointError, ConfigError, ToolError are ValueErrors
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return 1
    return 0


def progress(items, *, desc: str, total: int | None = None, unit: str = "tensor"):
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, unit=unit, dynamic_ncols=True)


# ------------------------------------------------------------------ output directory
@contextlib.contextmanager
def staging_directory(target: str | Path) -> Iterator[Path]:
    """A fresh directory beside `target`, renamed to `target` when the block succeeds and removed
    when it fails, so that a failure leaves no half-written checkpoint. `target` must not exist
    (or be an empty directory): nothing already there is overwritten."""
    target = Path(target).absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ToolError(f"save path {target} already exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{secrets.token_hex(4)}.partial"
    staging.mkdir()  # exclusive: a clash with another run fails instead of sharing the directory
    try:
        yield staging
        if target.exists():
            target.rmdir()
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def copy_tokenizer_files(source: Path, destination: Path) -> list[str]:
    """Copy the tokenizer files (`*token*`, as the reference does); returns their names."""
    copied = []
    for path in sorted(Path(source).glob(TOKENIZER_GLOB)):
        if path.is_file():
            shutil.copyfile(path, Path(destination) / path.name)
            copied.append(path.name)
    return copied


# ------------------------------------------------------------------ reading and writing tensors
def read_tensor(file: SafetensorsFile, name: str, window=()) -> np.ndarray:
    """Copy a tensor (or `window` of it) out of its memory-mapped file, then unmap the file so the
    pages read stay out of this process's resident memory."""
    try:
        return np.array(file.tensor(name)[window])
    finally:
        file.release()


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in a layout fixed up front.

    The header (names, dtypes, shapes, offsets) is written first; `write` then appends each
    tensor's bytes in layout order, so only the tensor being written is ever in memory.
    """

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._layout = []
        for name, dtype, shape in layout:
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._layout.append((name, dtype, tuple(shape)))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._handle = open(self.path, "wb")
        self._handle.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        expected, dtype, shape = self._layout[self._next]
        if name != expected or array.dtype != dtype or tuple(array.shape) != shape:
            raise RuntimeError(f"{self.path.name}: got {name} {array.dtype} {tuple(array.shape)}, "
                               f"the layout expects {expected} {dtype} {shape}")
        self._handle.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        self._next += 1

    def close(self) -> None:
        self._handle.close()
        if self._next != len(self._layout):
            raise RuntimeError(f"{self.path.name}: {len(self._layout) - self._next} tensors were never written")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._handle.close()


# ------------------------------------------------------------------ the Hugging Face source
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def load_hf_config(directory: Path) -> tuple[dict, ModelArgs]:
    """The raw `config.json` of a Hugging Face checkpoint directory and the ModelArgs it describes."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ToolError(f"checkpoint directory not found: {directory}")
    path = directory / HF_CONFIG
    if not path.is_file():
        raise ToolError(f"no {HF_CONFIG} in {directory}")
    args = ModelArgs.from_file(path)
    return json.loads(path.read_text()), args


@dataclass
class SourceTensors:
    """A Hugging Face checkpoint checked against its config.

    `model`: reference name -> HF name for every tensor the model needs (all present, with the
    shapes the config implies). `mtp`: HF names of the multi-token-prediction layers (index >=
    num_hidden_layers). `set_aside`: names the caller checks and handles itself.
    Anything else in the checkpoint is an error.
    """

    index: TensorIndex
    args: ModelArgs
    model: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    mtp: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)


def abstract_state(args: ModelArgs):
    """The model's parameters as shapes only (no memory): the config's list of tensors and shapes."""
    from flax import nnx

    from dsv3_jax.model import Transformer

    return nnx.split(nnx.eval_shape(lambda: Transformer(args)))[1]


def check_source(directory: Path, args: ModelArgs, set_aside: Callable[[str], bool] | None = None) -> SourceTensors:
    """Index the checkpoint's files and match every tensor to the model the config describes."""
    from dsv3_jax.checkpoint import expected_tensors, hf_name

    index = TensorIndex(directory)
    if args.gate_bias is None:
        probe = hf_name(f"layers.{args.n_dense_layers}.ffn.gate.bias")
        args = args.replace(gate_bias=args.n_moe_layers > 0 and probe in index)
    source = SourceTensors(index, args)
    for _, name, shape in expected_tensors(abstract_state(args), args):
        source.model[name] = hf_name(name)
        source.shapes[name] = tuple(shape)
    needed = {hf: ref for ref, hf in source.model.items()}
    for name in index.names():
        if name in needed:
            ref = needed[name]
            if tuple(index.shape(name)) != source.shapes[ref]:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(index.shape(name))}, "
                                      f"the config implies {source.shapes[ref]}")
            _check_dtype(index, name, ref, source.shapes)
            continue
        layer = _LAYER.match(name)
        if set_aside is not None and set_aside(name):
            source.set_aside.append(name)
        elif layer and int(layer.group(1)) >= args.n_layers:
            source.mtp.append(name)
        elif not name.endswith("rotary_emb.inv_freq"):
            raise CheckpointError(f"unknown tensor {name!r} in {index.location[name].path.name} "
                                  "(not part of the model its config describes)")
    for ref, name in source.model.items():
        if name not in index:
            raise CheckpointError(f"missing tensor {name!r} in {directory}")
    return source


def _check_dtype(index: TensorIndex, name: str, ref: str, shapes: dict) -> None:
    """fp8 configs: block scales are float32 and the weights they scale are float8_e4m3fn."""
    dtype = index.dtype(name)
    if ref.endswith(".scale") and dtype != np.float32:
        raise CheckpointError(f"tensor {name!r} is {dtype}, fp8 block scales must be float32")
    if ref.endswith(".weight") and ref[: -len("weight")] + "scale" in shapes and dtype != FP8:
        raise CheckpointError(f"tensor {name!r} is {dtype}, the fp8 config expects float8_e4m3fn")


def in_file_order(index: TensorIndex, names) -> list[str]:
    """Names sorted by (file, offset), so that files are read front to back."""
    return sorted(names, key=lambda n: (index.location[n].path.name, index.location[n].entries[n][2]))
