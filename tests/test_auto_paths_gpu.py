"""GPU (sm_90): every kernel path the "auto" options take on an H200, at the model level.

moe_impl "auto" runs "slots", "fused" or the grouped kernel by the step's size, the grouped kernel on
wgmma (Mosaic) past MOSAIC_MIN_ROWS rows with bf16 weights; gemm_impl "fp8" takes the Mosaic fp8 GEMM
from MOSAIC_MIN_M rows (prefill), Triton below; fp8 weights under gemm_impl "bf16" go through the
weight_dequant kernel in prefill and dequant_gemm (split over K) in decode-sized steps
(`Linear.dequantizing_kernel`); decode_attn "auto" runs the MLA decode kernel on single-token steps; prefill_attn
"auto" runs the Mosaic flash-attention kernel on prefill chunks of FLASH_MIN_QUERIES queries or more.
Each step of a small V3-shaped model is compared with the same model whose Pallas kernels all give way
to their jnp twins (`kernel_checks.kernel_twins(everywhere=True)` and prefill_attn "jnp": the model's
XLA version), and the test
asserts which path each step takes (the dispatch functions, and the kernels in the lowered step).
Also: a rank's routed experts on a 1-device mesh, with zero-row groups and assignments to a second,
simulated rank's experts, against float64; and the router kernel against XLA routing in the model.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dsv3_jax
from dsv3_jax.config import ModelArgs
from dsv3_jax.model.attention import FLASH_MIN_QUERIES
from dsv3_jax.model.moe import (FUSED_MAX_ROWS, ROUTER_KERNEL_MAX_TOKENS, SLOTS_MAX, Experts, _kernel_tiles, auto_moe_impl,
                                 router_impl)
from dsv3_jax.options import RunOptions, StepContext
from dsv3_jax.sharding import make_mesh
from kernel_checks import kernel_twins
from pallas_kernels import MOSAIC_MIN_ROWS, fp8_gemm_path, grouped_gemm_backend
from pallas_kernels.gemm import MOSAIC_MIN_M

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOL = 2e-2  # relative L2 of bf16 logits, kernels against twins (as tests/test_layer_mix_gpu.py's kernel vs ragged)
MOSAIC, TRITON = "mosaic_gpu", "__gpu$xla.gpu.triton"  # the custom calls of the two Pallas GPU backends

# (what, batch, tokens per row, start position): each step goes on from the cache the previous left
STEPS = [("prefill 2x300", 2, 300, 0), ("decode b=2", 2, 1, 300), ("prefill 8x16", 8, 16, 0), ("decode b=8", 8, 1, 16)]
MOE_AUTO = ["kernel", "slots", "fused", "slots"]  # what moe_impl "auto" runs at each step (8 experts a token)
ROUTER_AUTO = ["xla", "kernel", "xla", "kernel"]  # what router "auto" runs at each step
# which backends' kernels each step lowers to, per (weights, gemm_impl): [(Mosaic, Triton) per step]
KERNELS = {
    ("bf16", "bf16"): [(True, False), (False, True), (False, True), (False, True)],  # Mosaic grouped GEMM, flash
    ("fp8", "bf16"): [(True, True)] + [(False, True)] * 3,  # flash; weight_dequant, fp8 grouped kernels on Triton
    ("fp8", "fp8"): [(True, True), (False, True), (True, True), (False, True)],  # Mosaic fp8 GEMM from 128 rows
}


def small_v3(weights: str) -> ModelArgs:
    """V3's architecture (MLA, 8 of 32 experts, sigmoid group routing) at a size that compiles fast;
    every fp8 dimension a multiple of 128."""
    return ModelArgs.from_reference_json(CONFIGS / "config_671B.json").replace(
        n_layers=2, n_dense_layers=1, dtype=weights, max_batch_size=8, max_seq_len=512, vocab_size=4096, dim=1024,
        inter_dim=2048, moe_inter_dim=512, n_heads=8, n_routed_experts=32, n_expert_groups=4, n_limited_groups=2,
        q_lora_rank=256)


@pytest.fixture(scope="module")
def built():
    """built(weights) -> one random model per weight format, shared by the tests."""
    models = {}

    def get(weights: str):
        if weights not in models:
            models[weights] = dsv3_jax.build(small_v3(weights), seed=0)
        return models[weights]

    return get


def variant(model, **choices) -> dsv3_jax.Model:
    return dsv3_jax.Model(model.args, model.graphdef, model.state, model.mesh,
                          RunOptions.make(model.options, **choices))


def with_random_norms(model, names) -> dsv3_jax.Model:
    """The model with the weights of the named norms drawn around 1 (a build leaves them all 1, where a kernel that
    dropped a norm's weight would pass)."""
    rng = np.random.default_rng(5)

    def leaf(path, value):
        named = any(name in jax.tree_util.keystr(path) for name in names)
        return jnp.asarray(1 + 0.5 * rng.standard_normal(value.shape), value.dtype) if named else value

    state = jax.tree_util.tree_map_with_path(leaf, model.state)
    return dsv3_jax.Model(model.args, model.graphdef, state, model.mesh, model.options)


def step_inputs(args: ModelArgs, batch: int, seq: int, start: int, seed: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, args.vocab_size, (batch, seq)).astype(np.int32)
    starts = np.full((batch,), start, np.int32)
    kv_len = dsv3_jax.cache_window(start + seq, args.max_seq_len)
    return tokens, starts, np.full((batch,), seq - 1, np.int32), kv_len


def run_steps(model) -> list[tuple[np.ndarray, str]]:
    """(logits, lowered step text) of every step of STEPS, in order, on `model`'s own cache."""
    out = []
    for seed, (_, batch, seq, start) in enumerate(STEPS):
        tokens, starts, last, kv_len = step_inputs(model.args, batch, seq, start, seed)
        text = model.step.lower(model.state, model.cache, tokens, starts, last, kv_len=kv_len).as_text()
        logits, model.cache = model.step(model.state, model.cache, tokens, starts, last, kv_len=kv_len)
        out.append((np.asarray(logits), text))
    return out


def test_the_steps_take_the_paths_named():
    """The dispatch facts the comparisons below rely on (so that a changed threshold shows here)."""
    args = small_v3("bf16")
    slots = [batch * seq * args.n_activated_experts for _, batch, seq, _ in STEPS]
    assert [auto_moe_impl(s, args.n_routed_experts, kernels=True) for s in slots] == MOE_AUTO
    assert slots[1] <= slots[3] <= SLOTS_MAX < slots[2] <= FUSED_MAX_ROWS == MOSAIC_MIN_ROWS < slots[0]
    x = jax.ShapeDtypeStruct((slots[0], args.dim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((args.n_routed_experts, args.moe_inter_dim, args.dim), jnp.bfloat16)
    assert grouped_gemm_backend(x, w) == "mosaic"
    w8 = jax.ShapeDtypeStruct(w.shape, jnp.float8_e4m3fn)
    s8 = jax.ShapeDtypeStruct((w.shape[0], w.shape[1] // 128, w.shape[2] // 128), jnp.float32)
    assert grouped_gemm_backend(x, w8, s8) == "triton"
    rows = [batch * seq for _, batch, seq, _ in STEPS]  # a dense projection's M: 600 (ragged), 2, 128, 8
    assert [fp8_gemm_path(m, args.q_lora_rank, args.dim) for m in rows] == ["mosaic", "triton", "mosaic", "triton"]
    assert rows[2] == MOSAIC_MIN_M and rows[0] % 128
    assert [seq >= FLASH_MIN_QUERIES for _, _, seq, _ in STEPS] == [True, False, False, False]
    assert [router_impl("auto", m) for m in rows] == ROUTER_AUTO and rows[3] <= ROUTER_KERNEL_MAX_TOKENS < rows[2]


@pytest.fixture(scope="module")
def auto_runs(built):
    """auto_runs(weights, gemm_impl) -> run_steps of the model with every other option "auto" (the
    defaults), made once."""
    runs = {}

    def get(weights: str, gemm_impl: str):
        if (weights, gemm_impl) not in runs:
            auto = variant(built(weights), gemm_impl=gemm_impl)
            assert (auto.options.moe_impl, auto.options.decode_attn, auto.options.router) == ("auto", "auto", "auto")
            runs[weights, gemm_impl] = run_steps(auto)
        return runs[weights, gemm_impl]

    return get


@pytest.mark.parametrize("weights, gemm_impl", list(KERNELS))
def test_auto_paths_equal_the_xla_model(built, auto_runs, weights, gemm_impl):
    base = built(weights)
    got = auto_runs(weights, gemm_impl)
    with kernel_twins(everywhere=True):
        want = run_steps(variant(base, gemm_impl=gemm_impl, prefill_attn="jnp"))
    for (what, *_), (g, text), (w, twin_text), kernels in zip(STEPS, got, want, KERNELS[weights, gemm_impl],
                                                              strict=True):
        assert (MOSAIC in text, TRITON in text) == kernels, f"{what}: kernels in the step differ from {kernels}"
        assert MOSAIC not in twin_text and TRITON not in twin_text, f"{what}: the XLA model runs a kernel"
        assert np.isfinite(g).all(), what
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < TOL, f"{what} ({weights} weights, gemm_impl {gemm_impl}): relative L2 {rel:.2e} vs XLA"


def test_router_kernel_in_the_model(built, auto_runs):
    """router "auto" runs the one-launch Pallas router on the decode steps (ROUTER_AUTO) and "kernel" on
    every step, "norm-gate" the gate's GEMM in the norm's launch where that norm is a kernel (decode steps: one
    dot_general fewer than "kernel"); each against the XLA routing (router "xla"), same weights."""
    auto, xla = auto_runs("bf16", "bf16"), run_steps(variant(built("bf16"), router="xla"))
    kernel = run_steps(variant(built("bf16"), router="kernel"))
    norm_gate = run_steps(variant(built("bf16"), router="norm-gate"))
    for (what, _, seq, _), (a, auto_text), (k, kernel_text), (n, norm_text), (w, xla_text), picked in zip(
            STEPS, auto, kernel, norm_gate, xla, ROUTER_AUTO, strict=True):
        assert kernel_text.count(TRITON) > xla_text.count(TRITON), f"{what}: no router kernel in the step"
        assert (auto_text.count(TRITON) > xla_text.count(TRITON)) == (picked == "kernel"), \
            f"{what}: router auto should run {picked}"
        gate_gemms = kernel_text.count("stablehlo.dot_general") - norm_text.count("stablehlo.dot_general")
        assert gate_gemms == (seq == 1), f"{what}: router norm-gate left {gate_gemms} fewer dot_generals"
        for name, g in (("auto", a), ("kernel", k), ("norm-gate", n)):
            rel = np.linalg.norm(g - w) / np.linalg.norm(w)
            assert rel < TOL, f"{what}: router {name} vs XLA routing relative L2 {rel:.2e}"


# ------------------------------------------------------------------ one rank's experts, zero groups, foreign experts
LOCAL, TOPK, DIM, INTER = 8, 4, 256, 256
IDLE = (3, 6)  # local experts no token picks: groups of zero rows


def rank_inputs(rng, tokens: int):
    """Assignments over 2 x LOCAL experts (the second half a simulated other rank's), none to IDLE,
    token 0's all to the other rank; routing weights in (0.1, 1)."""
    candidates = np.array([e for e in range(2 * LOCAL) if e not in IDLE])
    indices = np.stack([rng.choice(candidates, TOPK, replace=False) for _ in range(tokens)]).astype(np.int32)
    indices[0] = rng.choice(np.arange(LOCAL, 2 * LOCAL), TOPK, replace=False)
    x = jnp.asarray(rng.standard_normal((tokens, DIM)), jnp.bfloat16)
    return x, jnp.asarray(rng.uniform(0.1, 1.0, (tokens, TOPK)), jnp.float32), jnp.asarray(indices)


def float64_experts(linears: dict, x, weights, indices) -> np.ndarray:
    """sum over a token's local assignments of weight * w2(silu(w1 x) * w3 x), float64."""
    x, weights, indices = (np.asarray(a, np.float64) for a in (x, weights, indices))
    out = np.zeros_like(x)
    for t in range(len(x)):
        for w, e in zip(weights[t], indices[t].astype(int)):
            if e < LOCAL:
                a, b = x[t] @ linears["w1"][e].T, x[t] @ linears["w3"][e].T
                out[t] += w * ((a / (1 + np.exp(-a)) * b) @ linears["w2"][e].T)
    return out


def dequantized(linear) -> np.ndarray:
    w = np.asarray(linear.weight[...].astype(jnp.float32), np.float64)
    if linear.scale is None:
        return w
    scale = np.asarray(linear.scale[...], np.float64)
    return w * np.repeat(np.repeat(scale, 128, 1), 128, 2)[:, :w.shape[1], :w.shape[2]]


# decode-sized (16-row tiles; 40 x 4 rows over 8 experts: 32-row tiles); 2,400 rows: past MOSAIC_MIN_ROWS
@pytest.mark.parametrize("tokens", [3, 40, 600])
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_one_ranks_experts_with_zero_groups_and_foreign_assignments(rng, weights, tokens):
    args = ModelArgs(dim=DIM, moe_inter_dim=INTER, n_routed_experts=LOCAL, n_activated_experts=TOPK, dtype=weights)
    experts = Experts(args, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    if weights == "bf16":  # init scale 1/sqrt(fan-in) for every projection (fp8: init_fp8's)
        for name in ("w1", "w2", "w3"):
            w = getattr(experts, name).weight
            w.set_value(jnp.asarray(rng.standard_normal(w.shape) / np.sqrt(w.shape[-1]), jnp.bfloat16))
    linears = {name: dequantized(getattr(experts, name)) for name in ("w1", "w2", "w3")}
    x, weights_, indices = rank_inputs(rng, tokens)
    expected = float64_experts(linears, x, weights_, indices)
    if tokens == 40:  # 160 rows over 8 experts, 20 an expert: the "fused" and "kernel" launches' 32-row tiles
        assert _kernel_tiles(tokens * TOPK, LOCAL, weights == "fp8")["block_m"] == 32
    if weights == "bf16" and tokens == 600:
        assert grouped_gemm_backend(jnp.zeros((tokens * TOPK, DIM), jnp.bfloat16), experts.w1.weight[...]) == "mosaic"
    graphdef, state = nnx.split(experts)
    zeros = jnp.zeros((1, 1), jnp.int32)
    for impl in ("kernel", "fused", "slots"):
        ctx = StepContext(zeros, zeros.astype(jnp.float32)[..., None], zeros.astype(jnp.float32)[..., None], 1,
                          RunOptions(moe_impl=impl))
        run = jax.jit(jax.shard_map(lambda s, *a: nnx.merge(graphdef, s)(*a, ctx), mesh=make_mesh(1),
                                    in_specs=(P(),) * 4, out_specs=P(), check_vma=False))
        got = np.asarray(run(state, x, weights_, indices), np.float64)
        assert not got[0].any(), f"{impl}: a token of only the other rank's experts must come out zero"
        err = np.linalg.norm(got - expected, axis=1) / np.maximum(np.linalg.norm(expected, axis=1), 1e-30)
        # bf16 hidden state and output (2^-9 relative each): measured <= 2.2e-3 a row in interpret mode;
        # a row given another expert's weights, or a zero group's rows left to the next one, errs by ~1
        assert err[1:].max() < 1e-2, f"{impl} ({weights}, {tokens} tokens): worst row {err[1:].argmax() + 1} " \
                                     f"relative error {err[1:].max():.2e} against float64"
