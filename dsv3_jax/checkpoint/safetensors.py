"""A small, strict safetensors reader over `numpy.memmap`.

Tensors are views into the mapped file, so reading a slice touches only its bytes: loaders and
converters stream a checkpoint tensor by tensor (or shard by shard) without holding it whole.
A header that lies about its sizes (a truncated or corrupt file) is a one-line error.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Sequence

import ml_dtypes
import numpy as np

from ..errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """The tensors of one .safetensors file, each a read-only view into the memory-mapped file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as handle:
                raw = handle.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"corrupt or truncated safetensors file {self.path}: no header")
                (header_len,) = struct.unpack("<Q", raw)
                if header_len > min(size - 8, _MAX_HEADER):
                    raise CheckpointError(f"corrupt or truncated safetensors file {self.path}: header length "
                                          f"{header_len} exceeds the file")
                header = json.loads(handle.read(header_len))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"corrupt or unreadable safetensors file {self.path}: {err}") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        self._file_size = size
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"corrupt safetensors file {self.path}: bad header entry for {name!r}") from None
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != expected or begin < 0:
                raise CheckpointError(f"corrupt safetensors file {self.path}: tensor {name!r} has {end - begin} "
                                      f"bytes for shape {shape} {info['dtype']}")
            if self._data_start + end > size:
                raise CheckpointError(f"truncated safetensors file {self.path}: tensor {name!r} ends at byte "
                                      f"{self._data_start + end} of {size}")
            self.entries[name] = (dtype, shape, begin, end)
        self._map = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def release(self) -> None:
        """Drop the file mapping (pages read so far leave the process); the next read maps again."""
        self._map = None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][0]

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of the tensor (no bytes read until used)."""
        dtype, shape, begin, end = self.entries[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        flat = self._map[self._data_start + begin: self._data_start + end]
        return flat.view(dtype).reshape(shape)


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in a layout fixed up front.

    The header (names, dtypes, shapes, offsets) is written first; `write` then appends each
    tensor's bytes in layout order, so only the tensor being written is ever in memory.
    """

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}}
        offset = 0
        self._layout = []
        for name, dtype, shape in layout:
            dtype = np.dtype(dtype)
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"{self.path.name}: tensor {name!r} has unsupported dtype {dtype}")
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


def save_file(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (ml_dtypes bfloat16 / float8 included) as one safetensors file."""
    arrays = {name: np.asarray(array) for name, array in tensors.items()}
    with SafetensorsWriter(path, [(name, a.dtype, a.shape) for name, a in arrays.items()], metadata) as writer:
        for name, array in arrays.items():
            writer.write(name, array)


class TensorIndex:
    """Every tensor of a checkpoint directory: name -> the file that holds it.

    Uses `model.safetensors.index.json` when present (checking it against the files), otherwise
    the headers of all `*.safetensors` files in the directory.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.directory}")
        self.files = {f.name: SafetensorsFile(f) for f in files}
        self.location: dict[str, SafetensorsFile] = {}
        for file in self.files.values():
            for name in file.keys():
                if name in self.location:
                    raise CheckpointError(f"tensor {name!r} appears in both {self.location[name].path.name} "
                                          f"and {file.path.name}")
                self.location[name] = file
        index_path = self.directory / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"corrupt index {index_path}: no weight_map") from None
            for name, filename in weight_map.items():
                if filename not in self.files:
                    raise CheckpointError(f"index {index_path.name} names missing file {filename} (tensor {name!r})")
                if name not in self.location or self.location[name].path.name != filename:
                    raise CheckpointError(f"index {index_path.name} places tensor {name!r} in {filename}, "
                                          "which does not hold it")

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names(self) -> list[str]:
        return list(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.location[name].shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self.location[name].dtype(name)

    def tensor(self, name: str) -> np.ndarray:
        return self.location[name].tensor(name)
