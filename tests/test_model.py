"""The forward pass against Hugging Face transformers (float32, random weights), and its own invariants:
naive == absorb, 1 device == 4 devices, cached decoding == a full forward, chunked == one-shot prefill."""
import jax.numpy as jnp
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.model.cache import allocate_cache
from hf_models import LOADED, PREFILL, hf_model, hf_step_logits, save
from zero_models import zero_model

STEPS, TOL = 8, 1e-4
# every loaded model has this one cache shape (hf_models.LOADED), so tests that run the same token
# shapes on a checkpoint under the same options run one compiled step (and the cache is still bigger
# than some calls' batch: test_per_row_start_positions runs single rows)
MAX_BATCH, MAX_SEQ = LOADED["max_batch_size"], LOADED["max_seq_len"]

FAMILIES = {
    # sigmoid, groups + correction bias, q_lora > 0, YaRN on
    "v3": ("v3", {}),
    # no groups, rotate-half rotary layout, YaRN with the attention factor != 1
    "v3_plain": ("v3", dict(n_group=1, topk_group=1, rope_interleave=False, q_lora_rank=16, max_position_embeddings=128,
                           rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                         "mscale": 1.0, "mscale_all_dim": 0.5})),
    # many experts: decoding gathers only the experts in use before the grouped GEMM
    "v3_many_experts": ("v3", dict(n_routed_experts=32, n_group=4, topk_group=2)),
    # softmax, q_lora_rank None, no groups, norm_topk_prob False
    "v2": ("v2", {}),
    # softmax group-limited routing, YaRN with V2-Lite's mscale
    "v2_groups_yarn": ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, max_position_embeddings=256,
                                  routed_scaling_factor=1.5, rope_scaling={
                                      "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF model, saved directory)."""
    out = {}
    for name, (family, overrides) in FAMILIES.items():
        model = hf_model(family, seed=len(out), **overrides)
        out[name] = (model, save(model, tmp_path_factory.mktemp(name)))
    return out


@pytest.fixture(scope="module")
def models(checkpoints):
    """models(name, **choices) -> checkpoint `name` loaded (float32) with those `load` keywords,
    once per module: the tests share each model and its compiled steps. Every test starts with a
    prefill from position 0, which writes every cache position it then reads."""
    loaded = {}

    def get(name: str, num_devices: int = 1, **choices) -> dsv3_jax.Model:
        options = dsv3_jax.RunOptions.make(**{"compute_dtype": "float32", **choices})
        key = (name, num_devices, options)
        if key not in loaded:
            loaded[key] = dsv3_jax.load(checkpoints[name][1], options=options, num_devices=num_devices,
                                        max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ)
        return loaded[key]

    return get


def tokens_for(seed: int, batch: int = 2, length: int = PREFILL + STEPS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, size=(batch, length))


def run_steps(model, tokens: np.ndarray, prefill: int, steps: int) -> list[np.ndarray]:
    out = [np.asarray(model.forward(tokens[:, :prefill], 0))]
    for i in range(steps):
        out.append(np.asarray(model.forward(tokens[:, prefill + i: prefill + i + 1], prefill + i)))
    return out


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_and_decode_match_hf(checkpoints, models, name):
    hf, _ = checkpoints[name]
    tokens = tokens_for(1)
    expected = hf_step_logits(hf, tokens, PREFILL, STEPS)
    got = run_steps(models(name), tokens, PREFILL, STEPS)
    diff = max_diff(got, expected)
    print(f"{name}: max |logit diff| vs HF = {diff:.2e} (logit scale {np.abs(expected[0]).max():.2f})")
    assert diff <= TOL


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_naive_absorb_kernel_and_four_devices_agree_with_hf(checkpoints, models, name):
    hf, _ = checkpoints[name]
    tokens = tokens_for(2)
    expected = hf_step_logits(hf, tokens, PREFILL, STEPS)
    for attn_impl, devices, decode_attn in (("naive", 1, "xla"), ("absorb", 4, "xla"), ("naive", 4, "xla"),
                                            ("absorb", 1, "kernel"), ("absorb", 4, "kernel")):
        model = models(name, attn_impl=attn_impl, num_devices=devices, decode_attn=decode_attn)
        assert model.mesh.devices.size == devices
        diff = max_diff(run_steps(model, tokens, PREFILL, STEPS), expected)
        print(f"{name} {attn_impl} ({decode_attn} decode) on {devices} devices: max |logit diff| vs HF = {diff:.2e}")
        assert diff <= TOL


def test_four_devices_really_split(models):
    model = models("v3", attn_impl="naive", num_devices=4, decode_attn="xla")
    args, state = model.args, model.state
    shard = lambda array: array.sharding.shard_shape(array.shape)  # noqa: E731
    assert shard(state["embed"]["weight"][...]) == (args.vocab_size // 4, args.dim)
    assert shard(state["head"]["weight"][...]) == (args.vocab_size // 4, args.dim)
    experts = state["moe_layers"]["ffn"]["experts"]["w1"]["weight"][...]
    assert shard(experts) == (args.n_moe_layers, args.n_routed_experts // 4, args.moe_inter_dim, args.dim)
    wq_b = state["moe_layers"]["attn"]["wq_b"]["weight"][...]
    assert shard(wq_b)[1] == args.n_heads * args.qk_head_dim // 4
    wo = state["dense_layers"]["attn"]["wo"]["weight"][...]
    assert shard(wo)[2] == args.n_heads * args.v_head_dim // 4
    assert shard(model.cache["k"])[3] == args.n_heads // 4
    assert len({d.id for d in experts.sharding.device_set}) == 4
    # a step returns the cache split as a new cache is, the split its compiled program is keyed by
    # (the same split named otherwise would trace and compile the next step again)
    model.forward(tokens_for(0)[:, :1], 0)
    new = allocate_cache(args, model.options.attn_impl, model.mesh, model.layout, model.options.jnp_dtype)
    assert {name: array.sharding for name, array in model.cache.items()} == {
        name: array.sharding for name, array in new.items()}


def full_forward(model, tokens: np.ndarray, length: int) -> np.ndarray:
    """Logits at position length - 1 of one forward of all of `tokens` from position 0: causal,
    they see tokens[:, :length] only, as a forward of that prefix would; every length runs the one
    compiled step of the tokens' shape."""
    batch = tokens.shape[0]
    logits, model.cache = model.step(model.state, model.cache, jnp.asarray(tokens, jnp.int32),
                                     jnp.zeros(batch, jnp.int32), jnp.full((batch,), length - 1, jnp.int32),
                                     kv_len=model.args.max_seq_len)
    return np.asarray(logits)


# naive attention runs no decode kernel: "xla" names the model test_naive_absorb_kernel_... runs
@pytest.mark.parametrize("attn_impl, decode_attn", [("absorb", "auto"), ("naive", "xla")], ids=["absorb", "naive"])
def test_cached_decoding_equals_full_forward(models, attn_impl, decode_attn):
    model = models("v3", attn_impl=attn_impl, decode_attn=decode_attn)
    tokens = tokens_for(3)
    decoded = run_steps(model, tokens, PREFILL, STEPS)
    checked = (1, 5, 8)  # a sample of the steps
    full = [full_forward(model, tokens, PREFILL + i) for i in checked]
    assert max_diff([decoded[i] for i in checked], full) <= 2e-5


def test_chunked_prefill_from_nonzero_start(models):
    model = models("v2_groups_yarn")
    tokens = tokens_for(4, length=3 * PREFILL)
    one_shot = np.asarray(model.forward(tokens, 0))
    for start in range(0, tokens.shape[1], PREFILL):  # chunks at 0, 7 and 14
        chunked = np.asarray(model.forward(tokens[:, start: start + PREFILL], start))
    assert np.abs(one_shot - chunked).max() <= 2e-5


def test_per_row_start_positions(models):
    """Rows at different positions in one call equal each row run on its own. Every call, of one row or
    both, is PREFILL tokens long: the test runs the prefill's compiled step and its single-row twin."""
    model = models("v3")
    tokens = tokens_for(5, length=2 * PREFILL)
    alone = []
    for row, split in ((0, PREFILL), (1, 3)):
        # caches the row's positions [0, split); those from split on are rewritten by the next call
        model.forward(tokens[row: row + 1, :PREFILL], 0)
        alone.append(np.asarray(model.forward(tokens[row: row + 1, split: split + PREFILL], split))[0])
    model.forward(tokens[:, :PREFILL], 0)  # row 1 then continues from 3, overwriting its positions 3..9
    together = np.asarray(model.forward(np.stack([tokens[0, PREFILL:2 * PREFILL], tokens[1, 3:3 + PREFILL]]),
                                        start_pos=[PREFILL, 3]))
    assert np.abs(together - np.stack(alone)).max() <= 2e-5


def test_bfloat16_close_to_float32(models):
    tokens = tokens_for(6)
    f32, bf16 = models("v3"), models("v3", compute_dtype="bfloat16")
    a, b = np.asarray(f32.forward(tokens, 0)), np.asarray(bf16.forward(tokens, 0))
    assert b.dtype == np.float32
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.05


def _program_size(**changes) -> int:
    """Characters of the lowered (StableHLO) decode step of a tiny model."""
    base = dict(vocab_size=256, dim=64, inter_dim=96, moe_inter_dim=32, n_layers=3, n_dense_layers=1, n_heads=4,
                n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1,
                score_func="sigmoid", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, max_batch_size=2, max_seq_len=64)
    model = zero_model(dsv3_jax.ModelArgs(**{**base, **changes}), compute_dtype="float32")
    zeros = np.zeros((2,), np.int32)
    lowered = model.step.lower(model.state, model.cache, np.zeros((2, 1), np.int32), zeros, zeros, kv_len=64)
    return len(lowered.as_text())


def test_program_does_not_grow_with_depth_or_experts():
    """Layers run in a scan and experts through one grouped GEMM: 4x the depth or the experts
    leaves the compiled program the same size (only shapes in it change)."""
    small = _program_size()
    assert _program_size(n_layers=12, n_dense_layers=4) < 1.02 * small
    assert _program_size(n_routed_experts=32, n_expert_groups=4, n_limited_groups=2) < 1.02 * small


def _loops(jaxpr, inside_kernel=False) -> int:
    """Loops (scan / while) of a jaxpr outside Pallas kernel bodies."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        count += eqn.primitive.name in ("scan", "while")
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                count += _loops(inner)
    return count


@pytest.mark.parametrize("moe_impl", ["kernel", "fused", "slots", "gather", "ragged"])
def test_decode_step_has_no_loops_but_the_layer_scans(moe_impl):
    """A loop inside a layer runs at every layer of every step (each iteration its own kernels):
    the only loops of a step are the two layer scans, whatever the routed-expert path."""
    import jax

    args = dsv3_jax.ModelArgs(vocab_size=256, dim=128, inter_dim=256, moe_inter_dim=128, n_layers=3, n_dense_layers=1,
                              n_heads=4, n_routed_experts=16, n_shared_experts=1, n_activated_experts=2,
                              n_expert_groups=2, n_limited_groups=1, score_func="sigmoid", q_lora_rank=128,
                              kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
                              max_batch_size=2, max_seq_len=64)
    for decode_attn in ("xla", "kernel"):
        model = zero_model(args, compute_dtype="float32", moe_impl=moe_impl, decode_attn=decode_attn)
        zeros = np.zeros((2,), np.int32)
        jaxpr = jax.make_jaxpr(lambda *a: model.step(*a, kv_len=64))(
            model.state, model.cache, np.zeros((2, 1), np.int32), zeros, zeros)
        assert _loops(jaxpr.jaxpr) == 2


def test_step_is_profiled_by_paper_noun():
    """Every paper noun of a step has its named scope, so a profile of a decode step reads by them."""
    import jax

    args = dsv3_jax.ModelArgs(vocab_size=256, dim=128, inter_dim=256, moe_inter_dim=128, n_layers=2, n_dense_layers=1,
                              n_heads=4, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
                              kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
                              max_batch_size=1, max_seq_len=64)
    model = zero_model(args, compute_dtype="float32")
    zeros = np.zeros((1,), np.int32)
    text = model.step.lower(model.state, model.cache, np.zeros((1, 1), np.int32), zeros, zeros,
                            kv_len=64).as_text(debug_info=True)
    for scope in ("embed", "attn_norm", "attention", "ffn_norm", "mlp", "gate", "routed_experts", "shared_experts",
                  "cache_write", "norm", "head"):
        assert f"/{scope}/" in text, scope
