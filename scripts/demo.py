"""A first look without a checkpoint: build a tiny DeepSeek-V3-shaped model with random weights,
run a prefill and a few cached decode steps, and print the top tokens of each step."""
import numpy as np

import dsv3_jax


def main() -> None:
    args = dsv3_jax.ModelArgs(
        vocab_size=1024, dim=128, inter_dim=256, moe_inter_dim=64, n_layers=3, n_dense_layers=1, n_heads=4,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=4, n_limited_groups=2,
        score_func="sigmoid", route_scale=2.5, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, max_batch_size=2, max_seq_len=256)
    model = dsv3_jax.build(args, seed=0, compute_dtype="float32")
    prompt = np.array([[1, 17, 42, 99, 7]])
    logits = model.forward(prompt, start_pos=0)
    position = prompt.shape[1]
    for step in range(4):
        top = np.argsort(-np.asarray(logits[0]))[:5]
        print(f"step {step}: top tokens {top.tolist()}")
        logits = model.forward(top[None, :1], start_pos=position)
        position += 1


if __name__ == "__main__":
    main()
