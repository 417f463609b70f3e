"""Turn a float32 Hugging Face DeepSeek model into the hub's block-wise fp8 layout (`weight` e4m3 +
`weight_scale_inv` per 128x128 block, several files + index). Every projection matrix is quantised;
embedding, norms, router and head stay high precision, as in real checkpoints. HF reloaded with the
dequantised weights, in float32, is the oracle of the fp8 checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dsv3_jax.checkpoint.safetensors import save_file

BLOCK = 128
E4M3_MAX = 448.0


def quantize_block_wise(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(M, N) float -> e4m3 (M, N) and float32 scales (ceil(M/128), ceil(N/128)): float64 math, per
    128x128 block scale = max(amax, 1e-4) / 448, q = w / scale rounded to e4m3 (ragged edge blocks)."""
    rows, cols = weight.shape
    block_rows, block_cols = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = np.zeros((block_rows * BLOCK, block_cols * BLOCK), np.float64)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(block_rows, BLOCK, block_cols, BLOCK)
    scales = (np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-4) / E4M3_MAX).astype(np.float32)
    quantized = (blocks / scales[:, None, :, None].astype(np.float64)).reshape(padded.shape)[:rows, :cols]
    return quantized.astype(ml_dtypes.float8_e4m3fn), scales


def dequantize(quantized: np.ndarray, scales: np.ndarray) -> np.ndarray:
    full = np.repeat(np.repeat(scales.astype(np.float64), BLOCK, 0), BLOCK, 1)
    return quantized.astype(np.float64) * full[: quantized.shape[0], : quantized.shape[1]]


def save_fp8(model, directory: Path, files: int = 3, scale_fmt: str | None = None):
    """Write `model` as an fp8 hub checkpoint split over `files` files with an index.

    Returns (directory, oracle): the oracle is the same HF model reloaded with every quantised
    weight replaced by its dequantised float32 value (and the rest rounded to bf16, as stored).
    """
    import tempfile

    import transformers

    from dsv3_jax.checkpoint.safetensors import TensorIndex

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as hub, tempfile.TemporaryDirectory() as dequantised:
        model.save_pretrained(hub)  # the hub layout: one tensor per expert
        source = TensorIndex(hub)
        tensors: dict[str, np.ndarray] = {}
        oracle: dict[str, np.ndarray] = {}
        for name in source.names():
            array = np.asarray(source.tensor(name), np.float32)
            if array.ndim == 2 and not any(k in name for k in ("embed_tokens", "lm_head", "norm", "mlp.gate.")):
                quantized, scales = quantize_block_wise(array)
                tensors[name], tensors[name + "_scale_inv"] = quantized, scales
                oracle[name] = dequantize(quantized, scales).astype(np.float32)
            else:
                tensors[name] = array if "norm" in name else array.astype(ml_dtypes.bfloat16)
                oracle[name] = tensors[name].astype(np.float32)
        model.config.save_pretrained(dequantised)
        save_file(oracle, Path(dequantised) / "model.safetensors", metadata={"format": "pt"})
        oracle_model = type(model).from_pretrained(dequantised, dtype=torch.float32).eval()
    model.config.save_pretrained(directory)
    names = sorted(tensors)
    weight_map = {}
    for part in range(files):
        chunk = names[part::files]
        filename = f"model-{part + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, directory / filename, metadata={"format": "pt"})
        weight_map.update({n: filename for n in chunk})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    if scale_fmt:
        config["quantization_config"]["scale_fmt"] = scale_fmt
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory, oracle_model
