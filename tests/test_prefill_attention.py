"""Prefill chunks through flash attention (`RunOptions.prefill_attn`) against Hugging Face and the dense scores.

Chunks of >= FLASH_MIN_QUERIES queries run flash attention over per-head keys and values: the naive form's
cached ones, or the absorbed form's latents expanded through wkv_b. Prompts here straddle the jnp twin's
64-key blocks, start at nonzero positions and leave rows at unequal positions, so a wrong mask, block
boundary or expansion shows in the logits (HF's logits move by O(1) when one key is dropped or added)."""
import jax
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.model.attention import FLASH_MIN_QUERIES, flash_impl
from dsv3_jax.model.cache import cache_window

torch = pytest.importorskip("torch")  # the oracle (test extra)
pytest.importorskip("transformers")
from hf_models import hf_model, save  # noqa: E402
from zero_models import zero_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = hf_model("v3", seed=21, max_position_embeddings=512)
    return hf, save(hf, tmp_path_factory.mktemp("v3"))


@pytest.fixture(scope="module")
def hf_chunks(checkpoint):
    """Two rows of tokens, the chunk boundaries and HF's logits after each chunk (one oracle run for all
    the cases)."""
    hf, _ = checkpoint
    tokens = np.random.default_rng(22).integers(0, 512, size=(2, 161))
    splits = [0, 70, 160, 161]
    return tokens, splits, hf_logits(hf, tokens, splits)


def hf_logits(hf, tokens: np.ndarray, splits: list[int]) -> list[np.ndarray]:
    """HF's last-position logits after each chunk [splits[i], splits[i + 1]) through its cache."""
    out, cache = [], None
    with torch.no_grad():
        for start, end in zip(splits[:-1], splits[1:]):
            result = hf(torch.as_tensor(tokens[:, start:end]), past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            out.append(result.logits[:, -1].float().numpy())
    return out


def test_flash_is_taken_for_cached_prefill_chunks_only():
    assert flash_impl("auto", FLASH_MIN_QUERIES, cached=True) == "auto"
    assert flash_impl("kernel", 200, cached=True) == "mosaic"
    assert flash_impl("jnp", 200, cached=True) == "jnp"
    assert flash_impl("auto", FLASH_MIN_QUERIES - 1, cached=True) is None  # decode, verification
    assert flash_impl("dense", 200, cached=True) is None
    assert flash_impl("auto", 200, cached=False) is None  # a full-sequence pass (training) keeps its gradient


@pytest.mark.parametrize("attn_impl,devices", [("absorb", 1), ("naive", 1), ("absorb", 4)])
def test_flash_prefill_chunks_match_hf(checkpoint, hf_chunks, attn_impl, devices):
    """Chunks of 70 and 90 tokens (past the 64-key block, the second from position 70) and a decode step."""
    if len(jax.devices()) < devices:
        pytest.skip(f"needs {devices} devices (the CPU suite forces 4 host devices)")
    _, directory = checkpoint
    tokens, splits, expected = hf_chunks
    model = dsv3_jax.load(directory, compute_dtype="float32", attn_impl=attn_impl, num_devices=devices,
                          max_batch_size=2, max_seq_len=256, prefill_attn="jnp")
    got = [np.asarray(model.forward(tokens[:, a:b], a)) for a, b in zip(splits[:-1], splits[1:])]
    diff = max(float(np.abs(g - e).max()) for g, e in zip(got, expected))
    print(f"{attn_impl} on {devices} devices, flash prefill: max |logit diff| vs HF = {diff:.2e}")
    assert diff <= TOL


def test_rows_at_unequal_positions(checkpoint):
    """One call with rows at positions 0 and 45 equals each row run in a call whose rows share its
    position (flash and dense alike). The chunks are 70 tokens (past the 64-key block), ending in the
    same 128-position window: every call is one compiled step (per prefill_attn), the first chunk's of
    test_flash_prefill_chunks_match_hf."""
    _, directory = checkpoint
    tokens = np.random.default_rng(23).integers(0, 512, size=(2, 120))
    for prefill_attn in ("jnp", "dense"):
        model = dsv3_jax.load(directory, compute_dtype="float32", max_batch_size=2, max_seq_len=256,
                              prefill_attn=prefill_attn)
        # also caches row 1's first 45 (its positions from 45 on are rewritten by the next call)
        alone_0 = np.asarray(model.forward(tokens[:, :70], 0))[0]
        alone_1 = np.asarray(model.forward(tokens[:, 45:115], 45))[1]
        model.forward(tokens[:, :70], 0)  # each row's cache holds its own first 70 again
        together = np.asarray(model.forward(np.stack([tokens[0, :70], tokens[1, 45:115]]), start_pos=[0, 45]))
        assert np.abs(together - np.stack([alone_0, alone_1])).max() <= 2e-5, prefill_attn


def logits_at(model, tokens: np.ndarray, indices) -> np.ndarray:
    """`model`'s logits at each of `indices` of a one-row prompt from position 0: one compiled step, run
    once per index (each run rewrites the same cache entries)."""
    out = []
    for index in indices:
        logits, model.cache = model.step(model.state, model.cache, np.asarray(tokens, np.int32),
                                         np.zeros((1,), np.int32), np.full((1,), index, np.int32),
                                         kv_len=cache_window(tokens.shape[1], model.args.max_seq_len))
        out.append(np.asarray(logits)[0])
    return np.stack(out)


def test_kernel_in_interpret_mode_matches_the_twin_in_bfloat16(tmp_path):
    """The Mosaic GPU kernel (interpret mode on the CPU) inside the model, at head dims it takes (d_qk 64,
    d_v 64): bf16 logits within bf16 noise of the jnp twin's, at an early, a middle and the last query
    (a wrong mask or scale moves them by O(1)). One (dense) layer: the kernel is the subject, and the
    MoE layers would only add their compile time (and routing flips to the noise)."""
    directory = save(hf_model("v3", seed=25, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
                              num_hidden_layers=1), tmp_path)
    tokens = np.random.default_rng(24).integers(0, 512, size=(1, 64))
    logits = {}
    for prefill_attn in ("kernel", "jnp"):
        model = dsv3_jax.load(directory, compute_dtype="bfloat16", max_batch_size=1, max_seq_len=128,
                              prefill_attn=prefill_attn)
        logits[prefill_attn] = logits_at(model, tokens, (7, 31, 63))
    for got, ref in zip(logits["kernel"], logits["jnp"]):
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def _step_temp_bytes(model, length: int) -> int:
    """Temporary bytes of `model`'s compiled prefill step of one row of `length` tokens over a cache of
    `length` positions (window = length). The step's program depends on the cache's shape, not on the
    max_seq_len the model was built with: one build serves every length."""
    zeros = np.zeros((1,), np.int32)
    cache = {name: array[:, :, :length] for name, array in model.cache.items()}
    compiled = model.step.lower(model.state, cache, np.zeros((1, length), np.int32), zeros, zeros + length - 1,
                                kv_len=length).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_prefill_step_memory_does_not_grow_with_queries_times_keys():
    """From the compiled step: 4x the prompt (and window) costs the flash step about 4x the temporaries
    (linear: activations, per-head keys), the dense step about 16x (its float32 (query, key) scores).
    One (dense) layer: the attention's temporaries are the subject; an MoE layer's would only add its
    compile time."""
    args = dsv3_jax.ModelArgs(vocab_size=256, dim=64, inter_dim=96, moe_inter_dim=32, n_layers=1, n_dense_layers=1,
                              n_heads=4, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                              max_batch_size=1, max_seq_len=2048)
    ratio = {}
    for prefill_attn in ("jnp", "dense"):  # the program depends on the weights' shapes only: zeros will do
        model = zero_model(args, compute_dtype="float32", prefill_attn=prefill_attn)
        ratio[prefill_attn] = _step_temp_bytes(model, 2048) / _step_temp_bytes(model, 512)
    flash, dense = ratio["jnp"], ratio["dense"]
    print(f"temporaries 512 -> 2048 tokens: flash x{flash:.1f}, dense x{dense:.1f}")
    assert flash < 6 and dense > 10
