"""Pallas kernels for DeepSeek-V3's block-wise FP8 and MLA: standalone, no dsv3_jax imports.

    y, s = act_quant(x, block_size=128, scale_fmt=None)        # x (..., K) -> e4m3 + f32 (..., K/128)
    w = weight_dequant(w_q, s, block_size=128, out_dtype=bf16)  # (M, N) e4m3 + f32 (ceil(M/128), ceil(N/128))
    c = fp8_gemm(a, a_s, b, b_s, out_dtype=bf16)                # (..., K) x (N, K)^T -> (..., N)
    c = dequant_gemm(x, b, b_s)                                 # bf16 x times the e4m3 weight dequantized, f32
    y = grouped_gemm(x, w, group_sizes, w_scale=None)           # rows sorted by group x (G, N, K)^T
    y = grouped_gemm_mgpu(x, w, group_sizes)                    # the same on wgmma (Mosaic GPU, bf16)
    h = grouped_gemm_swiglu(x, w1, w3, group_sizes)             # silu(x W1_g^T) * (x W3_g^T), one launch
    h = grouped_swiglu_mgpu(x, w1, w3, group_sizes)             # the same on wgmma (Mosaic GPU, bf16)
    o = mla_decode(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, new_kv, new_pe, scale=s)
    o = flash_attention(q, k, v, positions, scale=s, kv_start=0)  # causal prefill, no (S, T) scores
    w, i = route(logits, bias, topk=k, n_groups=g, topk_groups=kg, score_func="sigmoid")  # MoE routing
    y, h = rms_norm(x, weight, eps=1e-6, residual=r)              # RMSNorm of x + r, and x + r, one launch
    y, h, logits = rms_norm(x, weight, eps=1e-6, residual=r, gate=wg)  # and the MoE gate's logits of y
    q, kv = projection.norm_project(x, [wq, wkv_a], norm=w)       # RMSNorm(x) W_i^T for each weight, one launch

On an NVIDIA GPU the kernels compile through Pallas' Triton backend; on Hopper (sm_90) fp8_gemm at
M >= 128 (gemm_mgpu; fp8_gemm_path says which), grouped_gemm and grouped_gemm_swiglu for prefill-sized
steps (grouped_mgpu; grouped_gemm_backend says which) and flash_attention (flash_attention_mgpu) run on Pallas Mosaic
GPU kernels (TMA, wgmma). On any other backend they run in Pallas interpret mode (same results,
slowly), except flash_attention, which runs its jnp twin there (an online softmax over key blocks).
All are jit- and shard_map-compatible. `pallas_kernels.reference` holds plain-jnp twins used as the
tests' oracle. The modules are named for what they do (quantize, dequantize, gemm, grouped, mla,
flash_attention, norm, projection, router), so that each stays reachable beside the function it exports. FP8_BLOCK,
FP8_DTYPE and cdiv are the one definition the model uses too.
"""
from ._common import BLOCK as FP8_BLOCK, FP8 as FP8_DTYPE, cdiv, use_interpret
from .dequantize import weight_dequant
from .flash_attention import flash_attention
from .flash_attention_mgpu import FlashTiles
from .gemm import GemmConfig, dequant_gemm, fp8_gemm, fp8_gemm_path, fp8_gemm_reads_stacks_in_place
from .gemm_mgpu import MosaicGemmConfig
from .grouped import grouped_gemm, grouped_gemm_backend, grouped_gemm_swiglu
from .grouped_mgpu import MOSAIC_MIN_ROWS, SWIGLU_TILES, MosaicTiles, grouped_gemm_mgpu, grouped_swiglu_mgpu
from .mla import mla_decode
from .norm import rms_norm
from .quantize import act_quant
from .router import route

__all__ = ["FP8_BLOCK", "FP8_DTYPE", "FlashTiles", "GemmConfig", "MOSAIC_MIN_ROWS", "MosaicGemmConfig", "MosaicTiles",
           "SWIGLU_TILES",
           "act_quant", "cdiv", "dequant_gemm", "flash_attention", "fp8_gemm", "fp8_gemm_path",
           "fp8_gemm_reads_stacks_in_place", "grouped_gemm", "grouped_gemm_backend", "grouped_gemm_mgpu",
           "grouped_gemm_swiglu", "grouped_swiglu_mgpu", "mla_decode", "rms_norm", "route", "use_interpret", "weight_dequant"]
