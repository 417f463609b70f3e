"""The memory plan (`dsv3_jax.memory`): its weight and cache bytes are those of the arrays a real model
allocates on each device (read from the arrays' own shards), and `load`, `build` and `dsv3-chat`
refuse what does not fit a stated capacity in one line that names what does.

The counted models hold zeros (`zero_models.zero_model`: `build`'s arguments, shapes, dtypes and
splits, no random-initialising program to compile per config and mesh): bytes depend on the arrays'
shapes, dtypes and placement, not on their values."""
import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import jax
import pytest

import dsv3_jax
from dsv3_jax.config import ModelArgs
from dsv3_jax.errors import MemoryPlanError
from dsv3_jax.memory import (DEVICE_BYTES_ENV, cache_bytes, check_fits, device_capacity, fitting, peak_bytes, plan,
                             step_bytes, weight_bytes)
from dsv3_jax.options import RunOptions
from dsv3_jax.sharding import make_mesh
from test_auto_paths_gpu import small_v3
from test_gpu_lowering import lowered_steps
from zero_models import zero_model

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"
TINY_ARGS = ModelArgs.from_file(TINY / "config.json")
LONGEST = re.compile(r"the largest max_seq_len that fits at max_batch_size (\d+) is (\d+)")
WIDEST = re.compile(r"the largest max_batch_size that fits at max_seq_len (\d+) is (\d+)")


def bytes_per_device(tree) -> dict:
    """device -> bytes of the shards of `tree`'s arrays that live on it."""
    totals = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            totals[shard.device] += shard.data.nbytes
    return dict(totals)


@pytest.mark.parametrize("devices, layout, attn_impl, mtp, compute_dtype, dtype, batch", [
    (1, "tp", "absorb", False, "bfloat16", "bf16", 2),
    (1, "tp", "absorb", True, "bfloat16", "fp8", 2),
    (4, "tp", "naive", False, "bfloat16", "bf16", 2),
    (4, "dp-attn", "absorb", True, "bfloat16", "bf16", 3),
    (4, "dp-attn-tp", "naive", True, "float32", "bf16", 3),
    (4, "ep-only", "absorb", False, "float32", "bf16", 1),
])
def test_plan_counts_the_arrays_a_model_allocates(devices, layout, attn_impl, mtp, compute_dtype, dtype, batch):
    args = TINY_ARGS.replace(max_batch_size=batch, max_seq_len=96, dtype=dtype)
    options = RunOptions(attn_impl=attn_impl, layout=layout, compute_dtype=compute_dtype)
    model = zero_model(args, num_devices=devices, mtp=mtp, attn_impl=attn_impl, layout=layout,
                       compute_dtype=compute_dtype)
    state, cache = bytes_per_device(model.state), bytes_per_device(model.cache)
    assert len(state) == len(cache) == devices
    weights = weight_bytes(model.args, model.layout, options, mtp)
    cached = cache_bytes(model.args, model.layout, options, batch, 96, mtp)
    assert set(state.values()) == {sum(weights.values())}
    assert set(cache.values()) == {sum(cached.values())}
    assert ("MTP layer" in weights) == mtp
    items = plan(model.args, model.layout, options, batch, 96, mtp=mtp)
    assert {**weights, **cached}.items() <= items.items()
    assert peak_bytes(sum(weights.values()), model.args, model.layout, options, batch, 96, mtp) > sum(items[k] for k in
                                                                                                      {**weights, **cached})


def test_flash_plan_has_no_score_buffer_and_dense_has_one():
    layout = dsv3_jax.api.model_layout(TINY_ARGS, RunOptions(), make_mesh(1))
    flash = plan(TINY_ARGS, layout, RunOptions(prefill_chunk=64), 2, 4096)
    dense = plan(TINY_ARGS, layout, RunOptions(prefill_chunk=64, prefill_attn="dense"), 2, 4096)
    assert not any("scores" in item for item in flash)
    # rows x chunk x heads x kv_len float32
    assert dense["attention: scores (float32, dense)"] == 2 * 64 * TINY_ARGS.n_heads * 4096 * 4


def capacity_for(args, options, devices, batch, seq_len, mtp=False):
    """A capacity that holds (batch, seq_len) and nothing larger."""
    model_layout = dsv3_jax.api.model_layout(args, options, make_mesh(devices))
    weights = sum(weight_bytes(args, model_layout, options, mtp).values())
    return int(peak_bytes(weights, args, model_layout, options, batch, seq_len, mtp)), model_layout


@pytest.mark.parametrize("devices, layout, rows, held", [(1, "tp", 6, 2), (4, "dp-attn", 12, 8)])
def test_build_refuses_in_one_line_naming_what_fits(monkeypatch, devices, layout, rows, held):
    """A capacity that holds `held` rows x 3000 positions refuses `rows` x 4096 and names the largest
    max_seq_len at `rows` rows and the largest batch at 4096 (dp-attn pads the rows to a multiple of 4)."""
    options = RunOptions(layout=layout, prefill_chunk=64)
    args = TINY_ARGS.replace(max_batch_size=rows, max_seq_len=4096)
    capacity, model_layout = capacity_for(args, options, devices, held, 3000)
    monkeypatch.setenv(DEVICE_BYTES_ENV, str(capacity))
    with pytest.raises(MemoryPlanError) as refused:
        dsv3_jax.build(args, options=options, num_devices=devices)
    message = str(refused.value)
    assert "\n" not in message and f"max_batch_size {rows} x max_seq_len 4096 does not fit" in message, message
    (batch, longest), (seq_len, widest) = (map(int, m.groups()) for m in (LONGEST.search(message),
                                                                          WIDEST.search(message)))
    assert (batch, seq_len) == (rows, 4096) and 0 < longest < 3000 and 0 < widest < held, message
    # each suggestion passes the check and is the largest that does
    fits = fitting(args, model_layout, options, capacity)
    assert fits(rows, longest) and not fits(rows, longest + 1)
    assert fits(widest, 4096) and not fits(widest + 1, 4096)
    check_fits(args.replace(max_seq_len=longest), model_layout, options)
    check_fits(args.replace(max_batch_size=widest), model_layout, options)
    model = dsv3_jax.build(args.replace(max_seq_len=longest), options=options, num_devices=devices)
    assert model.cache["kv"].shape[2] == longest


def test_a_smaller_prefill_chunk_is_named_when_it_fits():
    args = TINY_ARGS.replace(max_batch_size=2, max_seq_len=512)
    capacity, layout = capacity_for(args, RunOptions(prefill_chunk=64), 1, 2, 512)
    with pytest.raises(MemoryPlanError, match=r"with prefill_chunk 64 it fits as it is$"):
        check_fits(args, layout, RunOptions(prefill_chunk=512), device_bytes=capacity)
    check_fits(args, layout, RunOptions(prefill_chunk=64), device_bytes=capacity)


def test_load_refuses_before_reading_a_weight(monkeypatch):
    options = RunOptions(prefill_chunk=64)
    capacity, _ = capacity_for(TINY_ARGS, options, 1, 2, 500)
    monkeypatch.setenv(DEVICE_BYTES_ENV, str(capacity))
    monkeypatch.setattr(dsv3_jax.api, "load_state", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(MemoryPlanError, match=r"max_batch_size 2 x max_seq_len 2048 does not fit") as refused:
        dsv3_jax.load(TINY, options=options, max_batch_size=2, max_seq_len=2048)
    assert LONGEST.search(str(refused.value)).group(2) == "500"
    monkeypatch.undo()
    assert dsv3_jax.load(TINY, options=options, max_batch_size=2, max_seq_len=500).args.max_seq_len == 500


def test_weights_that_cannot_fit_and_bad_capacities_are_named(monkeypatch):
    layout = dsv3_jax.api.model_layout(TINY_ARGS, RunOptions(), make_mesh(1))
    weights = sum(weight_bytes(TINY_ARGS, layout, RunOptions()).values())
    with pytest.raises(MemoryPlanError, match="the weights alone need"):
        check_fits(TINY_ARGS, layout, RunOptions(), device_bytes=int(weights) - 1)
    monkeypatch.setenv(DEVICE_BYTES_ENV, "lots")
    with pytest.raises(MemoryPlanError, match=r"\$DSV3_DEVICE_BYTES must be a number of bytes, got 'lots'"):
        device_capacity()
    monkeypatch.delenv(DEVICE_BYTES_ENV)
    if jax.default_backend() == "cpu":  # host RAM is not a device's limit: nothing is checked
        assert device_capacity() is None
        check_fits(TINY_ARGS.replace(max_seq_len=1 << 24), layout, RunOptions())


def test_chat_refuses_a_cache_too_long_in_one_line():
    options = RunOptions(prefill_chunk=64)
    capacity, _ = capacity_for(TINY_ARGS, options, 1, 1, 3000)
    env = {**os.environ, DEVICE_BYTES_ENV: str(capacity)}
    result = subprocess.run([sys.executable, "-m", "dsv3_jax.chat", "--tiny", "--complete", "--prompt", "def",
                             "--num-devices", "1", "--prefill-chunk", "64", "--max-seq-len", "100000"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=180)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("dsv3-chat: error: max_batch_size 1 x max_seq_len 100000 does not fit"), lines[0]
    assert "the largest max_seq_len that fits at max_batch_size 1 is 3000" in lines[0], lines[0]


def kernel_calls(text: str) -> list[tuple[str, list[tuple[tuple[int, ...], str]], tuple[tuple[int, ...], str]]]:
    """(kernel, operand (shape, dtype)s, result (shape, dtype)) of each custom call of a lowered step, in order: a
    Pallas Triton kernel by its name, a Mosaic GPU kernel as "mosaic_gpu"."""
    def tensor(t):
        *dims, dtype = t.split("x")
        return tuple(map(int, dims)), dtype
    calls = []
    for line in text.splitlines():
        found = re.search(r"custom_call @(\S+?)\(.*: \(([^()]*)\) -> tensor<([^>]*)>\s*$", line)
        if found:
            name = re.search(r'name = "([a-z_0-9]+)"', line)
            kernel = "mosaic_gpu" if found.group(1).startswith("mosaic_gpu") else name.group(1) if name else "?"
            operands = re.findall(r"tensor<([^>]*)>", found.group(2))
            calls.append((kernel, [tensor(t) for t in operands], tensor(found.group(3))))
    return calls


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * {"f32": 4, "bf16": 2}[dtype]


def prefill_plan_and_grouped_calls(weights: str, batch: int = 2, seq: int = 300):
    """The small V3's plan of a batch x seq prefill chunk (phases), its routed rows, and the grouped GEMMs of that
    step lowered for CUDA as on an H200: [(operand (rows, K) it reads, result)] in order, and the lowered text."""
    args = small_v3(weights).replace(max_batch_size=batch, max_seq_len=512)
    model = zero_model(args)
    text = lowered_steps(model, [("prefill", batch, seq, 0)])[0]
    rows = batch * seq * args.n_activated_experts
    grouped = [(next(op for op in operands if op[0][1:] and rows <= op[0][0] <= rows + 128 and op[1] == "bf16"), result)
               for kernel, operands, result in kernel_calls(text)
               if kernel in ("mosaic_gpu", "grouped_gemm", "grouped_gemm_swiglu") and rows <= result[0][0] <= rows + 128]
    return step_bytes(args, model.layout, RunOptions(prefill_chunk=512), batch, seq), args, grouped, text


def test_plan_holds_the_products_a_prefill_step_lowers_to():
    """The plan's phases of a prefill chunk against its step lowered for CUDA as on an H200, fp8 weights (the grouped
    GEMMs at prefill are Triton launches, as off sm_90): the routed experts' "experts" phase is the rows the w1 and
    w3 launches read and their two float32 products; "expert outputs" the SwiGLU rows the down launch reads, its
    float32 product and the float32 sum per token (within the launches' tile of slack rows); the dense layer's MLP
    its two products and their SwiGLU."""
    batch, seq = 2, 300
    phases, args, grouped, text = prefill_plan_and_grouped_calls("fp8", batch, seq)
    rows, inter, tokens = batch * seq * args.n_activated_experts, args.moe_inter_dim, batch * seq
    assert [(r[0][1], r[1]) for _, r in grouped] == [(inter, "f32")] * 2 + [(args.dim, "f32")], grouped
    (x1, out1), (x3, out3), (hidden, down) = grouped
    assert x1 == x3 and hidden[0][1] == inter
    lowered = nbytes(*x1) + nbytes(*out1) + nbytes(*out3)
    assert sum(phases["experts"].values()) == pytest.approx(lowered, rel=0.02)
    lowered = nbytes(*hidden) + nbytes(*down) + tokens * args.dim * 4
    assert sum(phases["expert outputs"].values()) == pytest.approx(lowered, rel=0.02)
    dense = re.findall(rf"stablehlo.dot_general .*-> tensor<{batch}x{seq}x{args.inter_dim}xf32>", text)
    converted = re.findall(rf"stablehlo.convert .*\(tensor<{batch}x{seq}x{args.inter_dim}xf32>\) -> "
                           rf"tensor<{batch}x{seq}x{args.inter_dim}xbf16>", text)
    assert len(dense) == 2 and converted, "the dense MLP's w1 and w3 products, in bf16"
    assert sum(phases["dense MLP"].values()) == 3 * nbytes((batch, seq, args.inter_dim), "bf16")


def test_plan_covers_the_swiglu_launch_of_bf16_weights():
    """With bf16 weights on sm_90 one wgmma launch computes the SwiGLU rows (no float32 products in memory): the
    plan's "experts" phase still holds the float32 products (other paths write them), so it covers the rows that
    launch reads and writes; "expert outputs" equals the down launch's rows, its float32 product and the sum."""
    batch, seq = 2, 300
    phases, args, grouped, _ = prefill_plan_and_grouped_calls("bf16", batch, seq)
    assert [r for _, r in grouped] == [((batch * seq * args.n_activated_experts, args.moe_inter_dim), "bf16"),
                                       ((batch * seq * args.n_activated_experts, args.dim), "f32")], grouped
    (x, hidden), (hidden_read, down) = grouped
    assert hidden_read == hidden
    assert sum(phases["experts"].values()) > nbytes(*x) + nbytes(*hidden)
    lowered = nbytes(*hidden) + nbytes(*down) + batch * seq * args.dim * 4
    assert sum(phases["expert outputs"].values()) == pytest.approx(lowered, rel=0.02)
