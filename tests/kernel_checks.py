"""Checks shared by tests/test_kernels.py (CPU, interpret mode) and tests/test_kernels_gpu.py.

Oracles: the plain-jnp twins in pallas_kernels.reference, always run on the CPU (XLA's GPU
division is not correctly rounded, the CPU's is), and independent float64 / IEEE-float32 numpy.
The oracles widen the kernels' outputs in numpy (exact, and no device program per shape).
"""
from __future__ import annotations

import contextlib
import importlib

import jax
import pytest
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import act_quant, fp8_gemm, weight_dequant
from pallas_kernels import dequantize as WD, gemm as GM, quantize as AQ
from pallas_kernels.reference import act_quant_ref, fp8_gemm_ref, weight_dequant_ref

FP8 = jnp.float8_e4m3fn
E4M3 = ml_dtypes.float8_e4m3fn
# the kernel modules whose wrappers fall back to the kernel's jnp twin (`interpret_in_shard_map`)
KERNEL_MODULES = ("quantize", "dequantize", "gemm", "grouped", "mla", "router", "norm", "projection")


@contextlib.contextmanager
def kernel_twins(*modules: str, everywhere: bool = False):
    """Within: every Pallas kernel that would run in interpret mode (no GPU) computes its jnp twin
    instead, the wrappers' own fallback for device-varying shard_map operands, taken everywhere.
    For tests whose subject is the model's numbers, not the kernels' (which the kernel tests prove
    equal to their twins: bit for bit, or within gemm_tolerance). Only what is traced within sees
    it: build the models there. `modules`: only the kernels of these pallas_kernels modules (default:
    all of KERNEL_MODULES). everywhere=True: on a GPU too (the compiled kernels, the Mosaic grouped
    GEMM included, give way to their twins: the XLA version of a model, an oracle for its kernels)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in modules or KERNEL_MODULES:
            module = importlib.import_module(f"pallas_kernels.{name}")
            patch.setattr(module, "interpret_in_shard_map",
                          (lambda interpret, *operands: True) if everywhere else
                          (lambda interpret, *operands: interpret))
            if everywhere and name == "grouped":
                patch.setattr(module, "grouped_gemm_backend", lambda *args, **kwargs: "triton")
        yield


_act_quant_twin = jax.jit(act_quant_ref, static_argnames="scale_fmt")
_weight_dequant_twin = jax.jit(weight_dequant_ref, static_argnames="out_dtype")


def cpu():
    return jax.devices("cpu")[0]


def on_cpu(fn, *args, **kw):
    """Run `fn` with every array argument committed to the CPU."""
    args = [jax.device_put(a, cpu()) if isinstance(a, (jax.Array, np.ndarray)) else a for a in args]
    with jax.default_device(cpu()):
        return fn(*args, **kw)


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def assert_bits_equal(got, want, what: str):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    diff = bits(got) != bits(want)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.size} elements differ, first at {np.argwhere(diff)[0]}"


def activations(rng, shape, dtype=jnp.bfloat16, special_blocks=True) -> jax.Array:
    """Random rows whose 128-blocks span many magnitudes; optionally one all-zero block and one
    block below the 1e-4 amax floor (so the clamp decides its scale)."""
    k = shape[-1]
    mag = 10.0 ** rng.uniform(-3, 3, size=(*shape[:-1], k // 128, 1))
    x = (rng.standard_normal((*shape[:-1], k // 128, 128)) * mag).reshape(shape)
    if special_blocks and x.size >= 2 * 128:
        flat = x.reshape(-1, k)
        flat[0, :128] = 0.0
        flat[-1, -128:] = rng.standard_normal(128) * 1e-6
    return jax.device_put(x.astype(dtype))  # the bits jnp.asarray(x, dtype) gives, without a program


def fp8_weight(rng, m, n):
    """A float8 weight with random values and random positive block scales."""
    w = jax.device_put((rng.standard_normal((m, n)) * 64).astype(E4M3))
    s = jax.device_put(np.exp2(rng.uniform(-12, -2, size=(-(-m // 128), -(-n // 128)))).astype(np.float32))
    return w, s


# ---------------------------------------------------------------- act_quant
def numpy_act_quant(x, scale_fmt):
    """Independent oracle: amax in float64, IEEE float32 scale and quotient, ml_dtypes e4m3 cast."""
    xf = np.asarray(x).astype(np.float32)
    xb = xf.reshape(*xf.shape[:-1], -1, 128)
    amax = np.maximum(np.abs(xb.astype(np.float64)).max(-1), np.float64(np.float32(1e-4)))
    s = (amax.astype(np.float32) / np.float32(448.0)).astype(np.float32)
    if scale_fmt == "ue8m0":
        s = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    y = (xb / s[..., None]).astype(E4M3).reshape(xf.shape)
    return y, s


def check_act_quant(x, scale_fmt, tile=None, oracle_numpy=True):
    """Kernel == jnp twin bit for bit (twin on the CPU); twin == numpy; ue8m0 scales are powers
    of two; y * s reconstructs x within e4m3 rounding."""
    if tile is None:
        y, s = act_quant(x, scale_fmt=scale_fmt)
    else:
        m, k = int(np.prod(x.shape[:-1])), x.shape[-1]
        y, s = AQ._act_quant_2d(x.reshape(m, k // 128, 128), scale_fmt == "ue8m0",
                                AQ.use_interpret(), tile)
        y, s = y.reshape(x.shape), s.reshape(*x.shape[:-1], k // 128)
    assert y.dtype == FP8 and s.dtype == jnp.float32
    assert y.shape == x.shape and s.shape == (*x.shape[:-1], x.shape[-1] // 128)
    yr, sr = on_cpu(_act_quant_twin, x, scale_fmt=scale_fmt)
    assert_bits_equal(s, sr, "act_quant scales vs twin")
    assert_bits_equal(y, yr, "act_quant values vs twin")
    if oracle_numpy:
        yn, sn = numpy_act_quant(x, scale_fmt)
        assert_bits_equal(np.asarray(sr), sn, "twin scales vs numpy")
        assert_bits_equal(np.asarray(yr).view(np.uint8), yn.view(np.uint8), "twin values vs numpy")
    s64 = np.asarray(s, np.float64)
    if scale_fmt == "ue8m0":
        mant, _ = np.frexp(s64)
        assert (mant == 0.5).all(), "ue8m0 scales must be exact powers of two"
    xf = np.asarray(x).astype(np.float64).reshape(*s.shape, 128)
    deq = np.asarray(y).astype(np.float64).reshape(xf.shape) * s64[..., None]
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4; subnormal step 2^-9 (half: 2^-10).
    tol = np.maximum(np.abs(xf) * 2.0**-4, s64[..., None] * 2.0**-10) * (1 + 1e-6)
    assert (np.abs(deq - xf) <= tol).all(), "y * s does not reconstruct x within e4m3 rounding"
    amax = np.abs(xf).max(-1)
    assert (np.abs(np.asarray(y).astype(np.float32)) <= 448).all()
    assert (s64 >= np.maximum(amax, np.float32(1e-4)) / 448 * (1 - 1e-6)).all()
    return y, s


# ---------------------------------------------------------------- weight_dequant
def check_weight_dequant(w, s, out_dtype=jnp.bfloat16, tile=None):
    if tile is None:
        out = weight_dequant(w, s, out_dtype=out_dtype)
    else:
        out = WD._weight_dequant(w, s, jnp.dtype(out_dtype), WD.use_interpret(), tile)
    assert out.shape == w.shape and out.dtype == jnp.dtype(out_dtype)
    ref = on_cpu(_weight_dequant_twin, w, s, out_dtype=out_dtype)
    assert_bits_equal(out, ref, "weight_dequant vs twin")
    # Independent: IEEE float32 product in numpy, then the same cast.
    m, n = w.shape
    s_full = np.repeat(np.repeat(np.asarray(s), 128, 0), 128, 1)[:m, :n]
    prod = np.asarray(w).astype(np.float32) * s_full
    want = prod.astype(ml_dtypes.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else np.dtype(out_dtype))
    assert_bits_equal(np.asarray(ref), want, "twin vs numpy")
    return out


# ---------------------------------------------------------------- fp8_gemm
def numpy_gemm(a, a_s, b, b_s):
    """float64 C = dequant(A) @ dequant(B)^T, the operands dequantised exactly."""
    k = a.shape[-1]
    a64 = np.asarray(a).astype(np.float64).reshape(-1, k // 128, 128)
    a64 = (a64 * np.asarray(a_s, np.float64).reshape(-1, k // 128, 1)).reshape(-1, k)
    n = b.shape[0]
    sb = np.repeat(np.asarray(b_s, np.float64), 128, axis=0)[:n]  # (n, k/128)
    b64 = (np.asarray(b).astype(np.float64).reshape(n, k // 128, 128) * sb[..., None]).reshape(n, k)
    return (a64 @ b64.T).reshape(*a.shape[:-1], n)


# fp8_gemm's relative L2 error against float64. Interpret mode (a CPU) computes in IEEE float32,
# so only the order of additions differs: measured 3e-8..7e-8 over every shape and tiling here.
# 1e-6 catches what a wrong kernel does short of a crash: a lost or repeated 128-K block (~0.5),
# one wrong output column of 200 (~0.07), a bf16 intermediate or scale (~2e-3), float16 or TF32
# products (~5e-4). Compiled on a GPU the tensor cores add the products in their own precision.
GEMM_F32_REL_L2_INTERPRET = 1e-6
GEMM_F32_REL_L2_COMPILED = 1e-3
# A bfloat16 output rounds each element to 8 significant bits: a relative error of at most 2^-8
# (half the spacing 2^-7 of values just above a power of two), so a relative L2 of at most 2^-8
# too (measured 1.3e-3..1.8e-3), plus the float32 accumulation's.
BF16_ROUNDING = 2.0**-8


def gemm_tolerance(out_dtype, interpret: bool | None = None) -> float:
    """The bound on fp8_gemm's relative L2 error for this output dtype (see above)."""
    interpret = GM.use_interpret() if interpret is None else interpret
    f32 = GEMM_F32_REL_L2_INTERPRET if interpret else GEMM_F32_REL_L2_COMPILED
    return f32 if jnp.dtype(out_dtype) == jnp.float32 else BF16_ROUNDING + f32


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "non-finite output"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def gemm_operands(rng, lead, n, k, dtype=jnp.bfloat16):
    """A quantised by the numpy oracle (act_quant's bits, as the act_quant tests check, without a
    kernel run per shape) and an fp8 weight B with its scales."""
    a, a_s = map(jax.device_put, numpy_act_quant(activations(rng, (*lead, k), dtype, special_blocks=False), None))
    b, b_s = fp8_weight(rng, n, k)
    return a, a_s, b, b_s


def check_fp8_gemm(a, a_s, b, b_s, config=None, out_dtype=jnp.float32, want=None, tol=None):
    if config is None:
        c = fp8_gemm(a, a_s, b, b_s, out_dtype=out_dtype)
    else:
        c = GM.fp8_gemm_with_config(a, a_s, b, b_s, config, out_dtype=out_dtype)
    assert c.shape == (*a.shape[:-1], b.shape[0]) and c.dtype == jnp.dtype(out_dtype)
    want = numpy_gemm(a, a_s, b, b_s) if want is None else want
    tol = tol or gemm_tolerance(out_dtype)
    err = rel_l2(c, want)
    assert err < tol, f"fp8_gemm rel L2 {err:.2e} >= {tol} (config {config})"
    return err
