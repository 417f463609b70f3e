"""GPU: every mix of dense and MoE layers runs prefill and decode, with bf16 and fp8 weights and both
gemm_impls, and the routed-expert paths (Pallas grouped kernel, the fused swiglu + row-scaled down
kernels over sorted rows and over unsorted slots, `ragged_dot`) give the same logits;
`test_fused_decode_time` times kernel vs fused vs slots decode.

Regression guard for the fp8 crash of one V3 MoE layer: Pallas' Triton lowering addressed a 1-byte
ref of 2^31..2^32 elements (256 experts x 2048 x 7168 fp8) with 32-bit offsets, so one MoE layer
faulted (CUDA_ERROR_ILLEGAL_ADDRESS) and two gave NaN. `test_v3_expert_stack_fp8` runs that size.

`pytest -m gpu` runs two mixes with MoE layers (no dense stack; both stacks, a MoE stack of two) and
one without; `pytest -m gpu_slow -s tests/test_layer_mix_gpu.py` the other mixes, the V3 expert
stacks and the decode timings (-s shows them).
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.config import ModelArgs
from kernel_checks import kernel_twins

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MIXES = [(dense, moe) for dense in (0, 1, 3) for moe in (0, 1, 2) if dense + moe]
FAST_MIXES = [(0, 1), (1, 2), (1, 0)]  # under `-m gpu`; the others under `-m gpu_slow`
COMBOS = [("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8")]  # (weights, gemm_impl)


def mixes(with_moe: bool) -> list:
    return [pytest.param(dense, moe, marks=pytest.mark.gpu if (dense, moe) in FAST_MIXES else pytest.mark.gpu_slow)
            for dense, moe in MIXES if (moe > 0) == with_moe]


def prefill_and_decode(model, batch: int = 2, length: int = 40, steps: int = 2) -> list[np.ndarray]:
    """Logits of a prefill and of `steps` single-token steps (each row at its own position). The
    tokens are drawn, not sampled, so that two paths whose logits differ by rounding get the same."""
    args = model.args
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab_size, (batch, length)).astype(np.int32)
    next_tokens = rng.integers(0, args.vocab_size, (steps, batch, 1)).astype(np.int32)
    start = np.arange(batch, dtype=np.int32)  # unequal positions per row
    last = np.full((batch,), length - 1, np.int32)
    logits, model.cache = model.step(model.state, model.cache, tokens, start, last, kv_len=64)
    out = [np.asarray(logits)]
    position = start + length
    for token in next_tokens:
        logits, model.cache = model.step(model.state, model.cache, token, position, np.zeros_like(start), kv_len=64)
        out.append(np.asarray(logits))
        position = position + 1
    return out


def variant(model, **choices) -> dsv3_jax.Model:
    """`model`'s weights under other run options."""
    return dsv3_jax.Model(model.args, model.graphdef, model.state, model.mesh,
                          dsv3_jax.RunOptions.make(model.options, **choices))


def assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.isfinite(g).all() and np.isfinite(w).all(), f"{what}: non-finite logits at step {step}"
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < 2e-2, f"step {step}: {what} relative L2 {rel:.2e}"


def compare_moe_impls(model, gemm_impl: str) -> None:
    """The grouped kernel, fused and slots against ragged_dot, on `model`'s weights."""
    want = prefill_and_decode(variant(model, gemm_impl=gemm_impl, moe_impl="ragged"))
    for impl in ("kernel", "fused", "slots"):
        assert_close(prefill_and_decode(variant(model, gemm_impl=gemm_impl, moe_impl=impl)), want, f"{impl} vs ragged")


def mix_args(dense: int, moe: int, weights: str) -> ModelArgs:
    # V3's architecture at a size that compiles fast (every fp8 dimension a multiple of 128)
    return ModelArgs.from_reference_json(CONFIGS / "config_671B.json").replace(
        n_layers=dense + moe, n_dense_layers=dense, dtype=weights, max_batch_size=2, max_seq_len=128,
        vocab_size=4096, dim=1024, inter_dim=2048, moe_inter_dim=512, n_heads=8, n_routed_experts=32,
        n_expert_groups=4, n_limited_groups=2, q_lora_rank=256)


@pytest.fixture(scope="module")
def mix_model():
    """mix_model(dense, moe, weights) -> one random model per mix and weight format (both gemm_impls of
    fp8 weights share it)."""
    models = {}

    def get(dense: int, moe: int, weights: str):
        key = (dense, moe, weights)
        if key not in models:
            models[key] = dsv3_jax.build(mix_args(dense, moe, weights), seed=0)
        return models[key]

    return get


@pytest.mark.parametrize("weights, gemm_impl", COMBOS)
@pytest.mark.parametrize("dense, moe", mixes(with_moe=True))
def test_layer_mix(mix_model, dense, moe, weights, gemm_impl):
    compare_moe_impls(mix_model(dense, moe, weights), gemm_impl)


@pytest.mark.parametrize("weights, gemm_impl", COMBOS)
@pytest.mark.parametrize("dense, moe", mixes(with_moe=False))
def test_dense_layer_mix(mix_model, dense, moe, weights, gemm_impl):
    """No MoE layer: the model (its fp8 kernels, the MLA decode kernel) against its XLA version."""
    model = variant(mix_model(dense, moe, weights), gemm_impl=gemm_impl)
    got = prefill_and_decode(model)
    with kernel_twins(everywhere=True):
        want = prefill_and_decode(variant(model))
    assert_close(got, want, "kernels vs their jnp twins")


@pytest.mark.gpu_slow
@pytest.mark.parametrize("dense, moe", [(0, 1), (1, 1), (1, 2)])
@pytest.mark.parametrize("gemm_impl", ["bf16", "fp8"])
def test_v3_expert_stack_fp8(dense, moe, gemm_impl):
    """The V3 shape's expert stacks (3.76e9 fp8 bytes per layer and weight) with 1 and 2 MoE layers."""
    args = ModelArgs.from_reference_json(CONFIGS / "config_671B.json").replace(
        n_layers=dense + moe, n_dense_layers=dense, max_batch_size=2, max_seq_len=128)
    assert args.quantized
    compare_moe_impls(dsv3_jax.build(args, seed=0), gemm_impl)
    jax.clear_caches()


@pytest.mark.gpu_slow
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_fused_decode_time(weights):
    """V2-Lite's MoE shape (64 experts, top-6, 2048 x 1408), 1 dense + 4 MoE layers: ms per b=1 decode
    step of moe_impl kernel vs fused (printed; the fused path must not be slower by more than noise)."""
    import time

    args = ModelArgs.from_reference_json(CONFIGS / "config_16B.json").replace(
        n_layers=5, n_dense_layers=1, inter_dim=11008, dtype=weights, max_batch_size=1, max_seq_len=128)  # 128-multiple
    kernel = dsv3_jax.build(args, seed=0, gemm_impl="fp8" if weights == "fp8" else "bf16", moe_impl="kernel")
    times = {}
    for impl in ("kernel", "fused", "slots") * 2:  # interleaved: the second round is the one kept
        model = dsv3_jax.Model(args, kernel.graphdef, kernel.state, kernel.mesh,
                               dsv3_jax.RunOptions.make(kernel.options, moe_impl=impl))
        token, position, last = np.zeros((1, 1), np.int32), np.full((1,), 64, np.int32), np.zeros((1,), np.int32)
        logits, model.cache = model.step(model.state, model.cache, token, position, last, kv_len=128)
        jax.block_until_ready(logits)
        start, steps = time.perf_counter(), 50
        for _ in range(steps):
            logits, model.cache = model.step(model.state, model.cache, token, position, last, kv_len=128)
        jax.block_until_ready(logits)
        times[impl] = (time.perf_counter() - start) / steps * 1e3
    print(f"\nV2-Lite MoE shape, 1 dense + 4 MoE layers, {weights}, decode b=1: "
          f"kernel {times['kernel']:.3f} ms, fused {times['fused']:.3f} ms, slots {times['slots']:.3f} ms per step")
    assert times["fused"] < 1.2 * times["kernel"] and times["slots"] < 1.2 * times["kernel"]
