"""Every Pallas kernel inside `jax.shard_map` with its default varying-axes check (check_vma=True) on
device-varying operands, as a user's own shard_map calls them (the model's passes check_vma=False).

On a CPU the Pallas interpreter cannot run there (it traces the kernel without the check, then
evaluates it with the check on), so each wrapper computes its jnp twin instead: the test proves the
twin is what runs and that it gives the kernel's own result (the kernel outside shard_map, in
interpret mode). On a GPU (`-m gpu`) the compiled kernel runs there, no twin, with the same result."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels
from kernel_checks import activations, fp8_weight, gemm_tolerance, rel_l2
from pallas_kernels import act_quant, fp8_gemm, grouped_gemm, grouped_gemm_swiglu, mla_decode, route, weight_dequant
from pallas_kernels.mla import mla_absorb_query, mla_decode_output, mla_decode_splits
from pallas_kernels.norm import latent_norm_rope, rms_norm

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def inside_checked_shard_map(fn, operands, backend: str):
    """fn(*operands) on every device of a mesh, each holding its own copy of the operands (so they
    are device-varying), in a shard_map that checks varying axes; device 0's result."""
    devices = jax.devices(backend)[:2]
    mesh = jax.make_mesh((len(devices),), ("mp",), devices=devices)
    copies = [jax.device_put(jnp.stack([a] * len(devices)), NamedSharding(mesh, P("mp"))) for a in operands]

    def local(*shards):
        out = fn(*(s[0] for s in shards))
        return jax.tree.map(lambda a: a[None], out)

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("mp"), out_specs=P("mp")))  # check_vma=True
    return jax.tree.map(lambda a: np.asarray(a)[0], run(*copies))


def grouped_operands(rng, fp8: bool):
    sizes = np.array([2, 0, 3, 1], np.int32)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
    if fp8:
        w = jnp.asarray(rng.standard_normal((4, 128, 256)) * 40, jnp.float8_e4m3fn)
        return x, w, jnp.asarray(sizes), jnp.asarray(rng.uniform(1e-3, 5e-2, (4, 1, 2)), jnp.float32)
    return x, jnp.asarray(rng.standard_normal((4, 128, 256)) / 16, jnp.bfloat16), jnp.asarray(sizes)


def swiglu_operands(rng):
    x, w1, sizes = grouped_operands(rng, False)
    return x, w1, grouped_operands(rng, False)[1], sizes


def mla_operands(rng):
    layers, rows, length, heads, rank, rope = 2, 3, 64, 8, 64, 16
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return (0.3 * f(2, heads, rank), 0.3 * f(2, heads, rope), f(layers, rows, length, rank),
            f(layers, rows, length, rope), jnp.int32(1), jnp.array([5, 40], jnp.int32), f(2, rank), f(2, rope))


def absorb_operands(rng):
    """q_nope (2, 8 heads, 16) and a 2-layer wkv_b stack (2, 8 * (16 + 32), 64), layer 1."""
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return f(2, 8, 16), f(2, 8 * 48, 64), jnp.int32(1)


def output_operands(rng):
    """Split softmaxes of 3 splits (2 rows, 8 heads, rank 64), the new entry, a 2-layer wkv_b stack, layer 1."""
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    acc, maxima, sums = f(2, 3, 8, 64), f(2, 3, 8), jnp.abs(f(2, 3, 8)) + 1
    return acc, maxima, sums, 0.3 * f(2, 8, 64), 0.3 * f(2, 8, 16), f(2, 64), f(2, 16), f(2, 8 * 48, 64), jnp.int32(1)


def norm_operands(rng):
    """float32 rows (3, 512) and a residual, a 2-layer norm weight stack, layer 1."""
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return f(3, 512), f(3, 512), jnp.abs(f(2, 512)) + 0.5, jnp.int32(1)


def merged_splits(q_latent, q_pe, kv_cache, pe_cache, layer, lengths):
    """`mla_decode_splits`' partial softmaxes merged (the twin keeps one split, the kernel several)."""
    acc, maxima, sums = mla_decode_splits(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, kv_len=64, scale=0.2)
    weight = jnp.exp(maxima - maxima.max(axis=1, keepdims=True))
    return (acc * weight[..., None]).sum(axis=1) / (sums * weight).sum(axis=1)[..., None]


# (twin's module, twin's name, kernel, operands(rng), relative tolerance against the kernel: 0 means bit for bit)
CASES = {
    "act_quant": ("quantize", "act_quant_ref", act_quant, lambda rng: (activations(rng, (4, 384)),), 0),
    "weight_dequant": ("dequantize", "weight_dequant_ref", weight_dequant, lambda rng: fp8_weight(rng, 200, 256), 0),
    "fp8_gemm": ("gemm", "fp8_gemm_ref", functools.partial(fp8_gemm, out_dtype=jnp.float32),
                 lambda rng: (*act_quant(activations(rng, (5, 256), special_blocks=False)), *fp8_weight(rng, 256, 256)),
                 gemm_tolerance(jnp.float32)),
    "grouped_gemm": ("grouped", "grouped_gemm_ref", functools.partial(grouped_gemm, out_dtype=jnp.float32),
                     lambda rng: grouped_operands(rng, False), 1e-5),
    "grouped_gemm_fp8": ("grouped", "grouped_gemm_ref", functools.partial(grouped_gemm, out_dtype=jnp.float32),
                         lambda rng: grouped_operands(rng, True), 1e-5),
    "grouped_gemm_swiglu": ("grouped", "grouped_gemm_swiglu_ref",
                            functools.partial(grouped_gemm_swiglu, out_dtype=jnp.float32),
                            swiglu_operands, 1e-5),
    "mla_decode": ("mla", "mla_decode_ref", functools.partial(mla_decode, scale=0.2, kv_len=64),
                   mla_operands, 1e-5),
    "mla_decode_splits": ("mla", "mla_decode_splits_ref", merged_splits, lambda rng: mla_operands(rng)[:6], 1e-5),
    "mla_absorb_query": ("mla", "mla_absorb_query_ref", mla_absorb_query, absorb_operands, 1e-5),
    "mla_absorb_query_rope": ("mla", "mla_absorb_query_ref",
                              lambda q, w, layer, c, s: mla_absorb_query(q, w, layer, nope=16, rope=(c, s, True)),
                              lambda rng: (jnp.asarray(rng.standard_normal((2, 8, 16 + 32)), jnp.float32),
                                           *absorb_operands(rng)[1:], jnp.asarray(rng.uniform(-1, 1, (2, 16)),
                                                                                  jnp.float32),
                                           jnp.asarray(rng.uniform(-1, 1, (2, 16)), jnp.float32)), 1e-5),
    "mla_decode_output": ("mla", "mla_decode_output_ref", functools.partial(mla_decode_output, scale=0.2, v_dim=32),
                          output_operands, 1e-5),
    "rms_norm": ("norm", "rms_norm_ref", lambda x, r, w, layer: rms_norm(x, w, eps=1e-6, residual=r, layer=layer),
                 norm_operands, 1e-6),
    "latent_norm_rope": ("norm", "latent_norm_rope_ref",
                         lambda kv, w, c, s, layer: latent_norm_rope(kv, w, c, s, eps=1e-6, rank=512, layer=layer),
                         lambda rng: (jnp.asarray(rng.standard_normal((3, 576)), jnp.float32), norm_operands(rng)[2],
                                      jnp.cos(norm_operands(rng)[0][:, :32]), jnp.sin(norm_operands(rng)[0][:, :32]),
                                      jnp.int32(0)), 1e-6),
    "route": ("router", "route_ref",
              functools.partial(route, topk=4, n_groups=4, topk_groups=2, score_func="sigmoid", normalize=True),
              lambda rng: (jnp.asarray(rng.standard_normal((6, 32)), jnp.float32),
                           jnp.asarray(0.1 * rng.standard_normal(32), jnp.float32)), 0),
}


def assert_like(got, want, tol: float, what: str):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, what
        if tol == 0 or not np.issubdtype(w.dtype, np.floating):
            np.testing.assert_array_equal(g.view(np.uint8) if g.dtype.itemsize == 1 else g,
                                          w.view(np.uint8) if w.dtype.itemsize == 1 else w, err_msg=what)
        else:
            assert rel_l2(g, w) <= tol, (what, rel_l2(g, w))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_in_a_checked_shard_map(rng, monkeypatch, name, backend):
    if backend != jax.default_backend():
        pytest.skip(f"the {backend} path needs {backend} as the default backend")
    module_name, twin_name, kernel, make_operands, tol = CASES[name]
    with jax.default_device(jax.devices(backend)[0]):
        operands = make_operands(rng)
        outside = kernel(*operands)  # interpret mode on a CPU, compiled on a GPU: no twin
    module = getattr(pallas_kernels, module_name)
    twin, calls = getattr(module, twin_name), []
    monkeypatch.setattr(module, twin_name, lambda *a, **k: calls.append(1) or twin(*a, **k))
    inside = inside_checked_shard_map(kernel, operands, backend)
    assert len(calls) == (backend == "cpu"), f"{name}: the twin ran {len(calls)} times on {backend}"
    assert_like(inside, outside, tol, name)
