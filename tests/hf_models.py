"""Tiny Hugging Face DeepSeek models with random weights: the parity oracle (float32, CPU)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # test-only packages: a module that needs them is skipped without
transformers = pytest.importorskip("transformers")

# The oracles' models are tiny: a second intra-op thread speeds nothing up, and where the cores are
# busy (test workers, XLA compiling) its spin-waiting costs several times the work itself.
torch.set_num_threads(1)

V3_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    norm_topk_prob=True, max_position_embeddings=256, num_nextn_predict_layers=0,
    rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    rope_theta=10000.0, rms_norm_eps=1e-6,
)
# The cache shape and prompt length at which test files load these tiny models: a step's compiled
# program depends on the config, the mesh, the options and the shapes of the cache and the tokens,
# not on the weights, so files that load V3_TINY / V2_TINY as LOADED and prefill PREFILL tokens per
# row (then decode single tokens) share their compiled steps through the session's compilation cache.
LOADED = dict(max_batch_size=2, max_seq_len=32)
PREFILL = 7
V2_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    n_shared_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1, topk_method="greedy",
    routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, norm_topk_prob=False, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
    scoring_func="softmax",
)


def hf_model(family: str = "v3", seed: int = 0, branch_scale: float = 1.0, **overrides) -> transformers.PreTrainedModel:
    """A float32 HF model whose every parameter (gate bias included) is random at a scale that
    makes routing and attention decisive, so that a wrong port shows in the logits.

    branch_scale < 1 shrinks the output projections (o_proj, down_proj), so that the residual
    stream dominates each block's contribution, as in trained models."""
    torch.manual_seed(seed)
    if family == "v3":
        config = transformers.DeepseekV3Config(**{**V3_TINY, **overrides})
        model = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.DeepseekV2Config(**{**V2_TINY, **overrides})
        model = transformers.DeepseekV2ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if "norm" in name:
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            elif "e_score_correction_bias" in name:
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
            elif "embed_tokens" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            else:
                fan_in = tensor.shape[-1]
                scale = branch_scale if ("o_proj" in name or "down_proj" in name) else 1.0
                tensor.copy_(scale * torch.randn(tensor.shape, generator=generator) / math.sqrt(fan_in))
    return model.eval()


def save(model, directory: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return Path(directory)


def hf_step_logits(model, tokens: np.ndarray, prefill: int, steps: int) -> list[np.ndarray]:
    """HF logits of the last position after a prefill of `prefill` tokens, then after each of
    `steps` single tokens, through HF's own cache."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    out = []
    with torch.no_grad():
        result = model(ids[:, :prefill], use_cache=True)
        out.append(result.logits[:, -1].float().numpy())
        cache = result.past_key_values
        for i in range(steps):
            result = model(ids[:, prefill + i: prefill + i + 1], past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            out.append(result.logits[:, -1].float().numpy())
    return out
