"""Every kernel path the "auto" options take on an H200 lowers for CUDA, checked on a CPU.

Pallas' interpret mode (the CPU tests) never runs the Triton or Mosaic GPU lowering, so a kernel that
computes the right numbers in interpret mode can still fail to compile on a GPU (a scalar select's
literals typed as its i1 predicate did; every slots-form launch then failed). Both lowerings run in
Python: here the steps of tests/test_auto_paths_gpu.py's small V3 model are lowered for the "cuda"
platform with the backend queries answering as an H200 would (`jax.default_backend()` "gpu", compute
capability 9.0, the kernels' `hopper()` true), and the test asserts that each step lowers and which
kernels it holds: the same (Mosaic, Triton) facts test_auto_paths_gpu.py asserts on a GPU, and the
decode kernels by name. Nothing is compiled or run; a fresh jitted step per lowering keeps these
traces out of the memoized steps that other tests run on the CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
from collections import Counter
from types import SimpleNamespace

import jax
import pytest
from jax._src.pallas.triton import pallas_call_registration as triton_registration

import dsv3_jax
from dsv3_jax.decode.step import make_step
from dsv3_jax.model.layers import BIG_PROJECTION_BYTES, PROJECTION_KERNEL_MAX_ROWS
from dsv3_jax.model.moe import NARROW_SWIGLU_TILE_MAX_ROWS, WIDE_DOWN_TILE_MAX_ROWS, auto_moe_impl
from pallas_kernels.projection import VECTOR_MAX_ROWS
from test_auto_paths_gpu import KERNELS, MOSAIC, STEPS, TRITON, small_v3, step_inputs, variant

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# the kernels of every MLA + MoE decode step (three MLA launches, the router, the two slot kernels, the norms); the
# latent's norm and the shared key's rotary run inside mla_absorb_query's launch, latent_norm_rope in no decode step
DECODE_KERNELS = {"mla_absorb_query", "mla_decode", "mla_decode_output", "route", "grouped_gemm_swiglu",
                  "grouped_gemm", "rms_norm"}


@contextlib.contextmanager
def lowering_as_on_an_h200():
    """The backend queries the kernels and the model dispatch on answer as on an H200 (sm_90)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax, "default_backend", lambda: "gpu")
        patch.setattr(triton_registration.gpu_info_lib, "get_gpu_info",
                      lambda: SimpleNamespace(compute_capability=90))
        for name in ("_common", "gemm", "flash_attention", "grouped"):
            patch.setattr(importlib.import_module(f"pallas_kernels.{name}"), "hopper", lambda: True)
        yield
    jax.clear_caches()


def lowered_steps(model, steps=STEPS, *, unroll: bool = False) -> list[str]:
    """The CUDA lowering's text of each of `steps` (on the model's empty cache: lowering reads shapes)."""
    parts = model.parts
    if unroll:  # what decode graphs trace (`decode_step_parts`)
        parts = parts._replace(options=dataclasses.replace(parts.options, unroll=True))
    texts = []
    with lowering_as_on_an_h200():
        step = make_step.__wrapped__(parts)  # a fresh jit: its traces stay here
        for seed, (_, batch, seq, start) in enumerate(steps):
            tokens, starts, last, kv_len = step_inputs(model.args, batch, seq, start, seed)
            traced = step.trace(model.state, model.cache, tokens, starts, last, kv_len=kv_len)
            texts.append(traced.lower(lowering_platforms=("cuda",)).as_text())
    return texts


def padded_copies(text: str) -> list[str]:
    """The pads of a lowered step that copy their operand into a larger buffer (XLA drops the ones that pad nothing)."""
    return [line.strip() for line in text.splitlines() if "stablehlo.pad" in line
            and re.search(r"(low|high) = \[[0, ]*[1-9]", line)]


def triton_kernels(text: str) -> Counter:
    """The Pallas Triton kernels of a lowered step, by name, with their launch counts."""
    return Counter(re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*name = "([a-z_0-9]+)"', text))


@pytest.fixture(scope="module")
def built():
    return {weights: dsv3_jax.build(small_v3(weights), seed=0) for weights in ("bf16", "fp8")}


@pytest.mark.parametrize("weights, gemm_impl", list(KERNELS))
def test_every_auto_path_lowers_for_an_h200(built, weights, gemm_impl):
    model = variant(built[weights], gemm_impl=gemm_impl)
    args = model.args
    mlp_inter = max(args.inter_dim, args.n_shared_experts * args.moe_inter_dim)
    assert 3 * mlp_inter * args.dim * 2 < BIG_PROJECTION_BYTES, "the launch counts below assume small MLPs"
    for (what, batch, seq, _), text, kernels in zip(STEPS, lowered_steps(model), KERNELS[weights, gemm_impl],
                                                    strict=True):
        assert (MOSAIC in text, TRITON in text) == kernels, f"{what}: kernels in the step differ from {kernels}"
        names = triton_kernels(text)
        if seq == 1:
            assert DECODE_KERNELS <= set(names), f"{what}: {sorted(DECODE_KERNELS - set(names))} missing"
            assert "latent_norm_rope" not in names, f"{what}: {dict(names)}"
            # decode-sized grouped launches read past their last row masked: no padded copy of their rows or scales
            assert not padded_copies(text), f"{what}: {padded_copies(text)}"
            # plain weights: attention's projections in three launches a layer (wq_a and wkv_a after attn_norm, wq_b
            # after q_norm, and wo, which a few rows leave to XLA), and the dense layers' MLP in two (w1 + w3, then
            # w2, under BIG_PROJECTION_BYTES here) as dots past a few rows, on XLA below; the MoE layers' shared
            # experts run inside the routed experts' grouped launches ("slots" and "fused"); fp8 weights keep
            # act_quant and the fp8 GEMMs
            few_rows = batch <= VECTOR_MAX_ROWS
            attention, dense_mlp = (0, 0) if weights == "fp8" else (3 - few_rows, 2 * (not few_rows))
            launches = attention * args.n_layers + dense_mlp * args.n_dense_layers
            assert names["norm_project"] == launches, f"{what}: {dict(names)}"
        if weights == "fp8" and gemm_impl == "bf16":
            # decode-sized steps dequantize fp8 projections inside dequant_gemm's kernel, prefill first
            assert ("weight_dequant" in names) == (seq > 1), f"{what}: {dict(names)}"
            assert ("dequant_gemm" in names) == (seq == 1), f"{what}: {dict(names)}"
        if gemm_impl == "fp8":
            assert names["act_quant"] and (names["fp8_gemm"] or MOSAIC in text), f"{what}: {dict(names)}"
        if gemm_impl == "fp8" and seq == 1:
            # the norms quantize for the 8 GEMMs after them (wq_a, wkv_a, wq_b a layer, the dense w1, w3); without
            # that every fp8 GEMM has its act_quant, and the routed experts' kernels one or two more
            assert names["fp8_gemm"] - names["act_quant"] >= 6, f"{what}: {dict(names)}"


def test_unrolled_decode_steps_lower_for_an_h200(built):
    """Decode graphs trace the layers unrolled: no loop, each kernel launched once a layer."""
    model = variant(built["fp8"], gemm_impl="fp8")
    args, decode = model.args, [step for step in STEPS if step[2] == 1][:1]
    for (what, *_), text in zip(decode, lowered_steps(model, decode, unroll=True), strict=True):
        assert "stablehlo.while" not in text, f"{what}: a loop in the unrolled step"
        names = triton_kernels(text)
        assert names["mla_decode"] == args.n_layers, f"{what}: {dict(names)}"
        assert names["grouped_gemm_swiglu"] == args.n_layers - args.n_dense_layers, f"{what}: {dict(names)}"
        # attn_norm, q_norm and ffn_norm a layer, then the final norm; kv_norm in mla_absorb_query's launch
        assert names["rms_norm"] == 3 * args.n_layers + 1, f"{what}: {dict(names)}"
        assert names["mla_absorb_query"] == args.n_layers and not names["latent_norm_rope"], f"{what}: {dict(names)}"


def test_projections_take_one_launch_up_to_their_row_bound(built):
    """Steps of up to PROJECTION_KERNEL_MAX_ROWS rows (here 8 rows of 4 tokens, as speculative verification steps)
    run attention's projections (three launches a layer) and the dense MLP's (two) in norm_project's launches; a
    step of 8 more rows runs them all on XLA."""
    model = variant(built["bf16"], gemm_impl="bf16")
    args, batch = model.args, model.args.max_batch_size
    tokens = PROJECTION_KERNEL_MAX_ROWS // batch
    steps = [(f"{batch} x {n} tokens", batch, n, 16) for n in (tokens, tokens + 1)]
    within, past = (triton_kernels(text)["norm_project"] for text in lowered_steps(model, steps))
    assert (within, past) == (3 * args.n_layers + 2 * args.n_dense_layers, 0)


def test_a_one_token_steps_slot_launches_take_their_tiles(built):
    """The down projection's grouped launch of at most WIDE_DOWN_TILE_MAX_ROWS rows takes 16 x 128 tiles: at one
    token (8 routed slots and the shared expert's row) dim / 128 column programs; at 8 tokens (72 rows) 16 x 64
    tiles, dim / 64. The swiglu launch takes 16 x 32 tiles at one token (NARROW_SWIGLU_TILE_MAX_ROWS; its slots form
    has a row a token) and 16 x 64 at 8 (8 rows in the slots form, 72 gathered ones in "fused")."""
    model = variant(built["fp8"], gemm_impl="fp8")
    steps = [("decode b=1", 1, 1, 300), ("decode b=8", 8, 1, 16)]
    dim, inter = model.args.dim, model.args.moe_inter_dim
    for (what, batch, *_), text in zip(steps, lowered_steps(model, steps), strict=True):
        grids = {name: [int(g) for line in text.splitlines() if f'name = "{name}"' in line
                        for g in re.findall(r"grid_y = (\d+) : i32", line)]
                 for name in ("grouped_gemm", "grouped_gemm_swiglu")}
        rows = batch * (model.args.n_activated_experts + model.args.n_shared_experts)
        assert grids["grouped_gemm"] == [dim // (128 if rows <= WIDE_DOWN_TILE_MAX_ROWS else 64)], f"{what}: {grids}"
        slots = auto_moe_impl(batch * model.args.n_activated_experts, model.args.n_routed_experts, True) == "slots"
        swiglu_rows = batch if slots else rows  # the slots form's x has a row a token, "fused" one a slot
        assert grids["grouped_gemm_swiglu"] == [inter // (32 if swiglu_rows <= NARROW_SWIGLU_TILE_MAX_ROWS else 64)], \
            f"{what}: {grids}"


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_the_gate_in_the_norms_launch_lowers_for_an_h200(built, weights):
    """router "norm-gate", the decode step unrolled: the norm before each MoE computes the gate's logits in its
    launch (as many rms_norm launches as without, one route a MoE layer) and XLA's gate GEMM is gone (one
    dot_general fewer a MoE layer than under router "kernel")."""
    gemm_impl = "fp8" if weights == "fp8" else "bf16"
    decode = [step for step in STEPS if step[2] == 1][:1]
    texts = {router: lowered_steps(variant(built[weights], gemm_impl=gemm_impl, router=router), decode,
                                   unroll=True)[0] for router in ("kernel", "norm-gate")}
    args = built[weights].args
    moe_layers = args.n_layers - args.n_dense_layers
    names = {router: triton_kernels(text) for router, text in texts.items()}
    assert names["norm-gate"]["rms_norm"] == names["kernel"]["rms_norm"] >= args.n_layers + 1, names
    assert names["norm-gate"]["route"] == moe_layers, names
    dots = {router: text.count("stablehlo.dot_general") for router, text in texts.items()}
    assert dots["norm-gate"] == dots["kernel"] - moe_layers, dots
