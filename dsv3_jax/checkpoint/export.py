"""Writing a checkpoint directory: everything goes to a staging directory beside the target, which
is renamed into place only when it is complete, so that a failure leaves nothing half-written.

`staging_directory` is the one writer of that rule (the conversion tools and the trainer's export
use it); `write_hf_checkpoint` writes a Hugging Face directory (config, safetensors, tokenizer).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import CheckpointError
from .safetensors import save_file


def check_output_path(target: str | Path, *, replace: bool = False) -> Path:
    """`target` as an absolute path, if it may be written: unless `replace`, it must not exist (or
    be an empty directory), so nothing already there is overwritten. Check before reading any input."""
    target = Path(target).absolute()
    if not replace and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"save path {target} already exists and is not empty")
    return target


@contextlib.contextmanager
def staging_directory(target: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """A fresh directory beside `target`, renamed to `target` when the block succeeds and removed
    when it fails. With `replace`, an existing `target` is swapped out only once the new one is whole."""
    target = check_output_path(target, replace=replace)
    staging = target.parent / f".{target.name}.{secrets.token_hex(4)}.partial"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()  # exclusive: a clash with another run fails instead of sharing the directory
    except OSError as err:  # named by the user's path, not the staging name they never gave
        raise CheckpointError(f"cannot create save path {target}: {err.strerror or err}") from None
    try:
        yield staging
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, target: Path) -> None:
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        os.replace(staging, target)
        return
    old = staging.with_name(staging.name.removesuffix(".partial") + ".old")
    os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old) if old.is_dir() else old.unlink()


def write_hf_checkpoint(directory: str | Path, hf_config: dict, tensors: dict[str, np.ndarray],
                        tokenizer_dir: str | Path | None = None, extra_files: dict[str, str] | None = None,
                        max_file_bytes: int = 15 * 2**20) -> Path:
    """config.json + the tensors (+ tokenizer files) in `directory`, replacing what is there.

    The tensors go to `model.safetensors`, or, when they exceed `max_file_bytes`, to the hub's
    sharded layout (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`)."""
    directory = Path(directory)
    with staging_directory(directory, replace=True) as staging:
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        _write_tensors(staging, tensors, max_file_bytes)
        if tokenizer_dir is not None:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(Path(tokenizer_dir) / name, staging / name)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
    return directory


def _write_tensors(directory: Path, tensors: dict[str, np.ndarray], max_file_bytes: int) -> None:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_file_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / filename, metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
