"""The one-launch RMSNorm kernels (`pallas_kernels.norm`: `rms_norm`, and `latent_norm_rope`, MLA's latent
normed and its shared rotary key rotated from wkv_a's output; the MoE gate's logits in the norm's launch) against
float64 numpy (interpret mode on a CPU; compiled with -m gpu).

Cases: V3's 7,168-wide rows (seven 1,024-column chunks: a chunk left out of the sum of squares moves
every value by ~7 %) after the residual add, with a layer of a four-layer weight stack (a wrong layer's
weights differ by O(1)); MLA's latent, the first 512 of wkv_a's 576 columns read in place (reading the
rotary columns shifts the norm); a float32 1,536-wide q_lora row, three chunks, unstacked. bf16 results
are held to a bf16 rounding of the float64 value (relative L2 < 4e-3, about one bf16 ulp), float32 to 1e-6.
The rotary key is checked in both pair layouts (adjacent, DeepSeek's; half a head apart) at random angles:
a pair's wrong partner, sign or angle moves it by O(1).
"""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.norm import latent_norm_rope, rms_norm, rms_norm_fp8

EPS = 1e-6
# (what, row width, normed columns, residual, stacked weight, dtype)
CASES = [("V3 hidden after the residual add", 7168, 7168, True, True, jnp.bfloat16),
         ("MLA latent inside wkv_a's output", 576, 512, False, True, jnp.bfloat16),
         ("q_lora row, float32", 1536, 1536, False, False, jnp.float32)]


def float64_norm(h: np.ndarray, w: np.ndarray) -> np.ndarray:
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * w


@functools.partial(jax.jit, static_argnames="column_groups")
def _kernel(x, residual, weight, layer, column_groups=1):
    return rms_norm(x, weight, eps=EPS, residual=residual, layer=layer, column_groups=column_groups)


@jax.jit
def _kernel_columns(x, weight, layer):
    return rms_norm(x, weight, eps=EPS, layer=layer, columns=weight.shape[-1])


def check(case, seed):
    _, width, columns, residual, stacked, dtype = case
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 3, width)) * 3, dtype)
    r = jnp.asarray(rng.standard_normal((2, 3, width)), dtype)
    w = rng.uniform(0.5, 1.5, (4, columns) if stacked else (columns,)).astype(np.float32)
    layer = jnp.int32(2) if stacked else None
    if residual:
        normed, summed = _kernel(x, r, w, layer)
        want_sum = (np.asarray(x, np.float64) + np.asarray(r, np.float64)).astype(ml_dtypes.bfloat16)
        assert summed.dtype == dtype and np.array_equal(np.asarray(summed), want_sum)
        h = want_sum.astype(np.float64)
    elif columns != width:
        normed, h = _kernel_columns(x, w, layer), np.asarray(x, np.float64)[..., :columns]
    else:
        normed, h = jax.jit(lambda x, w: rms_norm(x, w, eps=EPS))(x, w), np.asarray(x, np.float64)
    want = float64_norm(h, w[2] if stacked else w)
    got = np.asarray(normed, np.float64)
    assert normed.dtype == dtype and got.shape == want.shape
    tol = 4e-3 if dtype == jnp.bfloat16 else 1e-6
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_norm_matches_float64(case):
    check(case, seed=CASES.index(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_norm_compiled_on_gpu(case):
    check(case, seed=10 + CASES.index(case))


def check_column_groups(groups: int, seed: int):
    """A V3 row (seven 1,024-column chunks) after the residual add in `groups` programs, each summing the whole
    row's squares and storing its share of the chunks (7: one each; 3: 3 + 3 + 1): the same bits as one program,
    normed, summed and (rms_norm_fp8) quantized; one program's result was checked against float64 above."""
    rng = np.random.default_rng(seed)
    x, r = (jnp.asarray(rng.standard_normal((5, 7168)) * scale, jnp.bfloat16) for scale in (3, 1))
    w = rng.uniform(0.5, 1.5, (4, 7168)).astype(np.float32)
    for got, want in zip(_kernel(x, r, w, jnp.int32(2), column_groups=groups), _kernel(x, r, w, jnp.int32(2)),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    fp8 = jax.jit(lambda x, r, w, groups: rms_norm_fp8(x, w, eps=EPS, residual=r, layer=jnp.int32(2),
                                                       column_groups=groups), static_argnums=3)
    got, want = jax.tree.leaves(fp8(x, r, w, groups)), jax.tree.leaves(fp8(x, r, w, 1))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("groups", [3, 7])
def test_norm_in_column_groups_matches_one_program(groups):
    check_column_groups(groups, seed=50 + groups)


@pytest.mark.gpu
def test_norm_in_column_groups_compiled_on_gpu():
    check_column_groups(7, seed=60)


# (what, row width, experts, stacked, residual, rms_norm_fp8, column_groups, gate_groups)
GATE_CASES = [("V2-Lite: 64 experts, 8 programs of 8", 2048, 64, True, True, False, 1, None),
              ("V3 fp8: 256 experts in 4 programs, the row's chunks in 7", 7168, 256, True, True, True, 7, 4),
              ("unstacked float32 rows, 32 experts in 32 programs", 1024, 32, False, False, False, 1, 32)]


def check_gate(case, seed):
    """The gate's logits from the norm's launch against float64 products of the kernel's own normed rows with the
    gate's rows (a program reading another group's rows, or a chunk of the row left out, is O(1) / O(1/chunks)
    off; float32 sums of a few thousand products stay within 1e-5 of the logits' scale), and the norm's other
    results bit for bit those of the launch without the gate."""
    _, width, experts, stacked, residual, fp8, column_groups, gate_groups = case
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if residual else jnp.float32
    x, r = (jnp.asarray(rng.standard_normal((5, width)) * scale, dtype) for scale in (3, 1))
    w = rng.uniform(0.5, 1.5, (4, width) if stacked else (width,)).astype(np.float32)
    gate = jnp.asarray(rng.standard_normal((4, experts, width) if stacked else (experts, width)) * width ** -0.5,
                       jnp.bfloat16)
    layer = jnp.int32(2) if stacked else None
    norm = functools.partial(rms_norm_fp8 if fp8 else rms_norm, eps=EPS, residual=r if residual else None,
                             layer=layer, column_groups=column_groups)
    *got, logits = jax.jit(lambda x, w, g: norm(x, w, gate=g, gate_groups=gate_groups))(x, w, gate)
    plain = jax.jit(norm)(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    normed = np.asarray(got[0], np.float64)
    rows = np.asarray(gate[2] if stacked else gate, np.float64)
    want = normed @ rows.T
    assert logits.dtype == jnp.float32 and logits.shape == (5, experts)
    np.testing.assert_allclose(np.asarray(logits, np.float64), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("case", GATE_CASES, ids=[c[0] for c in GATE_CASES])
def test_norm_with_the_gate_matches_float64(case):
    check_gate(case, seed=70 + GATE_CASES.index(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GATE_CASES[:2], ids=[c[0] for c in GATE_CASES[:2]])
def test_norm_with_the_gate_compiled_on_gpu(case):
    check_gate(case, seed=80 + GATE_CASES.index(case))


def float64_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    out = np.empty_like(x)
    real, imag = (x[..., 0::2], x[..., 1::2]) if interleaved else np.split(x, 2, axis=-1)
    rotated_real, rotated_imag = real * cos - imag * sin, real * sin + imag * cos
    if interleaved:
        out[..., 0::2], out[..., 1::2] = rotated_real, rotated_imag
        return out
    return np.concatenate([rotated_real, rotated_imag], -1)


def check_latent_norm_rope(interleaved: bool, seed: int):
    rng = np.random.default_rng(seed)
    kv = jnp.asarray(rng.standard_normal((2, 3, 512 + 64)) * 2, jnp.bfloat16)
    angles = rng.uniform(-4, 4, (2, 3, 32))
    cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
    w = rng.uniform(0.5, 1.5, (4, 512)).astype(np.float32)
    latent, k_pe = jax.jit(lambda kv, w, c, s: latent_norm_rope(kv, w, c, s, eps=EPS, rank=512, layer=jnp.int32(2),
                                                                 interleaved=interleaved))(kv, w, cos, sin)
    x = np.asarray(kv, np.float64)
    want = (float64_norm(x[..., :512], w[2]),
            float64_rotary(x[..., 512:], np.asarray(cos, np.float64), np.asarray(sin, np.float64), interleaved))
    for got, expected in zip((latent, k_pe), want, strict=True):
        got = np.asarray(got, np.float64)
        assert got.shape == expected.shape
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 4e-3


@pytest.mark.parametrize("interleaved", [True, False])
def test_latent_norm_rope_matches_float64(interleaved):
    check_latent_norm_rope(interleaved, seed=5 + interleaved)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_latent_norm_rope_compiled_on_gpu(interleaved):
    check_latent_norm_rope(interleaved, seed=15 + interleaved)


def float64_act_quant(v: np.ndarray, ue8m0: bool):
    """DeepSeek's act_quant of rows v (float64 holding x's values): per 128 columns s = max(amax, 1e-4) / 448 in
    float32 (ue8m0: the next power of two), the values divided by s in float32, then e4m3."""
    blocks = v.reshape(*v.shape[:-1], -1, 128)
    s = np.maximum(np.abs(blocks).max(-1), 1e-4).astype(np.float32) / np.float32(448.0)
    if ue8m0:
        s = (2.0 ** np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    y = (blocks.astype(np.float32) / s[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return y.reshape(v.shape), s


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_norm_fp8_quantizes_as_act_quant(scale_fmt, seed=21):
    """rms_norm_fp8: the normed rows (as rms_norm gives them, to a rounding) and their act_quant, bit for bit
    against the float32 math in numpy (a scale from the wrong block, a missed power-of-two rounding, a missing
    amax floor or a division by an approximate reciprocal changes values or bits)."""
    rng = np.random.default_rng(seed + (scale_fmt is None))
    x, r = rng.standard_normal((2, 3, 7168)) * 3, rng.standard_normal((2, 3, 7168))
    x[0, 0, :128] = r[0, 0, :128] = 0  # a block of zeros: its scale is the amax floor's
    x, r = jnp.asarray(x, jnp.bfloat16), jnp.asarray(r, jnp.bfloat16)
    w = rng.uniform(0.5, 1.5, (4, 7168)).astype(np.float32)
    normed, summed, (y, s) = jax.jit(lambda x, r, w: rms_norm_fp8(x, w, eps=EPS, residual=r, layer=jnp.int32(2),
                                                                  scale_fmt=scale_fmt))(x, r, w)
    plain, plain_sum = _kernel(x, r, w, jnp.int32(2))
    # the sum of squares is reduced by 128-blocks here, by columns in rms_norm: a rounding apart, one bf16 ulp
    # at most (a wrong layer's weight or a missing residual is off by far more)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(plain, np.float32), rtol=2 ** -7, atol=0)
    np.testing.assert_array_equal(np.asarray(summed), np.asarray(plain_sum))
    want_y, want_s = float64_act_quant(np.asarray(normed, np.float64), scale_fmt == "ue8m0")
    np.testing.assert_array_equal(np.asarray(s), want_s)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), want_y.view(np.uint8))


@pytest.mark.gpu
def test_norm_fp8_compiled_on_gpu():
    test_norm_fp8_quantizes_as_act_quant("ue8m0", seed=31)
    test_norm_fp8_quantizes_as_act_quant(None, seed=41)


def test_norm_errors_name_the_argument():
    x = jnp.zeros((2, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"rms_norm: columns=600 must lie in \[1, 576\]"):
        rms_norm(x, jnp.zeros((600,)), eps=EPS, columns=600)
    with pytest.raises(ValueError, match=r"rms_norm: weight has shape \(576,\), expected \(512,\)"):
        rms_norm(x, jnp.zeros((576,)), eps=EPS, columns=512)
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm(x, jnp.zeros((512,)), eps=EPS, residual=x, columns=512)
    with pytest.raises(ValueError, match="columns=100 has no power-of-two factor of at least 16"):
        rms_norm(jnp.zeros((2, 100)), jnp.zeros((100,)), eps=EPS)
    with pytest.raises(ValueError, match=r"rms_norm: column_groups=8 must lie in \[1, 7\] \(the row's 7 chunks"):
        rms_norm(jnp.zeros((2, 7168)), jnp.zeros((7168,)), eps=EPS, column_groups=8)
    with pytest.raises(ValueError, match=r"rms_norm: gate has shape \(64, 512\), expected \(experts, 576\)"):
        rms_norm(x, jnp.zeros((576,)), eps=EPS, gate=jnp.zeros((64, 512)))
    with pytest.raises(ValueError, match=r"gate_groups=3 must divide the gate's 64 experts into groups of a power"):
        rms_norm(x, jnp.zeros((576,)), eps=EPS, gate=jnp.zeros((64, 576)), gate_groups=3)
    with pytest.raises(ValueError, match=r"rms_norm: gate stacks 2 layers, the norm's weight 4"):
        rms_norm(x, jnp.zeros((4, 576)), eps=EPS, layer=0, gate=jnp.zeros((2, 64, 576)))
    with pytest.raises(ValueError, match=r"rms_norm_fp8: rows of 576 \(a multiple of 128\)"):
        rms_norm_fp8(x, jnp.zeros((576,)), eps=EPS)
    angles = jnp.zeros((2, 32))
    with pytest.raises(ValueError, match=r"latent_norm_rope: the rotary part \(48 columns after rank=528\) must be "
                                         r"a power of two"):
        latent_norm_rope(x, jnp.zeros((528,)), angles, angles, eps=EPS, rank=528)


# ------------------------------------------------------------------ in the model
def test_the_models_norm_kernels_match_its_xla_norms(monkeypatch):
    """The small V3 model of tests/test_auto_paths_gpu.py (fp8 weights, gemm_impl "fp8") with the one-launch
    norms forced on (interpret mode; on a GPU they run in decode-sized steps): the norms' quantized rows
    feed wq_a, wkv_a, wq_b, the dense w1/w3 and the routed experts' kernels in place of their act_quant,
    and the latent's norm and its rotary key come from one kernel. A decode step agrees with the same
    model's XLA norms (bf16 logits, relative L2 < 2e-2; quantized rows of another norm's
    output, or rows normed without the norm's weight, would be O(1) off: the weights are random), and its jaxpr holds the norm kernels (the other kernels run their twins;
    tests/test_gpu_lowering.py counts the act_quant launches the norms save)."""
    import dsv3_jax
    from dsv3_jax.decode.step import make_step
    from kernel_checks import KERNEL_MODULES, kernel_twins
    from dsv3_jax.model import attention, block, layers
    from test_auto_paths_gpu import small_v3, step_inputs, variant, with_random_norms

    base = with_random_norms(dsv3_jax.build(small_v3("fp8"), seed=0), ("attn_norm", "ffn_norm", "q_norm", "kv_norm"))
    steps = [(2, 1, 0)]  # a decode step

    def run():
        model, out = variant(base, gemm_impl="fp8"), []
        step = make_step.__wrapped__(model.parts)  # a fresh jit: traced under the patch or not
        for seed, (batch, seq, start) in enumerate(steps):
            tokens, starts, last, kv_len = step_inputs(model.args, batch, seq, start, seed)
            jaxpr = str(step.trace(model.state, model.cache, tokens, starts, last, kv_len=kv_len).jaxpr)
            logits, model.cache = step(model.state, model.cache, tokens, starts, last, kv_len=kv_len)
            out.append((np.asarray(logits), jaxpr))
        return out

    with kernel_twins(*(name for name in KERNEL_MODULES if name != "norm")):  # the others' twins: fast
        want = run()
        with monkeypatch.context() as patch:
            for module in (attention, block, layers):
                patch.setattr(module, "norm_kernel_applies", lambda rows: True)
            got = run()
    for (g, jaxpr), (w, xla_jaxpr) in zip(got, want, strict=True):
        assert "name=rms_norm" in jaxpr and "name=latent_norm_rope" in jaxpr and "rms_norm" not in xla_jaxpr
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 2e-2


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_the_gate_in_the_norms_launch_routes_as_the_gate_gemm(monkeypatch, weights):
    """router "norm-gate": the MoE gate's logits from the launch of the norm before the MoE (bf16 weights: the
    norm's plain form; fp8 with gemm_impl "fp8": the quantizing form), against router "kernel" (XLA's gate GEMM,
    the same routing kernel) on the small V3 model with the one-launch norms forced on (interpret mode): a decode
    step and a two-token step agree to float32 summation order (relative L2 of the bf16 logits < 1e-3; a program
    reading another group's gate rows routes tokens to other experts, ~0.1-1 off), and the norm-gate steps hold one
    fewer dot_general a MoE layer (the gate's GEMM gone from XLA)."""
    import dsv3_jax
    from dsv3_jax.decode.step import make_step
    from kernel_checks import KERNEL_MODULES, kernel_twins
    from dsv3_jax.model import attention, block, layers, moe
    from test_auto_paths_gpu import small_v3, step_inputs, variant, with_random_norms

    base = with_random_norms(dsv3_jax.build(small_v3(weights), seed=0), ("attn_norm", "ffn_norm"))
    steps = [(2, 1, 0), (2, 2, 1)]  # a decode step, a two-token step after it

    def run(router):
        model, out = variant(base, gemm_impl="fp8" if weights == "fp8" else "bf16", router=router), []
        step = make_step.__wrapped__(model.parts)  # a fresh jit: traced under the patch
        for seed, (batch, seq, start) in enumerate(steps):
            tokens, starts, last, kv_len = step_inputs(model.args, batch, seq, start, seed)
            jaxpr = str(step.trace(model.state, model.cache, tokens, starts, last, kv_len=kv_len).jaxpr)
            logits, model.cache = step(model.state, model.cache, tokens, starts, last, kv_len=kv_len)
            out.append((np.asarray(logits, np.float32), jaxpr.count("dot_general")))
        return out

    with kernel_twins(*(name for name in KERNEL_MODULES if name != "norm")), monkeypatch.context() as patch:
        for module in (attention, block, layers, moe):
            patch.setattr(module, "norm_kernel_applies", lambda rows: True)
        want, got = run("kernel"), run("norm-gate")
    for (g, g_dots), (w, w_dots) in zip(got, want, strict=True):
        assert g_dots == w_dots - 1, (g_dots, w_dots)  # the layer scan's body: one MoE layer
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-3
