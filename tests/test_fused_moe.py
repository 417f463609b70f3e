"""moe_impl "fused" (w1+w3+silu*mul in one grouped launch, w2 with the routing weights in its
accumulator) and "slots" (the same kernels over unsorted (token, expert) slots) give the logits of "ragged" on tiny models: 1 and 4 devices, bf16 and fp8 weights,
both gemm_impls, prefill and decode. On a CPU inside shard_map the grouped kernels run as their
jnp twins (see pallas_kernels/_common.interpret_in_shard_map); the kernels themselves are checked
in interpret mode in tests/test_grouped_gemm.py, and on the GPU by tests/test_layer_mix_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import dsv3_jax


def tiny(weights: str) -> dsv3_jax.ModelArgs:
    # every fp8 dimension a multiple of 128 (the grouped kernel's K); 16 experts over up to 4 ranks
    # (16 heads, inter_dim 512, 4 shared experts: fp8 weights split over 4 ranks in whole 128-blocks)
    return dsv3_jax.ModelArgs(vocab_size=256, dim=256, inter_dim=512, moe_inter_dim=128, n_layers=3,
                              n_dense_layers=1, n_heads=16, n_routed_experts=16, n_shared_experts=4,
                              n_activated_experts=3, n_expert_groups=2, n_limited_groups=1, score_func="sigmoid",
                              q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                              v_head_dim=32, max_batch_size=2, max_seq_len=32, dtype=weights)


def prefill_and_decode(model, steps: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.args.vocab_size, (2, 9)).astype(np.int32)
    next_tokens = rng.integers(0, model.args.vocab_size, (steps, 2, 1)).astype(np.int32)
    start = np.array([0, 3], np.int32)
    logits, model.cache = model.step(model.state, model.cache, tokens, start, np.full((2,), 8, np.int32), kv_len=32)
    out, position = [np.asarray(logits)], start + 9
    for token in next_tokens:
        logits, model.cache = model.step(model.state, model.cache, token, position, np.zeros(2, np.int32), kv_len=32)
        out.append(np.asarray(logits))
        position = position + 1
    return out


@pytest.mark.parametrize("impl", ["fused", "slots"])
@pytest.mark.parametrize("num_devices, weights, gemm_impl, compute_dtype, tol", [
    (1, "bf16", "bf16", "float32", 1e-5),
    (4, "bf16", "bf16", "bfloat16", 2e-2),
    (1, "fp8", "bf16", "float32", 1e-5),
    (4, "fp8", "fp8", "float32", 1e-5),
    (4, "fp8", "bf16", "bfloat16", 2e-2),
])
def test_fused_moe_matches_ragged(num_devices, weights, gemm_impl, compute_dtype, tol, impl):
    fused = dsv3_jax.build(tiny(weights), seed=0, num_devices=num_devices, gemm_impl=gemm_impl,
                           compute_dtype=compute_dtype, moe_impl=impl)
    ragged = dsv3_jax.Model(fused.args, fused.graphdef, fused.state, fused.mesh,
                            dsv3_jax.RunOptions.make(fused.options, moe_impl="ragged"))
    for step, (g, w) in enumerate(zip(prefill_and_decode(fused), prefill_and_decode(ragged))):
        assert np.isfinite(g).all(), step
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < tol, f"step {step}: {impl} vs ragged relative L2 {rel:.2e}"


@pytest.mark.parametrize("layout", ["dp-attn", "ep-only"])
def test_slots_in_a_batch_split_layout(layout):
    """"slots" where the rows are gathered for the experts and scattered back (dp-attn: 2 rows padded
    to 4 over 4 devices) or replicated (ep-only): each rank adds only its own experts' slots (other
    ranks' name no expert, -1), so the logits equal "ragged" on one device."""
    args = tiny("bf16")
    one = dsv3_jax.build(args, seed=0, compute_dtype="float32", moe_impl="ragged")
    split = dsv3_jax.build(args, seed=0, num_devices=4, compute_dtype="float32", moe_impl="slots", layout=layout)
    split = dsv3_jax.Model(args, split.graphdef, one.state, split.mesh, split.options)  # the same weights
    for step, (g, w) in enumerate(zip(prefill_and_decode(split), prefill_and_decode(one))):
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < 1e-5, f"step {step}: slots ({layout}, 4 devices) vs ragged (1 device) relative L2 {rel:.2e}"
