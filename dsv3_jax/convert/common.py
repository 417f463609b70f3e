"""What the three checkpoint tools share: the command-line wrapper, the output directory (staged and
renamed into place by `dsv3_jax.checkpoint.export`), reading tensors out of memory-mapped files,
and the check of a Hugging Face checkpoint against the model its config describes
(`dsv3_jax.checkpoint.schema`, the same check the loader makes).

Memory: tensors are read from memory-mapped files one at a time and copied out only as far as
the output needs; `read_tensor` drops the file mapping after each copy so that pages touched in
the input do not accumulate in the process. Outputs are written tensor by tensor
(`SafetensorsWriter`, orbax's per-block writes), so peak host memory is about the largest tensor.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..checkpoint.safetensors import SafetensorsFile, TensorIndex
from ..checkpoint.schema import HF_CONFIG, CheckedTensors, check_tensors
from ..cli.common import run_cli
from ..config import ModelArgs
from ..progress import progress_bar

TOKENIZER_GLOB = "*token*"  # tokenizer.json, tokenizer_config.json, tokenizer.model, ... (as the reference)


class ToolError(ValueError):
    """Bad input to a tool, reported as one line."""


# ------------------------------------------------------------------ command line
def run_tool(main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None,
             prog: str = "dsv3") -> int:
    """Run a tool's `main`; bad input (config, checkpoint, arguments, files) exits 1 with one line."""
    return run_cli(prog, main, argv)


def progress(items, *, desc: str, total: int | None = None, unit: str = "tensor"):
    """The tools' progress bar over `items` (or None, updated by hand), drawn when stderr is a terminal."""
    return progress_bar(total, desc=desc, unit=unit, iterable=items)


# ------------------------------------------------------------------ output directory
def copy_tokenizer_files(source: Path, destination: Path) -> list[str]:
    """Copy the tokenizer files (`*token*`, as the reference does); returns their names."""
    copied = []
    for path in sorted(Path(source).glob(TOKENIZER_GLOB)):
        if path.is_file():
            shutil.copyfile(path, Path(destination) / path.name)
            copied.append(path.name)
    return copied


# ------------------------------------------------------------------ reading tensors
def read_tensor(file: SafetensorsFile, name: str, window=()) -> np.ndarray:
    """Copy a tensor (or `window` of it) out of its memory-mapped file, then unmap the file so the
    pages read stay out of this process's resident memory."""
    try:
        return np.array(file.tensor(name)[window])
    finally:
        file.release()


# ------------------------------------------------------------------ the Hugging Face source
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


def check_source(directory: Path, args: ModelArgs, set_aside: Callable[[str], bool] | None = None) -> CheckedTensors:
    """Index a Hugging Face checkpoint's files and match every tensor to the model the config describes."""
    return check_tensors(TensorIndex(directory), args, set_aside=set_aside)


def in_file_order(index: TensorIndex, names) -> list[str]:
    """Names sorted by (file, offset), so that files are read front to back."""
    return sorted(names, key=lambda n: (index.location[n].path.name, index.location[n].entries[n][2]))
