"""compute_dtype="float32" means float32 on every backend: the step is traced under
`RunOptions.precision_scope` (matmul precision "highest"), so a GPU does not run its float32 dots as
TF32. On the CPU the lowered step shows the precision; on a GPU the logits match a float64 oracle
(HF in float64) within 1e-5 of the logit scale, which TF32 (10-bit mantissa, ~5e-4 relative per
product) would miss by far."""
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.options import RunOptions
from dsv3_jax.sharding import make_mesh
from zero_models import zero_model

REL_TOL = 1e-5


def test_float32_option_sets_highest_precision():
    assert RunOptions(compute_dtype="float32").matmul_precision == "highest"
    assert RunOptions(compute_dtype="bfloat16").matmul_precision is None


@pytest.mark.parametrize("dtype, highest", [("float32", True), ("bfloat16", False)])
def test_lowered_step_dots_carry_the_precision(dtype, highest):
    import jax

    args = dsv3_jax.ModelArgs(vocab_size=256, dim=128, inter_dim=256, moe_inter_dim=128, n_layers=2, n_dense_layers=1,
                              n_heads=2, n_routed_experts=4, n_shared_experts=1, n_activated_experts=2,
                              q_lora_rank=0, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16,
                              v_head_dim=16, max_batch_size=1, max_seq_len=16)
    model = zero_model(args, compute_dtype=dtype)  # the lowered step depends on the weights' shapes only
    zeros = np.zeros((1,), np.int32)
    text = model.step.lower(model.state, model.cache, np.zeros((1, 4), np.int32), zeros, zeros, kv_len=16).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line or "ragged_dot" in line]
    assert dots
    with_highest = [line for line in dots if "HIGHEST" in line]
    if highest:
        assert len(with_highest) == len(dots), [d for d in dots if "HIGHEST" not in d][:2]
    else:
        assert not with_highest


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_float32_logits_match_a_float64_oracle(tmp_path, backend):
    import jax

    torch = pytest.importorskip("torch")  # the oracle's test-only packages, imported here: the module's
    from hf_models import LOADED, PREFILL, hf_model, hf_step_logits, save  # other tests (and collection) need neither

    hf = hf_model("v3", seed=3)
    directory = save(hf, tmp_path / "v3")
    tokens = np.random.default_rng(0).integers(0, 512, size=(2, 12))
    hf.set_experts_implementation("eager")  # the grouped_mm path has no float64
    steps = tokens.shape[1] - PREFILL
    expected = hf_step_logits(hf.to(torch.float64), tokens, PREFILL, steps)  # float64 all through, rounded at the end
    mesh = make_mesh(1, jax.devices(backend))
    model = dsv3_jax.load(directory, mesh=mesh, compute_dtype="float32", **LOADED)  # hf_models.LOADED: shared steps
    got = [np.asarray(model.forward(tokens[:, :PREFILL], 0))]
    got += [np.asarray(model.forward(tokens[:, PREFILL + i: PREFILL + i + 1], PREFILL + i)) for i in range(steps)]
    scale = max(float(np.abs(e).max()) for e in expected)
    error = max(float(np.abs(g - e).max()) for g, e in zip(got, expected)) / scale
    print(f"{backend}: max |float32 - float64| / max |logit| = {error:.2e}")
    assert error < REL_TOL
