"""pallas_kernels on the CPU: the Pallas kernels in interpret mode against their jnp twins (bit
for bit) and float64 numpy (GEMM within kernel_checks.gemm_tolerance); shapes with M = 1, ragged M and N,
leading batch dims; every ValueError; jit and shard_map. Small shapes: interpret mode is slow."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kernel_checks import (FP8, GM, activations, check_act_quant, check_fp8_gemm, check_weight_dequant,
                           fp8_weight, gemm_operands, gemm_tolerance, numpy_act_quant, numpy_gemm, rel_l2)
from pallas_kernels import GemmConfig, act_quant, fp8_gemm, weight_dequant
from pallas_kernels._common import num_sms
from pallas_kernels.quantize import default_tile
from pallas_kernels.reference import act_quant_ref, fp8_gemm_ref, weight_dequant_ref

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# the twins as the model runs them, one program per shape (not op by op)
act_quant_twin = jax.jit(act_quant_ref, static_argnames="scale_fmt")
weight_dequant_twin = jax.jit(weight_dequant_ref, static_argnames="out_dtype")
fp8_gemm_twin = jax.jit(fp8_gemm_ref, static_argnames="out_dtype")


# ---------------------------------------------------------------- act_quant
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("shape,dtype", [
    ((37, 384), jnp.bfloat16),     # ragged rows and groups (G=3): masked edge tiles
    ((1, 128), jnp.float32),       # M = 1
    ((2, 3, 256), jnp.float16),    # leading batch dims
])
def test_act_quant_matches_twin_and_numpy(rng, shape, dtype, scale_fmt):
    check_act_quant(activations(rng, shape, dtype), scale_fmt)


@pytest.mark.parametrize("tile", [(4, 4, 4), (64, 1, 4), (1, 1, 1), (1, 2, 1)])
def test_act_quant_other_tiles(rng, tile):
    check_act_quant(activations(rng, (9, 640)), "ue8m0", tile=tile)


@pytest.mark.parametrize("m, g", [(1, 16), (9, 16), (72, 16), (1, 128), (1, 144), (8, 56), (256, 56), (4096, 56)])
def test_act_quant_launches_fill_the_sms_at_decode_rows(m, g):
    """A launch of few rows (decode) still has a program an SM, or one 128-block a program, and no thread more than
    32 elements; large launches keep 4,096-element tiles."""
    bm, bg, warps = default_tile(m, g, 2)
    programs = -(-m // bm) * -(-g // bg)
    assert programs >= min(num_sms(), m * g), (bm, bg, programs)
    assert bm * bg * 128 <= 32 * 32 * warps, (bm, bg, warps)
    if m * g >= 32 * num_sms():
        assert bm * bg * 128 == 4096, (bm, bg)


def test_act_quant_clamp_and_zero_blocks(rng):
    x = np.zeros((2, 512), np.float32)
    x[0, 128:256] = rng.standard_normal(128) * 1e-7       # amax below the 1e-4 floor
    x[1, 256:384] = rng.standard_normal(128) * 1000       # ordinary block
    x[1, 384:] = 5e-5                                     # constant below the floor
    for fmt in (None, "ue8m0"):
        y, s = check_act_quant(jnp.asarray(x), fmt)
        floor = np.float32(1e-4) / np.float32(448)
        want_floor = floor if fmt is None else np.exp2(np.ceil(np.log2(np.float64(floor))))
        np.testing.assert_array_equal(np.asarray(s)[0, [0, 1, 2, 3]], np.float32(want_floor))
        assert (np.asarray(y.astype(jnp.float32))[0, :128] == 0).all()


def test_ue8m0_rounds_exact_powers_of_two_to_themselves():
    # amax = 448 * 2^e gives s = 2^e exactly: the power must not be bumped to 2^(e+1).
    x = np.zeros((1, 384), np.float32)
    x[0, 0], x[0, 128], x[0, 256] = 448.0, 448.0 * 2.0**-10, 448.0 * 2.0**5 * (1 + 2**-20)
    y, s = act_quant(jnp.asarray(x), scale_fmt="ue8m0")
    np.testing.assert_array_equal(np.asarray(s)[0], np.float32([1.0, 2.0**-10, 2.0**6]))


def test_twin_matches_float64_numpy_on_extremes(rng):
    x = activations(rng, (4, 1024), jnp.float32)
    for fmt in (None, "ue8m0"):
        yr, sr = act_quant_twin(x, scale_fmt=fmt)
        yn, sn = numpy_act_quant(x, fmt)
        np.testing.assert_array_equal(np.asarray(sr), sn)
        np.testing.assert_array_equal(np.asarray(yr).view(np.uint8), yn.view(np.uint8))


# ---------------------------------------------------------------- weight_dequant
@pytest.mark.parametrize("m,n,out_dtype", [(200, 300, jnp.bfloat16), (256, 384, jnp.float32), (1, 130, jnp.bfloat16)])
def test_weight_dequant_matches_twin(rng, m, n, out_dtype):
    w, s = fp8_weight(rng, m, n)
    check_weight_dequant(w, s, out_dtype)


@pytest.mark.parametrize("tile", [(32, 128, 4), (128, 256, 4)])
def test_weight_dequant_other_tiles(rng, tile):
    w, s = fp8_weight(rng, 250, 600)
    check_weight_dequant(w, s, jnp.bfloat16, tile=tile)


# ---------------------------------------------------------------- fp8_gemm
@pytest.mark.parametrize("lead,n,k", [
    ((1,), 200, 256),      # M = 1, N not a multiple of 128
    ((2, 3), 256, 384),    # leading batch dims
    ((37,), 130, 256),     # M not a multiple of the tile, ragged N
])
def test_fp8_gemm_default_config(rng, lead, n, k):
    a, a_s, b, b_s = gemm_operands(rng, lead, n, k)
    check_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32)
    check_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.bfloat16)


@pytest.mark.parametrize("config", [
    GemmConfig(bm=16, bn=32, split=3, num_warps=4, num_stages=2),           # split-K, narrow N
    GemmConfig(bm=32, bn=128, split=2, num_warps=4, num_stages=2, mma="f16"),
    GemmConfig(bm=64, bn=128, split=1, num_warps=4, num_stages=2, mma="f16"),
    GemmConfig(bm=16, bn=32, split=3, num_warps=4, num_stages=2, byte_pairs=True),  # B as uint16 byte pairs
    GemmConfig(bm=32, bn=128, split=1, num_warps=4, num_stages=2, mma="f16", byte_pairs=True),
])
def test_fp8_gemm_configs(rng, config):
    a, a_s, b, b_s = gemm_operands(rng, (19,), 300, 768)
    check_fp8_gemm(a, a_s, b, b_s, config=config, out_dtype=jnp.float32)


@pytest.mark.parametrize("rows", [3, 37])  # split-K narrow tiles (decode); taller tiles, M ragged
def test_fp8_gemm_reads_a_layer_of_a_stack(rng, rows):
    """b a stack of three layers' weights: the product with layer 1 (a traced index, as in the layer scan),
    against float64 on that layer alone; the other layers are O(1) off, so a wrong layer or K offset fails."""
    layers = [gemm_operands(rng, (rows,), 200, 768) for _ in range(3)]
    a, a_s = layers[0][:2]
    b, b_s = (jnp.stack([layer[i] for layer in layers]) for i in (2, 3))
    c = jax.jit(lambda layer: fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, layer=layer))(jnp.int32(1))
    assert rel_l2(c, numpy_gemm(a, a_s, b[1], b_s[1])) < gemm_tolerance(jnp.float32)


@pytest.mark.parametrize("stack, pairs", [((18, 16384, 8192), True),   # 2^31..2^32 elements
                                          ((2, 1024, 1024), False), ((35, 16384, 8192), False)])
def test_fp8_gemm_reads_large_stacks_as_byte_pairs(stack, pairs):
    """A 1-byte stack of 2^31 to 2^32 elements, which Pallas' Triton lowering would address with 32-bit signed
    offsets, goes to the kernel whole as uint16 byte pairs (no layer copied out); smaller and larger ones as they
    are. Traced only: nothing of that size is allocated."""
    k = stack[2]

    def operand_types(fn, *activations):
        b = jax.ShapeDtypeStruct(stack, FP8)
        b_s = jax.ShapeDtypeStruct((stack[0], stack[1] // 128, k // 128), jnp.float32)
        jaxpr = jax.make_jaxpr(fn)(*activations, b, b_s).jaxpr
        [call] = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        assert not [e for e in jaxpr.eqns if e.primitive.name in ("dynamic_slice", "gather")]
        return [(v.aval.dtype, v.aval.shape) for v in call.invars]

    weights = ((jnp.dtype(jnp.uint16), (*stack[:2], stack[2] // 2)) if pairs else (jnp.dtype(FP8), stack))
    layer = jnp.int32(stack[0] - 1)
    a, a_s = jax.ShapeDtypeStruct((1, k), FP8), jax.ShapeDtypeStruct((1, k // 128), jnp.float32)
    assert weights in operand_types(lambda a, a_s, b, b_s: fp8_gemm(a, a_s, b, b_s, layer=layer), a, a_s)
    x = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    assert weights in operand_types(lambda x, b, b_s: GM.dequant_gemm(x, b, b_s, layer=layer), x)


def test_fp8_gemm_twin_matches_numpy(rng):
    a, a_s, b, b_s = gemm_operands(rng, (5,), 200, 512)
    assert rel_l2(fp8_gemm_twin(a, a_s, b, b_s, out_dtype=jnp.float32), numpy_gemm(a, a_s, b, b_s)) < 1e-6


def test_default_config_covers_regimes():
    for m in (1, 16, 40, 64, 300, 4096):
        for n, k in ((7168, 18432), (2048, 7168), (130, 256)):
            cfg = GM.default_config(m, n, k, sms=132)
            cfg.check(k // 128)
            if m <= 64:
                assert cfg.split >= 1 and (k // 128) // cfg.split >= 1


# ---------------------------------------------------------------- jit and shard_map
def test_kernels_under_jit(rng):
    x = activations(rng, (3, 256))
    y, s = jax.jit(act_quant, static_argnames="scale_fmt")(x, scale_fmt="ue8m0")
    yr, sr = act_quant_twin(x, scale_fmt="ue8m0")
    np.testing.assert_array_equal(np.asarray(s), np.asarray(sr))
    w, ws = fp8_weight(rng, 130, 256)
    out = jax.jit(weight_dequant)(w, ws)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(weight_dequant_twin(w, ws), np.float32))
    c = jax.jit(lambda a, b, bs: fp8_gemm(*act_quant(a, scale_fmt="ue8m0"), b, bs))(x, w, ws)
    assert rel_l2(c.astype(jnp.float32), numpy_gemm(y, s, w, ws)) < gemm_tolerance(c.dtype)


@pytest.mark.parametrize("check_vma", [True, False])
def test_kernels_inside_shard_map(rng, check_vma):
    """Column-parallel use, as in the model: B's N split over 4 devices. (With check_vma, CPU
    interpret mode computes the jnp twin for device-varying operands: see _common.)"""
    devs = jax.devices()
    if len(devs) < 4:
        pytest.skip("needs 4 (forced host) devices")
    mesh = jax.make_mesh((4,), ("mp",), devices=devs[:4])
    x = activations(rng, (8, 256), special_blocks=False)
    b, b_s = fp8_weight(rng, 512, 256)  # 128 rows of B (one scale row) per device

    def local(x, b, b_s):
        q, s = act_quant(x)
        return fp8_gemm(q, s, b, b_s, out_dtype=jnp.float32), q, s

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("mp"), P("mp")),
                              out_specs=(P(None, "mp"), P(), P()), check_vma=check_vma))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    c, q, s = f(put(x, P()), put(b, P("mp")), put(b_s, P("mp")))
    yr, sr = act_quant_twin(x)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(yr).view(np.uint8))
    assert rel_l2(c, numpy_gemm(yr, sr, b, b_s)) < gemm_tolerance(jnp.float32)


# ---------------------------------------------------------------- validation
def _raises(fn, *args, match, **kw):
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)


def test_act_quant_errors():
    x = jnp.ones((2, 256), jnp.bfloat16)
    _raises(act_quant, jnp.ones((2, 100)), match=r"act_quant: x has last dim K=100")
    _raises(act_quant, jnp.ones((2, 256), jnp.int32), match=r"act_quant: x has dtype int32")
    _raises(act_quant, x.astype(FP8), match=r"act_quant: x has dtype float8_e4m3fn")
    _raises(act_quant, x, scale_fmt="e8m0", match=r"act_quant: scale_fmt is 'e8m0'")
    _raises(act_quant, x, block_size=64, match=r"act_quant: block_size is 64")
    _raises(act_quant, jnp.float32(1.0), match=r"act_quant: x is a scalar")


def test_weight_dequant_errors(rng):
    w, s = fp8_weight(rng, 200, 300)
    _raises(weight_dequant, w.astype(jnp.bfloat16), s, match=r"weight_dequant: w has dtype bfloat16")
    _raises(weight_dequant, w, s.astype(jnp.bfloat16), match=r"weight_dequant: s has dtype bfloat16")
    _raises(weight_dequant, w, s[:1], match=re.escape("weight_dequant: s has shape (1, 3), expected (2, 3)"))
    _raises(weight_dequant, w[None], s, match=r"weight_dequant: w has shape \(1, 200, 300\)")
    _raises(weight_dequant, w, s, block_size=64, match=r"weight_dequant: block_size is 64")
    _raises(weight_dequant, w, s, out_dtype=jnp.int8, match=r"weight_dequant: out_dtype")


def test_fp8_gemm_errors(rng):
    a, a_s, b, b_s = gemm_operands(rng, (4,), 200, 512)
    _raises(fp8_gemm, a.astype(jnp.bfloat16), a_s, b, b_s, match=r"fp8_gemm: a has dtype bfloat16")
    _raises(fp8_gemm, a, a_s, b.astype(jnp.float32), b_s, match=r"fp8_gemm: b has dtype float32")
    _raises(fp8_gemm, a, a_s.astype(jnp.bfloat16), b, b_s, match=r"fp8_gemm: a_s has dtype bfloat16")
    _raises(fp8_gemm, a, a_s, b, b_s.astype(jnp.float16), match=r"fp8_gemm: b_s has dtype float16")
    _raises(fp8_gemm, a[:, :100], a_s, b, b_s, match=r"fp8_gemm: a has last dim K=100")
    _raises(fp8_gemm, a, a_s, b[:, :384], b_s, match=re.escape("fp8_gemm: b has shape (200, 384), expected (N, 512)"))
    _raises(fp8_gemm, a, a_s[:, :3], b, b_s, match=re.escape("fp8_gemm: a_s has shape (4, 3), expected (4, 4)"))
    _raises(fp8_gemm, a, a_s, b, jnp.ones((3, 4), jnp.float32),
            match=re.escape("fp8_gemm: b_s has shape (3, 4), expected (2, 4) = (ceil(N/128), K/128)"))
    _raises(fp8_gemm, a, a_s, b, b_s, out_dtype=jnp.int32, match=r"fp8_gemm: out_dtype")
    with pytest.raises(ValueError, match=r"split to divide"):
        GM.fp8_gemm_with_config(a, a_s, b, b_s, GemmConfig(bm=16, bn=64, split=3))
    with pytest.raises(ValueError, match=r"bn <= 128"):
        GM.fp8_gemm_with_config(a, a_s, b, b_s, GemmConfig(bm=16, bn=256))
