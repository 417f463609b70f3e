"""Pallas (Triton-backend) kernels for DeepSeek-V3's block-wise FP8: standalone, no dsv3_jax imports.

    y, s = act_quant(x, block_size=128, scale_fmt=None)        # x (..., K) -> e4m3 + f32 (..., K/128)
    w = weight_dequant(w_q, s, block_size=128, out_dtype=bf16)  # (M, N) e4m3 + f32 (ceil(M/128), ceil(N/128))
    c = fp8_gemm(a, a_s, b, b_s, out_dtype=bf16)                # (..., K) x (N, K)^T -> (..., N)

On an NVIDIA GPU the kernels compile through Pallas' Triton backend; on any other backend they
run in Pallas interpret mode (same results, slowly). All are jit- and shard_map-compatible.
`pallas_kernels.reference` holds plain-jnp twins used as the tests' oracle.
"""
from .act_quant import act_quant
from .fp8_gemm import GemmConfig, fp8_gemm
from .weight_dequant import weight_dequant

__all__ = ["act_quant", "weight_dequant", "fp8_gemm", "GemmConfig"]
