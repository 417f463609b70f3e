"""The fp8 model path: an HF model quantised block-wise into the hub fp8 layout, loaded with
gemm_impl "bf16" (dequantise, then multiply) and "fp8" (quantised activations, scaled GEMM)."""
import contextlib
import json

import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.errors import CheckpointError
from fp8_checkpoints import save_fp8
from hf_models import hf_model, hf_step_logits
from kernel_checks import kernel_twins

# The dense layers' fp8 kernels (act_quant, fp8_gemm, weight_dequant). Where the model's numbers are
# the subject they run as their jnp twins (tests/test_kernels.py: equal to the kernels bit for bit,
# or within 1e-6 relative); test_fp8_paths_are_exact runs act_quant's and fp8_gemm's kernels in
# Linear, and the absorb model of test_fp8_bf16_gemm_matches_hf_on_dequantised_weights runs
# weight_dequant's kernel in a whole model.
DENSE_KERNELS = ("quantize", "dequantize", "gemm")

# every matrix's input dimension a multiple of 128, as act_quant requires
FP8_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=64)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    # Activations rounded to e4m3 carry ~3.6% rms error into every projection; with random weights
    # of full scale that compounds block after block. A residual-dominated model (as trained ones
    # are) keeps the end-to-end figure meaningful; test_fp8_paths_are_exact pins the arithmetic.
    model = hf_model("v3", seed=11, branch_scale=0.1, **FP8_TINY)
    directory, oracle = save_fp8(model, tmp_path_factory.mktemp("fp8"), files=3)
    return oracle, directory


def _steps(model, tokens, prefill, steps):
    out = [np.asarray(model.forward(tokens[:, :prefill], 0))]
    for i in range(steps):
        out.append(np.asarray(model.forward(tokens[:, prefill + i: prefill + i + 1], prefill + i)))
    return out


def test_fp8_checkpoint_layout(fp8_checkpoint):
    _, directory = fp8_checkpoint
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3
    assert "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv" in index
    model = dsv3_jax.load(directory, compute_dtype="float32", max_batch_size=1, max_seq_len=16)
    assert model.args.quantized
    experts = model.state["moe_layers"]["ffn"]["experts"]["w2"]
    assert experts["weight"][...].dtype == np.dtype("float8_e4m3fn") and experts["scale"][...].shape == (2, 4, 1, 1)
    assert model.state["head"]["weight"][...].dtype == np.float32  # head stays in high precision


def test_fp8_bf16_gemm_matches_hf_on_dequantised_weights(fp8_checkpoint):
    hf, directory = fp8_checkpoint
    tokens = np.random.default_rng(0).integers(0, 512, size=(2, 12))
    expected = hf_step_logits(hf, tokens, 7, 5)
    for attn_impl, kernels in (("absorb", contextlib.nullcontext()), ("naive", kernel_twins(*DENSE_KERNELS))):
        with kernels:
            model = dsv3_jax.load(directory, compute_dtype="float32", gemm_impl="bf16", attn_impl=attn_impl,
                                  max_batch_size=2, max_seq_len=32)
            got = _steps(model, tokens, 7, 5)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(got, expected))
        print(f"fp8 weights, gemm_impl bf16, {attn_impl}: max |logit diff| vs HF = {diff:.2e}")
        assert diff <= 1e-4


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_gemm_within_two_percent(fp8_checkpoint, tmp_path, scale_fmt):
    hf, directory = fp8_checkpoint
    if scale_fmt:
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"]["scale_fmt"] = scale_fmt
        import shutil

        directory = shutil.copytree(directory, tmp_path / "ue8m0")
        (directory / "config.json").write_text(json.dumps(config))
    tokens = np.random.default_rng(1).integers(0, 512, size=(2, 10))
    expected = hf_step_logits(hf, tokens, 7, 3)
    with kernel_twins(*DENSE_KERNELS):
        model = dsv3_jax.load(directory, compute_dtype="float32", gemm_impl="fp8", max_batch_size=2, max_seq_len=32)
        assert model.args.scale_fmt == scale_fmt
        got = _steps(model, tokens, 7, 3)
    rel = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, expected))
    print(f"gemm_impl fp8 (scale_fmt={scale_fmt}): max relative L2 vs HF = {rel:.4f}")
    assert rel < 0.02


def test_fp8_weight_without_scale_is_named(fp8_checkpoint, tmp_path):
    import shutil

    from dsv3_jax.checkpoint.safetensors import SafetensorsFile, save_file

    directory = shutil.copytree(fp8_checkpoint[1], tmp_path / "noscale")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    path = directory / index["weight_map"].pop(victim)
    file = SafetensorsFile(path)
    kept = {n: np.array(file.tensor(n)) for n in file.keys() if n != victim}
    del file
    save_file(kept, path)
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="fp8 weight 'model.layers.0.self_attn.o_proj.weight' has no scale"):
        dsv3_jax.load(directory, compute_dtype="float32")


def test_fp8_paths_are_exact():
    """Linear and the routed-expert GEMM with gemm_impl "fp8" compute exactly
    sum(act_quant(x) * a_s * w * w_s) (float64 oracle on the jnp twins' quantisation). Each computation
    runs jitted, as the model runs it: one program each, not a program per eager op."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from dsv3_jax.model.layers import Linear
    from dsv3_jax.model.moe import grouped_matmul
    from dsv3_jax.sharding import make_mesh
    from pallas_kernels import reference

    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 256)).astype(np.float32) * np.linspace(0.1, 10, 256).astype(np.float32)
    weight = (rng.standard_normal((3, 192, 256)) * 40).astype(jnp.float8_e4m3fn)
    scale = rng.uniform(0.001, 0.01, (3, 2, 2)).astype(np.float32)
    act_quant = jax.jit(reference.act_quant_ref, static_argnums=(1, 2))
    grouped = jax.jit(grouped_matmul, static_argnames=("gemm_impl", "scale_fmt"))
    rows_per_expert = np.array([2, 0, 3], np.int32)  # rows 0-1 -> expert 0, rows 2-4 -> expert 2
    for scale_fmt in (None, "ue8m0"):
        xq, xs = act_quant(x, 128, scale_fmt)
        x_deq = np.asarray(xq, np.float64).reshape(5, 2, 128) * np.asarray(xs, np.float64)[..., None]
        w_deq = np.asarray(weight, np.float64) * np.repeat(np.repeat(scale, 128, 1), 128, 2)[:, :192]
        # Linear (expert 0's matrix), on a 1-device mesh
        linear = Linear(256, 192, fp8=True, param_dtype=jnp.float32, rngs=None)
        linear.weight.set_value(jax.device_put(weight[0]))
        linear.scale.set_value(jax.device_put(scale[0]))
        graphdef, state = nnx.split(linear)
        run = jax.jit(jax.shard_map(lambda s, v: nnx.merge(graphdef, s)(v, gemm_impl="fp8", scale_fmt=scale_fmt),
                                    mesh=make_mesh(1), in_specs=(P(), P()), out_specs=P(), check_vma=False))
        got = np.asarray(run(state, x))
        expected = x_deq.reshape(5, 256) @ w_deq[0].T
        assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
        got = np.asarray(grouped(x, weight, scale, rows_per_expert, gemm_impl="fp8", scale_fmt=scale_fmt))
        rows = x_deq.reshape(5, 256)
        expected = np.concatenate([rows[:2] @ w_deq[0].T, rows[2:] @ w_deq[2].T])
        assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


ROUTED_TOKENS = np.random.default_rng(3).integers(0, 512, size=(2, 10))


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """A model with 16 experts (decoding 2 rows x 2 experts gathers) and 128-multiple dims (the kernel's
    K): {weights: (checkpoint directory, HF's logits of ROUTED_TOKENS)}, HF run once per weights."""
    from hf_models import save

    config = {**FP8_TINY, "n_routed_experts": 16, "n_group": 4, "topk_group": 2}
    hf = hf_model("v3", seed=12, branch_scale=0.5, **config)
    plain = save(hf, tmp_path_factory.mktemp("plain"))
    fp8_dir, oracle = save_fp8(hf, tmp_path_factory.mktemp("fp8_many"), files=2)
    return {"float32": (plain, hf_step_logits(hf, ROUTED_TOKENS, 7, 3)),
            "fp8": (fp8_dir, hf_step_logits(oracle, ROUTED_TOKENS, 7, 3))}


# Every path with fp8 weights, and with float32 ones all but "fused" and "slots": those are held to "ragged" (whose
# float32 case here is against HF) within 1e-5 relative L2 by tests/test_fused_moe.py::test_fused_moe_matches_ragged
# [1-bf16-bf16-float32-*] (weights of the same format and dtype, 1 device, a prefill and a decode step; 4 shared
# experts in the slots).
ROUTED_PATHS = [(impl, weights) for impl in ("kernel", "fused", "slots", "gather", "ragged")
                for weights in ("float32", "fp8") if weights == "fp8" or impl not in ("fused", "slots")]


@pytest.mark.parametrize("moe_impl, weights", ROUTED_PATHS, ids=[f"{impl}-{weights}" for impl, weights in ROUTED_PATHS])
def test_every_routed_expert_path_matches_hf(many_experts, weights, moe_impl):
    """The Pallas grouped kernel (interpret mode), the gather-then-GEMM path and ragged_dot agree with HF."""
    directory, expected = many_experts[weights]
    with kernel_twins(*DENSE_KERNELS):
        model = dsv3_jax.load(directory, compute_dtype="float32", moe_impl=moe_impl, max_batch_size=2, max_seq_len=32)
        got = _steps(model, ROUTED_TOKENS, 7, 3)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(got, expected, strict=True))
    assert diff <= 1e-4
