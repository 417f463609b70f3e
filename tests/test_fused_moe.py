"""moe_impl "fused" (w1+w3+silu*mul in one grouped launch, w2 with the routing weights in its
accumulator) and "slots" (the same kernels over unsorted (token, expert) slots) give the logits of
"ragged" on tiny models: 1 and 4 devices, bf16 and fp8 weights, both gemm_impls, prefill and decode.
On a CPU the grouped kernels run in Pallas interpret mode inside the model's step (the model's
shard_map does not check varying axes); the kernels alone are checked in tests/test_grouped_gemm.py,
and in the model on the GPU by tests/test_moe_paths_gpu.py and tests/test_layer_mix_gpu.py."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.model.moe import RANK_BY_PAIRS_MAX, sorted_positions
from dsv3_jax.sharding import make_mesh
from kernel_checks import kernel_twins
from pallas_kernels import FP8_BLOCK, FP8_DTYPE
from zero_models import model_shapes

# Every model here runs the dense layers' fp8 kernels (Linear: act_quant, fp8_gemm, weight_dequant)
# as their jnp twins (tests/test_kernels.py proves the kernels equal to them: bit for bit, or within
# 1e-6 relative), so fused and slots differ from the ragged reference only in the routed experts:
# the grouped kernels under test, in interpret mode, against ragged_dot.
DENSE_KERNELS = ("quantize", "dequantize", "gemm")


def tiny(weights: str) -> dsv3_jax.ModelArgs:
    # every fp8 dimension a multiple of 128 (the grouped kernel's K); 16 experts over up to 4 ranks
    # (16 heads, inter_dim 512, 4 shared experts: fp8 weights split over 4 ranks in whole 128-blocks)
    return dsv3_jax.ModelArgs(vocab_size=256, dim=256, inter_dim=512, moe_inter_dim=128, n_layers=3,
                              n_dense_layers=1, n_heads=16, n_routed_experts=16, n_shared_experts=4,
                              n_activated_experts=3, n_expert_groups=2, n_limited_groups=1, score_func="sigmoid",
                              q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                              v_head_dim=32, max_batch_size=2, max_seq_len=32, dtype=weights)


def step_inputs(vocab_size: int, steps: int):
    """The prompt rows (2 x 9 tokens, starting at positions 0 and 3) and the `steps` decode tokens."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab_size, (2, 9)).astype(np.int32)
    next_tokens = rng.integers(0, vocab_size, (steps, 2, 1)).astype(np.int32)
    return tokens, next_tokens, np.array([0, 3], np.int32)


# XLA's CPU backend optimisations, which conftest turns off for the session (they cost compile time)
OPTIMIZED = {"xla_backend_optimization_level": 1}


def prefill_and_decode(model, steps: int = 1) -> list[np.ndarray]:
    """Logits of a prefill (rows at different starts) and of `steps` decode steps. One decode step
    suffices: another would run the same compiled step, and the experts keep no state across steps.
    A "slots" prefill runs the same program compiled with the backend optimisations on: in interpret
    mode its kernels loop over a grid step per (slot, column tile), which unoptimised code runs far
    slower than the optimisations take to compile."""
    tokens, next_tokens, start = step_inputs(model.args.vocab_size, steps)
    prefill = (model.state, model.cache, tokens, start, np.full((2,), 8, np.int32))
    if model.options.moe_impl == "slots":
        logits, model.cache = model.step.lower(*prefill, kv_len=32).compile(compiler_options=OPTIMIZED)(*prefill)
    else:
        logits, model.cache = model.step(*prefill, kv_len=32)
    out, position = [np.asarray(logits)], start + 9
    for token in next_tokens:
        logits, model.cache = model.step(model.state, model.cache, token, position, np.zeros(2, np.int32), kv_len=32)
        out.append(np.asarray(logits))
        position = position + 1
    return out


def one_pass_logits(model, steps: int = 1) -> list[np.ndarray]:
    """The logits `prefill_and_decode` gives, from one prefill over the prompt and the decode tokens
    together, read at the prompt's last index and at each decode token's (attention is causal, and
    the routed experts compute each token on its own): the reference's two results from one compiled
    step, and its decode logits from no cache."""
    tokens, next_tokens, start = step_inputs(model.args.vocab_size, steps)
    every = np.concatenate([tokens, *next_tokens], axis=1)
    out = []
    for last in range(8, 9 + steps):
        logits, model.cache = model.step(model.state, model.cache, every, start, np.full((2,), last, np.int32),
                                         kv_len=32)
        out.append(np.asarray(logits))
    return out


@pytest.fixture(scope="module")
def random_model():
    """random_model(weights) -> the one random model of that weight format (1 device, float32, moe_impl
    "ragged"), made once for the module: for bf16, `dsv3_jax.build(tiny("bf16"), seed=0, ...)`; for fp8,
    its `fp8_twin`. Other configurations take its weights with `same_weights` (a build on another mesh,
    or in bfloat16, makes the same numbers, there or rounded to bfloat16; its random init is a program
    per mesh and dtype)."""
    made = {}

    def get(weights: str) -> dsv3_jax.Model:
        if weights not in made:
            with kernel_twins(*DENSE_KERNELS):
                if "bf16" not in made:
                    made["bf16"] = dsv3_jax.build(tiny("bf16"), seed=0, compute_dtype="float32", moe_impl="ragged")
                if weights not in made:
                    made[weights] = fp8_twin(made["bf16"])
        return made[weights]

    return get


@pytest.fixture(scope="module")
def ragged(random_model):
    """ragged(num_devices, weights, gemm_impl, compute_dtype) -> (model, reference logits): the model of
    that configuration (moe_impl "ragged"), `random_model(weights)`'s weights placed on the mesh and held
    in the configuration's dtypes, and the logits "ragged" gives with them, made and run once per
    configuration (`one_pass_logits`) and shared by every implementation compared with it. With fp8
    weights and gemm_impl "bf16" the logits are those of the bf16-format model of the weights it
    computes with (`dequantized`): the same numbers, from the bf16 configuration's compiled step."""
    built = {}

    def get(num_devices: int, weights: str, gemm_impl: str, compute_dtype: str):
        key = (num_devices, weights, gemm_impl, compute_dtype)
        if key not in built:
            with kernel_twins(*DENSE_KERNELS):
                choices = dict(gemm_impl=gemm_impl, compute_dtype=compute_dtype)
                model = same_weights(random_model(weights), make_mesh(num_devices), **choices)
                oracle = model
                if weights == "fp8" and gemm_impl == "bf16":
                    # a step of gemm_impl "bf16" computes with the fp8 weights times their scales (rounded to
                    # the compute dtype): the bf16-format model of those weights, the bf16 configuration's step
                    oracle = same_weights(dequantized(random_model("fp8"), random_model("bf16")), model.mesh,
                                          **choices)
                built[key] = model, one_pass_logits(oracle)
        return built[key]

    return get


def fp8_twin(model: dsv3_jax.Model) -> dsv3_jax.Model:
    """The `tiny("fp8")` model with `model`'s (a `tiny("bf16")` build's) embedding, norms, gates and head,
    and fp8 projections and experts drawn as `dsv3_jax.build` draws them: random e4m3 bytes with the top
    exponent bit cleared (magnitude < 2, no NaN), every 128x128 block scaled by 1/sqrt(in_features).
    Made in numpy: no random-init program of its own to compile."""
    args = tiny("fp8").replace(gate_bias=model.args.gate_bias)
    graphdef, shapes = model_shapes(args, model.options.jnp_dtype)
    high = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(model.state)[0]}
    flat, tree = jax.tree_util.tree_flatten_with_path(shapes)
    in_features = {jax.tree_util.keystr(path).replace("['weight']", "['scale']"): shape.shape[-1]
                   for path, shape in flat if shape.dtype == FP8_DTYPE}
    rng = np.random.default_rng(0)

    def leaf(path, shape):
        name = jax.tree_util.keystr(path)
        if shape.dtype == FP8_DTYPE:
            return (rng.integers(0, 256, shape.shape, np.uint8) & np.uint8(0b10111111)).view(FP8_DTYPE)
        if name in in_features:
            return np.full(shape.shape, 1 / np.sqrt(in_features[name]), np.float32)
        return np.asarray(high[name])

    state = jax.tree_util.tree_unflatten(tree, [leaf(path, shape) for path, shape in flat])
    return dsv3_jax.Model(args, graphdef, state, model.mesh, model.options)


def dequantized(model: dsv3_jax.Model, bf16: dsv3_jax.Model) -> dsv3_jax.Model:
    """A model of `bf16`'s (bf16-format) structure and options holding `model`'s fp8 weights times their
    block scales in float32 (as `weight_dequant_ref` computes them), and its other weights as they are."""
    flat = {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(model.state)[0]}

    def weight(path, like):
        name = jax.tree_util.keystr(path)
        if flat[name].dtype != FP8_DTYPE:
            return flat[name]
        scale = flat[name.replace("['weight']", "['scale']")]
        full = np.repeat(np.repeat(scale, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)
        full = full[..., :like.shape[-2], :like.shape[-1]]
        return flat[name].astype(np.float32) * full

    state = jax.tree_util.tree_map_with_path(weight, bf16.state)
    return dsv3_jax.Model(bf16.args, bf16.graphdef, state, bf16.mesh, bf16.options)


def same_weights(model, mesh=None, **choices):
    """`model`'s weights under other run options (and on another mesh), each held in the dtype a
    model of those options holds it in."""
    options = dsv3_jax.RunOptions.make(model.options, **choices)
    _, shapes = model_shapes(model.args, options.jnp_dtype)
    # from the host (numpy), so that placing them on another mesh compiles no resharding
    state = jax.tree.map(lambda weight, shape: np.asarray(weight).astype(shape.dtype), model.state, shapes)
    return dsv3_jax.Model(model.args, model.graphdef, state, model.mesh if mesh is None else mesh, options)


# (num_devices, weights, gemm_impl, compute_dtype, tol, impl). Both implementations on 1 device (bf16-format weights)
# and on 4 (fp8 weights, both gemm_impls, float32 and bfloat16 compute: each rank's experts, block scales and
# activations), "slots" with fp8 weights on 1 device too (the 4 shared experts as 4 chunks of one rank). Not here:
# bf16-format weights on 4 devices in bfloat16 (the weights' format and the split meet nowhere: each rank runs
# the 1-device kernels on its experts, which the fp8 cases split; bf16 operands in the kernels:
# tests/test_grouped_gemm.py::test_swiglu_bf16_matches_its_twin), and "fused" with fp8 weights on 1 device in
# float32 (tests/test_fp8_model.py::test_every_routed_expert_path_matches_hf[fused-fp8]: against HF, with a real
# quantisation's scales, which differ expert by expert, so a scale read from another expert shows; here every
# block of a weight stack has one scale).
CASES = [(1, "bf16", "bf16", "float32", 1e-5, "fused"), (1, "bf16", "bf16", "float32", 1e-5, "slots"),
         (1, "fp8", "bf16", "float32", 1e-5, "slots"),
         (4, "fp8", "fp8", "float32", 1e-5, "fused"), (4, "fp8", "fp8", "float32", 1e-5, "slots"),
         (4, "fp8", "bf16", "bfloat16", 2e-2, "fused"), (4, "fp8", "bf16", "bfloat16", 2e-2, "slots")]


@pytest.mark.parametrize("num_devices, weights, gemm_impl, compute_dtype, tol, impl", CASES)
def test_fused_moe_matches_ragged(ragged, num_devices, weights, gemm_impl, compute_dtype, tol, impl):
    reference, expected = ragged(num_devices, weights, gemm_impl, compute_dtype)
    with kernel_twins(*DENSE_KERNELS):
        got = prefill_and_decode(same_weights(reference, moe_impl=impl))
    for step, (g, w) in enumerate(zip(got, expected, strict=True)):
        assert np.isfinite(g).all(), step
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < tol, f"step {step}: {impl} vs ragged relative L2 {rel:.2e}"


@pytest.mark.parametrize("layout", ["dp-attn"])
def test_slots_in_a_batch_split_layout(ragged, layout):
    """"slots" where the rows are gathered for the experts and scattered back (dp-attn: 2 rows padded
    to 4 over 4 devices) and the shared experts, replicated, run outside the slot kernels on each rank's
    own rows: each rank adds only its own experts' slots (other ranks' name no expert, -1), so the logits
    equal "ragged" on one device. ep-only's slots are tp's (replicated rows, each rank's slots summed: the
    4-device cases of test_fused_moe_matches_ragged) with its replicated shared experts after that sum,
    which every moe_impl runs alike (tests/test_layouts.py::test_layout_equals_one_device[ep-only])."""
    one, expected = ragged(1, "bf16", "bf16", "float32")
    split = same_weights(one, make_mesh(4), moe_impl="slots", layout=layout)
    for step, (g, w) in enumerate(zip(prefill_and_decode(split), expected, strict=True)):
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < 1e-5, f"step {step}: slots ({layout}, 4 devices) vs ragged (1 device) relative L2 {rel:.2e}"


def gemms_outside_kernels(jaxpr) -> int:
    """dot_general equations of a jaxpr and its sub-jaxprs (shard_map, scan, ...), Pallas kernel bodies excluded."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += gemms_outside_kernels(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += gemms_outside_kernels(sub)
    return count


@pytest.mark.parametrize("num_devices, moe_impl", [(1, "slots"), (4, "slots"), (1, "fused"), (4, "fused")])
def test_shared_experts_run_inside_the_grouped_kernels(random_model, num_devices, moe_impl):
    """`fuse_shared_experts`: the 4 shared experts (4 x 128 hidden units; on 4 ranks one each) run as more
    experts of the slot kernels, or as groups after the routed ones in the fused path's sorted rows, so the
    shared MLP's three GEMMs leave the (scanned) MoE layer's XLA program, and a decode step's logits equal
    those with the shared experts apart, which test_fused_moe_matches_ragged holds to ragged (float32: a
    dropped, misread or misweighted shared expert moves them by O(1)). The weights are the module's random
    bf16 model's (on 4 devices placed from the host: no random-init program for that mesh)."""
    models = {fuse: same_weights(random_model("bf16"), make_mesh(num_devices), moe_impl=moe_impl,
                                 fuse_shared_experts=fuse) for fuse in (True, False)}
    tokens, start, last = np.array([[5], [7]], np.int32), np.array([0, 0], np.int32), np.zeros(2, np.int32)
    gemms, logits = {}, {}
    for fuse, model in models.items():
        jaxpr = jax.make_jaxpr(lambda s, c: model.step(s, c, tokens, start, last, kv_len=32))(model.state, model.cache)
        gemms[fuse] = gemms_outside_kernels(jaxpr.jaxpr)
        logits[fuse] = np.asarray(model.step(model.state, model.cache, tokens, start, last, kv_len=32)[0])
    assert gemms[False] - gemms[True] == 3, gemms
    rel = np.linalg.norm(logits[True] - logits[False]) / np.linalg.norm(logits[False])
    assert rel < 1e-5, rel


@pytest.mark.parametrize("n, groups", [(1, 4), (192, 66), (RANK_BY_PAIRS_MAX, 257), (RANK_BY_PAIRS_MAX + 52, 64)])
def test_sorted_positions_invert_a_stable_argsort(n, groups):
    """The fused path's rows: where each assignment lands, both ways of ranking (pairs up to RANK_BY_PAIRS_MAX,
    a sort past it), against numpy's stable argsort; keys >= groups (other ranks' experts) last, uncounted."""
    rng = np.random.default_rng(n)
    keys = rng.integers(0, groups + 1, n).astype(np.int32)  # many ties, some of them the foreign marker
    position, sizes = jax.jit(sorted_positions, static_argnums=1)(keys, groups)
    order = np.argsort(keys, kind="stable")
    want = np.empty(n, np.int64)
    want[order] = np.arange(n)
    np.testing.assert_array_equal(np.asarray(position), want)
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(keys, minlength=groups + 1)[:groups])
