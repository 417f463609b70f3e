"""The MLA decode kernels compiled for an H200 keep their values in registers, checked on a CPU.

A Triton kernel whose values do not fit its registers spills them to local memory, and a spilling decode
kernel can run orders of magnitude slower than its bytes say (mla_decode_output once hoisted a whole group
of split loads out of a single-step loop: 255 registers, 1,872 bytes spilled a thread, 2 ms a launch on an
H200 against ~10 µs). Neither the interpret mode nor the lowering test sees registers; here each kernel is
lowered for sm_90 as tests/test_gpu_lowering.py does, its Triton IR compiled to PTX by the `triton` package
and assembled by the ptxas it ships, whose report must show no spill stores. Nothing runs on a GPU.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import lowering as triton_lowering

import dsv3_jax
from pallas_kernels.grouped import grouped_gemm, grouped_gemm_swiglu
from pallas_kernels.mla import default_output_tiles, mla_absorb_query, mla_decode_output, mla_decode_splits
from pallas_kernels.norm import rms_norm, rms_norm_fp8
from pallas_kernels.router import route
from test_auto_paths_gpu import STEPS, small_v3, variant
from test_gpu_lowering import lowered_steps, lowering_as_on_an_h200

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Pallas' Triton backend's own notice
triton = pytest.importorskip("triton")
RANK, NOPE, V, ROPE, LAYERS = 512, 128, 128, 64, 3  # the MLA shapes of V2-Lite and V3
SHARED_MEMORY_PER_SM, REGISTERS_PER_SM = 228 * 1024, 65536  # an H100's / H200's SM
F = jnp.bfloat16


def spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@contextlib.contextmanager
def captured_triton_modules():
    """Yields a list that fills with (kernel name, Triton IR) for each Pallas kernel lowered while open."""
    modules, lower = [], triton_lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *a, **k):
        result = lower(jaxpr, *a, **k)
        modules.append((jaxpr.debug_info.func_name, result.module.operation.get_asm()))
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", capture)
        yield modules


def triton_modules(fn, *args) -> list:
    """The Triton IR of every Pallas kernel that fn(*args) launches, lowered for an H200."""
    with lowering_as_on_an_h200(), captured_triton_modules() as modules:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return [ir for _, ir in modules]


@pytest.fixture(autouse=True)
def triton_cache_in_tmp(tmp_path, monkeypatch):
    """Triton's compile cache for this test only (nothing written to the home directory)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))


def ptx_for_sm90(ir: str, tmp_path, num_warps: int = 4, num_stages: int = 1) -> str:
    """One Triton module compiled to PTX for sm_90 by the `triton` package."""
    from triton.backends.compiler import GPUTarget

    path = tmp_path / "kernel.ttir"
    path.write_text(ir)
    return triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]


def ptxas_report(ir: str, tmp_path, num_warps: int = 4, num_stages: int = 1) -> str:
    """ptxas -v's lines for one Triton module compiled for sm_90a."""
    ptx = ptx_for_sm90(ir, tmp_path, num_warps, num_stages)
    (tmp_path / "kernel.ptx").write_text(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    done = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(tmp_path / "kernel.ptx"), "-o", os.devnull],
                          capture_output=True, text=True, check=True)
    return done.stderr


def spilled_bytes(report: str) -> int:
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def decode_operands(batch: int, heads: int, splits: int, fp8: bool) -> tuple:
    rows = heads * (NOPE + V)
    wkv_b = spec((LAYERS, rows, RANK), jnp.float8_e4m3fn if fp8 else F)
    scale = spec((LAYERS, rows // 128, RANK // 128)) if fp8 else None
    return (spec((batch, splits, heads, RANK)), spec((batch, splits, heads)), spec((batch, splits, heads)),
            spec((batch, heads, RANK), F), spec((batch, heads, ROPE), F), spec((batch, RANK), F),
            spec((batch, ROPE), F), wkv_b, scale)


# (batch, heads, splits, fp8, v_blocks): V2-Lite's 16 heads and V3's 128 at decode batches, splits of one merge
# group and of several (the V3 cut's b=8 at a 608-position window has 5, V2-Lite's b=1 and b=8 have 10), one V
# block a program and several (the program's V blocks looped over after one merge; at V3's b=1 a head's eight V
# blocks in one program is the candidate against 1,024 one-block programs). Batches of more than 16 rows
# run in 16-row programs: 32- and 64-row ones spilled (benchmarks/NOTES.md); there, with a bf16 wkv_b, the default
# V tiles are 64 wide, and 128 wide (8 warps) past WHOLE_VALUE_TILES_ABOVE_ROWS rows
OUTPUT_CASES = [(1, 16, 10, False, 1), (8, 16, 10, False, 1), (8, 128, 5, True, 1), (1, 128, 10, True, 1),
                (16, 16, 3, False, 1), (32, 16, 10, False, 1), (64, 128, 5, True, 1), (32, 16, 10, False, 8),
                (64, 16, 5, False, 1), (8, 128, 5, True, 4), (1, 128, 9, True, 8), (128, 16, 2, False, 1),
                (256, 16, 4, False, 1)]


@pytest.mark.parametrize("batch, heads, splits, fp8, v_blocks", OUTPUT_CASES)
def test_mla_decode_output_does_not_spill(batch, heads, splits, fp8, v_blocks, tmp_path):
    def output(acc, m, l, q, qpe, kv, pe, wkv_b, scale):
        return mla_decode_output(acc, m, l, q, qpe, kv, pe, wkv_b, jnp.int32(1), scale=0.1, v_dim=V,
                                 wkv_b_scale=scale, v_blocks=v_blocks)

    (ir,) = triton_modules(output, *decode_operands(batch, heads, splits, fp8))
    report = ptxas_report(ir, tmp_path, num_warps=default_output_tiles(batch, fp8)[1])
    assert spilled_bytes(report) == 0, report


def registers(report: str) -> int:
    """Registers a thread of the report's (last) kernel uses."""
    return int(re.findall(r"Used (\d+) registers", report)[-1])


@pytest.mark.parametrize("heads, splits, fp8", [(16, 10, False), (128, 9, True)])
def test_mla_decode_output_one_row_programs_hold_no_padding_rows(heads, splits, fp8, tmp_path):
    """At b=1, programs of one row (block_b 1, products summed over C) against the 16-row programs a dot needs:
    no spill, and under half the registers (the 15 padding rows' merged latents gone), so more programs fit an
    SM at once; V2-Lite's 16 heads and V3's 128 with its fp8 wkv_b."""
    def output(block_b):
        def launch(acc, m, l, q, qpe, kv, pe, wkv_b, scale):
            return mla_decode_output(acc, m, l, q, qpe, kv, pe, wkv_b, jnp.int32(1), scale=0.1, v_dim=V,
                                     wkv_b_scale=scale, block_b=block_b)
        (ir,) = triton_modules(launch, *decode_operands(1, heads, splits, fp8))
        return ptxas_report(ir, tmp_path)

    one_row, padded = output(1), output(16)
    assert spilled_bytes(one_row) == 0, one_row
    assert registers(one_row) < registers(padded) / 2, (one_row, padded)


@pytest.mark.parametrize("batch, heads, fp8", [(1, 16, False), (8, 128, True), (16, 16, False), (32, 16, False)])
def test_mla_absorb_query_and_decode_do_not_spill(batch, heads, fp8, tmp_path):
    """The query's absorption with the latent's norm and both rotaries, and the attention over the cache."""
    acc, m, _, q_latent, q_pe, kv, pe, wkv_b, scale = decode_operands(batch, heads, 4, fp8)
    angles = spec((batch, ROPE // 2))

    def absorb_and_attend(q, wkv_b, scale, kv, weight, cos, sin, q_latent, q_pe, kv_cache, pe_cache, lengths):
        absorbed = mla_absorb_query(q, wkv_b, jnp.int32(1), wkv_b_scale=scale, nope=NOPE, rope=(cos, sin, True),
                                    latent_norm=(kv, weight, 1e-6))
        return absorbed, mla_decode_splits(q_latent, q_pe, kv_cache, pe_cache, jnp.int32(1), lengths, kv_len=608,
                                           scale=0.1)

    irs = triton_modules(absorb_and_attend, spec((batch, heads, NOPE + ROPE), F), wkv_b, scale,
                         spec((batch, RANK + ROPE), F), spec((LAYERS, RANK)), angles, angles, q_latent, q_pe,
                         spec((LAYERS, batch, 640, RANK), F), spec((LAYERS, batch, 640, ROPE), F),
                         spec((batch,), jnp.int32))
    assert len(irs) == 2
    for ir in irs:
        report = ptxas_report(ir, tmp_path)
        assert spilled_bytes(report) == 0, report


@pytest.mark.parametrize("column_groups", [1, 7])
def test_rms_norm_fp8_at_v3_width_does_not_spill(column_groups, tmp_path):
    """The norm before V3's fp8 projections (7,168 columns after the residual add, quantized as act_quant does), in
    one program a row and in seven: each program sums the whole row's squares, then scales its own chunks."""
    def norm(x, residual, weight):
        return rms_norm_fp8(x, weight, eps=1e-6, residual=residual, layer=jnp.int32(1), column_groups=column_groups)

    (ir,) = triton_modules(norm, spec((1, 7168), F), spec((1, 7168), F), spec((LAYERS, 7168)))
    report = ptxas_report(ir, tmp_path)
    assert spilled_bytes(report) == 0, report


@pytest.mark.parametrize("width, experts, fp8", [(2048, 64, False), (7168, 256, True)])
def test_rms_norm_with_the_gate_does_not_spill(width, experts, fp8, tmp_path):
    """The norm before the MoE with the gate's logits in its launch, at V2-Lite's (bf16) and V3's (fp8) widths:
    each program re-normalizes the row a gate chunk at a time against its share of the gate's rows."""
    def norm(x, residual, weight, gate):
        fn = rms_norm_fp8 if fp8 else rms_norm
        return fn(x, weight, eps=1e-6, residual=residual, layer=jnp.int32(1), gate=gate)

    (ir,) = triton_modules(norm, spec((1, width), F), spec((1, width), F), spec((LAYERS, width)),
                           spec((LAYERS, experts, width), F))
    report = ptxas_report(ir, tmp_path)
    assert spilled_bytes(report) == 0, report


@pytest.mark.parametrize("rows", [1, 8])
def test_route_at_v3_reduces_within_one_warp(rows, tmp_path):
    """V3's grouped routing (256 experts, 8 groups, top 8 of the best 4) at decode rows in its default launch: a
    program a row on one warp, so each of its ~56 reductions a row stays inside the warp's shuffles with no barrier
    between warps (a program of 1 to 16 rows on 4 warps took 143 to 149 `bar.sync`), and nothing spills."""
    def routed(logits, bias):
        return route(logits, bias, topk=8, n_groups=8, topk_groups=4, score_func="sigmoid", route_scale=2.5,
                     normalize=True)

    operands = spec((rows, 256)), spec((256,))
    with lowering_as_on_an_h200(), captured_triton_modules() as modules:
        hlo = jax.jit(routed).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    (ir,) = [ir for _, ir in modules]
    assert re.findall(r"grid_x = (\d+)", hlo) == [str(rows)]
    (warps,) = (int(n) for n in re.findall(r"num_warps = (\d+)", hlo))
    assert ptx_for_sm90(ir, tmp_path, num_warps=warps).count("bar.sync") <= 1
    assert spilled_bytes(ptxas_report(ir, tmp_path, num_warps=warps)) == 0


def test_grouped_swiglu_gathering_its_rows_keeps_its_pipeline(tmp_path):
    """The "fused" path's swiglu launch at V2-Lite b=256 (2,048 sorted rows of 256 tokens, 32 x 64 tiles, three
    stages), gathering its rows by index (x_rows) and finding its tile from the group sizes, against reading them
    contiguous: as many asynchronous copies (the gathered x tiles stay in the software pipeline), no spill, and
    registers for as many programs an SM as its shared memory allows (two)."""
    tokens, rows, experts, inter, dim, chunks = 256, 2048, 64, 1408, 2048, 2

    def report(gathered: bool) -> tuple[str, int]:
        def launch(x, w1, w3, sizes, shared_w1, shared_w3, x_rows):
            return grouped_gemm_swiglu(x, w1, w3, sizes, layer=jnp.int32(1), block_m=32, block_n=64, num_stages=3,
                                       shared_w1=shared_w1, shared_w3=shared_w3, x_rows=x_rows if gathered else None)
        (ir,) = triton_modules(launch, spec((tokens if gathered else rows, dim), F),
                               *[spec((LAYERS, experts, inter, dim), F)] * 2, spec((experts + chunks,), jnp.int32),
                               *[spec((LAYERS, chunks * inter, dim), F)] * 2, spec((rows,), jnp.int32))
        ptx = ptx_for_sm90(ir, tmp_path, num_stages=3)
        return ptxas_report(ir, tmp_path, num_stages=3), ptx.count("cp.async.cg") + ptx.count("cp.async.ca")

    (gathered, copies), (_, contiguous_copies) = report(True), report(False)
    assert copies == contiguous_copies > 0, (copies, contiguous_copies)
    stage_bytes = 32 * 128 * 2 + 2 * 64 * 128 * 2  # an x tile and two weight tiles of one K step, bf16
    programs = SHARED_MEMORY_PER_SM // (3 * stage_bytes)
    assert spilled_bytes(gathered) == 0 and programs * registers(gathered) * 128 <= REGISTERS_PER_SM, gathered


@pytest.mark.parametrize("experts, fp8", [(64, False), (256, True)])
def test_grouped_tile_from_group_sizes_waits_on_few_barriers(experts, fp8, tmp_path):
    """A "fused" down launch (2,048 sorted rows, 32 x 64 tiles: V2-Lite's 64 experts and 2 shared chunks, or V3's
    256 and one) finding its tile from the group sizes (`sized_tile`): its cumulative sum and sums over the
    power-of-two size vector cross the program's warps, and each crossing is a `bar.sync` every program waits on
    before its first weight copy: at most four, one scan and one sum over (tiles, rows) pairs (a scan and a sum
    a value would take 24 at V2-Lite's 66 groups)."""
    rows, dim, inter, chunks = 2048, *((2048, 1408, 2) if experts == 64 else (7168, 2048, 1))
    w_dtype = jnp.float8_e4m3fn if fp8 else F

    def launch(h, w, sizes, shared, *scales):
        w_scale, shared_scale = scales or (None, None)
        return grouped_gemm(h, w, sizes, w_scale, layer=jnp.int32(1), block_m=32, block_n=64, shared_w=shared,
                            shared_w_scale=shared_scale)

    scales = [spec((LAYERS, experts, dim // 128, inter // 128)), spec((LAYERS, dim // 128, chunks * inter // 128))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pallas_kernels.grouped.SIZED_TILE_MAX_GROUPS", experts + chunks)
        (ir,) = triton_modules(launch, spec((rows, inter), F), spec((LAYERS, experts, dim, inter), w_dtype),
                               spec((experts + chunks,), jnp.int32), spec((LAYERS, dim, chunks * inter), w_dtype),
                               *(scales if fp8 else []))
    ptx = ptx_for_sm90(ir, tmp_path, num_stages=3)
    prologue = ptx[:ptx.index("cp.async.cg")]
    assert prologue.count("bar.sync") <= 4, prologue.count("bar.sync")


TRIGGER = "griddepcontrol.launch_dependents"


def decode_step_modules(weights: str, **options) -> dict[str, list[str]]:
    """The Triton IR of each Pallas kernel of test_auto_paths_gpu.py's small V3 model's decode step (b=2), by name."""
    decode = [step for step in STEPS if step[2] == 1][:1]
    with captured_triton_modules() as launches:
        lowered_steps(variant(dsv3_jax.build(small_v3(weights), seed=0), **options), decode)
    modules = {}
    for name, ir in launches:
        modules.setdefault(name, []).append(ir)
    return modules


def test_decode_kernels_let_the_next_launch_start_early(tmp_path):
    """Every Triton kernel of a decode step with plain weights, and the fp8 GEMM of one with fp8 weights (gemm_impl
    fp8), issues griddepcontrol.launch_dependents, so that the launch after it begins once all its programs run;
    the instruction survives to the PTX ptxas assembles for sm_90a (shown on the norm, the most frequent launch)."""
    modules = decode_step_modules("bf16")
    assert {"rms_norm", "norm_project", "mla_absorb_query", "mla_decode", "mla_decode_output", "route",
            "grouped_gemm_swiglu", "grouped_gemm"} <= set(modules), sorted(modules)
    assert not [name for name, irs in modules.items() for ir in irs if TRIGGER not in ir], sorted(modules)
    fp8_gemms = decode_step_modules("fp8", gemm_impl="fp8").get("fp8_gemm", [])
    assert fp8_gemms and all(TRIGGER in ir for ir in fp8_gemms), len(fp8_gemms)
    assert TRIGGER in ptx_for_sm90(modules["rms_norm"][0], tmp_path)
