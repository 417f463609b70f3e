"""The projections' one launch (`pallas_kernels.projection.norm_project`: an RMSNorm in the prologue of the GEMVs
that read it) against float64 numpy (interpret mode on a CPU; compiled with -m gpu), and in the model's decode step
against the XLA path it replaces.

Cases: MLA's query and latent projections after attn_norm, bf16, two weights of a three-layer stack read at layer 1
(another layer's weights differ by O(1)), 40 columns leaving a partial column tile; float32 rows without a norm
(the output projection); fp8 weights dequantized tile by tile (gemm_impl "bf16") and multiplied in fp8 after the
normed rows are quantized as act_quant does (gemm_impl "fp8", both scale formats); each kind both as vector products
(a few rows) and as a dot (more), each over several K steps (a step left out moves the result by ~25-50 %), and
plain weights whose K the step does not divide (a last, masked step). Weight
scales are powers of two from 1/16 to 4 times a random factor, so a tile given a neighbouring block's scale is off
by 2x or more. bf16 results are held to about one bf16 rounding of the float64
value (relative L2 < 4e-3), float32 ones to 1e-6.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.projection import norm_project, norm_project_ref

EPS = 1e-6
LAYERS, LAYER = 3, 1
# (what, rows, K, output widths, x dtype, weights: "plain" / "dequantize" / "e4m3" / "ue8m0", normed); up to
# VECTOR_MAX_ROWS rows run as vector products, more as a dot: each kind of weight is checked on both
CASES = [("attn_norm, wq and wkv_a, bf16, 1 row", 1, 2048, (96, 40), jnp.bfloat16, "plain", True),
         ("attn_norm, wq and wkv_a, bf16, 12 rows", 12, 512, (96, 40), jnp.bfloat16, "plain", True),
         ("wo, float32, no norm, 5 rows", 5, 1024, (64,), jnp.float32, "plain", False),
         ("fp8 weights dequantized, 3 rows", 3, 384, (128, 96), jnp.bfloat16, "dequantize", True),
         ("fp8 weights dequantized, 6 rows", 6, 384, (128, 96), jnp.bfloat16, "dequantize", True),
         ("fp8 products, e4m3 scales, 2 rows", 2, 384, (128, 96), jnp.bfloat16, "e4m3", True),
         ("fp8 products, e4m3 scales, 9 rows", 9, 384, (128, 96), jnp.bfloat16, "e4m3", True),
         ("fp8 products, ue8m0 scales, 8 rows", 8, 256, (64,), jnp.bfloat16, "ue8m0", False),
         # K not a multiple of the step (V2-Lite's dense w2 has K = 10944): whole steps, then a masked one
         ("dense w2 form, K 1216, bf16, 1 row", 1, 1216, (64,), jnp.bfloat16, "plain", False),
         ("K 704 after a norm, bf16, 6 rows", 6, 704, (48,), jnp.bfloat16, "plain", True),
         # past the model's PROJECTION_KERNEL_MAX_ROWS: 32-row programs, and a 64-row one with 24 rows masked
         ("attn_norm, wq and wkv_a, bf16, 32 rows", 32, 512, (96, 40), jnp.bfloat16, "plain", True),
         ("no norm, bf16, 40 rows", 40, 256, (64,), jnp.bfloat16, "plain", False),
         # three 64-row programs a column tile, the last with 42 rows masked (each program norms its own rows)
         ("attn_norm, wq and wkv_a, bf16, 150 rows", 150, 512, (96, 40), jnp.bfloat16, "plain", True)]


def make_inputs(case, rng):
    _, rows, k, widths, dtype, kind, normed = case
    x = jnp.asarray(rng.standard_normal((rows, 1, k)) * 3, dtype)
    norm = rng.uniform(0.5, 1.5, (LAYERS, k)).astype(np.float32) if normed else None
    if kind == "plain":
        weights = [jnp.asarray(rng.standard_normal((LAYERS, n, k)) / np.sqrt(k), dtype) for n in widths]
        return x, weights, None, norm
    weights = [jnp.asarray(rng.uniform(-1.9, 1.9, (LAYERS, n, k)), jnp.float8_e4m3fn) for n in widths]
    scales = [jnp.asarray(2.0 ** rng.integers(-4, 3, (LAYERS, -(-n // 128), k // 128)) * rng.uniform(0.5, 1.0)
                          / np.sqrt(k), jnp.float32) for n in widths]
    return x, weights, scales, norm


def float64_rows(x, norm, dtype) -> np.ndarray:
    """The normed rows as the model rounds them (to x's dtype), widened."""
    h = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    if norm is None:
        return h
    normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * norm[LAYER]
    return np.asarray(jnp.asarray(normed, jnp.float32).astype(dtype), np.float64)


def float64_weight(w, s, dtype) -> np.ndarray:
    """Layer LAYER of a weight in float64, an fp8 one times its block scales rounded as weight_dequant rounds."""
    w = np.asarray(w[LAYER].astype(jnp.float32), np.float64)
    if s is None:
        return w
    full = np.repeat(np.repeat(np.asarray(s[LAYER], np.float64), 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
    return np.asarray(jnp.asarray(w * full, jnp.float32).astype(dtype), np.float64)


def float64_fp8_product(rows, w, s, scale_fmt) -> np.ndarray:
    """act_quant of the rows in IEEE float32 (amax / 448, the values divided, e4m3), then the block-scaled product."""
    blocks = rows.astype(np.float32).reshape(rows.shape[0], -1, 128)
    scale = np.maximum(np.abs(blocks).max(axis=-1), np.float32(1e-4)) / np.float32(448)
    if scale_fmt == "ue8m0":
        scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
    q = (blocks / scale[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    weight = np.asarray(w[LAYER].astype(jnp.float32), np.float64).reshape(w.shape[1], -1, 128)
    w_scale = np.repeat(np.asarray(s[LAYER], np.float64), 128, 0)[:w.shape[1]]  # (N, K / 128)
    return np.einsum("mgk,ngk,mg,ng->mn", q, weight, scale.astype(np.float64), w_scale)


def at_layer(fn):
    """`fn` (the kernel or its jnp twin) jitted, reading the stacks at LAYER."""
    return jax.jit(lambda x, weights, scales, norm, quantize=None: fn(
        x, weights, scales=scales, norm=norm, eps=EPS, layer=jnp.int32(LAYER), quantize=quantize),
        static_argnames="quantize")


KERNEL, TWIN = at_layer(norm_project), at_layer(norm_project_ref)


def check(case, seed, run=KERNEL):
    dtype, kind = case[4], case[5]
    x, weights, scales, norm = make_inputs(case, np.random.default_rng(seed))
    quantize = kind if kind in ("e4m3", "ue8m0") else None
    got = run(x, weights, scales, norm, quantize=quantize)
    rows = float64_rows(x, norm, dtype)
    for i, (w, y) in enumerate(zip(weights, got, strict=True)):
        s = None if scales is None else scales[i]
        want = (float64_fp8_product(rows, w, s, kind) if quantize else rows @ float64_weight(w, s, dtype).T)
        assert y.dtype == dtype and y.shape == (*x.shape[:-1], w.shape[1])
        y = np.asarray(y, np.float64).reshape(want.shape)
        rel = np.linalg.norm(y - want) / np.linalg.norm(want)
        assert rel < (4e-3 if dtype == jnp.bfloat16 else 1e-6), f"weight {i}: relative L2 {rel:.2e}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_projections_match_float64(case):
    check(case, seed=CASES.index(case))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_jnp_twin_matches_float64(case):
    """The twin that device-varying shard_map operands fall back to (`interpret_in_shard_map`)."""
    check(case, seed=CASES.index(case), run=TWIN)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_projections_compiled_on_gpu(case):
    with jax.default_matmul_precision("highest"):
        check(case, seed=10 + CASES.index(case))


def test_bad_arguments_say_what_is_wrong():
    x = jnp.zeros((2, 256), jnp.bfloat16)
    w = jnp.zeros((3, 64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"norm_project: weight 0 has dtype float32, expected x's bfloat16"):
        norm_project(x, [w.astype(jnp.float32)], layer=jnp.int32(0))
    with pytest.raises(ValueError, match=r"weight 0 has shape \(64, 256\), expected \(L, N, 256\)"):
        norm_project(x, [w[0]], layer=jnp.int32(0))
    with pytest.raises(ValueError, match=r"not None only for fp8 weights"):
        norm_project(x, [w], layer=jnp.int32(0), quantize="e4m3")
    w8, s = w.astype(jnp.float8_e4m3fn), jnp.ones((3, 1, 1), jnp.float32)
    with pytest.raises(ValueError, match=r"fp8 weight 0 needs .* float32 scales \(3, 1, 2\)"):
        norm_project(x, [w8], scales=[s], layer=jnp.int32(0))


# ------------------------------------------------------------------ in the model
# (what, q_lora_rank, rows, launches a layer stack): wq_a + wkv_a (or wq + wkv_a), wq_b, and, without a norm, wo and the
# MLP's w1 + w3 and w2 (the dense layers' MLP, the MoE layers' shared experts, which run apart at 6 rows here) as dots
# but not where a few rows meet them (their weights are small: XLA's GEMV is faster there); bf16 weights (the model
# keeps fp8 weights on their XLA path)
MODEL_CASES = [("V3 form, 6 rows (a dot)", 256, 6, 5),
               ("V2-Lite form (no q_lora), 2 rows (vector products)", 0, 2, 1),
               # every weight counted big (BIG_PROJECTION_BYTES 0), as V2-Lite's dense MLP is: wq + wkv_a, wo, and the
               # MLPs' w1 + w3 and w2 as vector products
               ("V2-Lite form, 2 rows, every projection big", 0, 2, 4)]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_the_models_projections_match_its_xla_path(monkeypatch, case):
    """A small V3 model (tests/test_auto_paths_gpu.py's, narrower) with the projections' one launch forced on
    (interpret mode; on a GPU it runs in steps of up to PROJECTION_KERNEL_MAX_ROWS rows): attn_norm inside wq_a +
    wkv_a (or wq + wkv_a), q_norm inside wq_b, and wo (not for a few rows), each layer's weights read from their
    stacks in place. A decode step agrees with the same model's XLA norms and projections (bf16 logits, relative L2
    < 2e-2: a projection of another layer, or of rows normed without their weight, is O(1) off; the norms' weights
    are random, not a build's ones), and its jaxpr holds the kernel (the other kernels run their twins)."""
    import dsv3_jax
    from dsv3_jax.decode.step import make_step
    from dsv3_jax.model import block, layers
    from kernel_checks import KERNEL_MODULES, kernel_twins
    from test_auto_paths_gpu import small_v3, step_inputs, variant, with_random_norms

    what, q_lora, rows, launches = case
    # two MoE layers: their stack's launches read layer 0 and then layer 1 of it; narrower than small_v3 (compiles
    # faster), every projection still over several of the kernel's column programs and K steps
    args = small_v3("bf16").replace(q_lora_rank=q_lora, n_layers=3, dim=512, inter_dim=1024, vocab_size=1024,
                                    n_routed_experts=16)
    base = with_random_norms(dsv3_jax.build(args, seed=0), ("attn_norm", "q_norm"))

    def run():
        model = variant(base, gemm_impl="bf16")
        step = make_step.__wrapped__(model.parts)  # a fresh jit: traced under the patch or not
        tokens, starts, last, kv_len = step_inputs(model.args, rows, 1, 0, seed=3)
        jaxpr = str(step.trace(model.state, model.cache, tokens, starts, last, kv_len=kv_len).jaxpr)
        logits, _ = step(model.state, model.cache, tokens, starts, last, kv_len=kv_len)
        return np.asarray(logits), jaxpr

    with kernel_twins(*(name for name in KERNEL_MODULES if name != "projection")):  # the others' twins: fast
        want, xla_jaxpr = run()
        with monkeypatch.context() as patch:
            for module in (block, layers):
                patch.setattr(module, "projection_kernel_applies", lambda rows, fp8_weights: not fp8_weights)
            if "big" in what:
                patch.setattr(layers, "BIG_PROJECTION_BYTES", 0)
            got, jaxpr = run()
    assert jaxpr.count("name=norm_project") == 2 * launches  # the dense layers' stack and the MoE layers'
    assert "norm_project" not in xla_jaxpr
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
