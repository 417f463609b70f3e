"""Memory that is planned, not discovered: the bytes per device a model needs, counted before
anything is allocated, and the check `load` and `build` make with them.

`plan` counts, for one device under a layout:
  - the weights of each role (`sharding.parameter_bytes_per_device` over the model's own
    parameter shapes and logical axes: fp8 weights with their block scales), the MTP layer apart;
  - the cache of (batch, seq_len) as `model.cache` allocates it (the latent and rotary key when
    attn_impl is "absorb", per-head keys and values when "naive"; one more layer with an MTP module);
  - the working set of the largest step: a prefill chunk of min(prefill_chunk, seq_len) tokens in
    every row, attending to a window of seq_len positions. Attention is flash attention: its keys and
    values per head are expanded from the latent window (one layer at a time), queries and float32
    accumulators are per chunk; no (queries x keys) score buffer, except with prefill_attn "dense".
    The routed experts' grouped GEMMs return float32 products: the w1 and w3 products of every
    (token, expert) row, then the down projection's (with bf16 weights on sm_90 one SwiGLU launch
    writes the hidden rows without the first two; the plan keeps them, the other paths' bound).

`peak_bytes` adds them up as a step lives: weights, cache, the step's hidden states and its new
cache entries (all layers, stored after the layer scan), plus the largest of one layer's attention,
one dense layer's MLP, one layer's routed experts (their two halves, apart) and the output head (XLA
frees each before the next starts).

`check_fits` compares that peak with a device's capacity (`device_capacity`) and refuses, in one
line, with the largest max_seq_len and max_batch_size that do fit.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from flax import nnx

from .checkpoint.schema import MTP_STATE, abstract_state
from .config import ModelArgs
from .errors import MemoryPlanError
from .model.cache import cache_shapes, cache_specs
from .options import RunOptions, choices
from .sharding import Layout, parameter_bytes_per_device

DEVICE_BYTES_ENV = "DSV3_DEVICE_BYTES"  # bytes of one device, overriding what the device reports
GIB = 2**30


def weight_bytes(args: ModelArgs, layout: Layout, options: RunOptions, mtp: bool = False) -> dict[str, float]:
    """Bytes of the parameters of each role on one device (`sharding.parameter_role`; the MTP
    module's as "MTP layer"), as `load`/`build` place them: weights in options.compute_dtype,
    fp8 weights as e4m3 with their float32 block scales."""
    if args.gate_bias is None:  # decided by the checkpoint; the reference's rule meanwhile
        args = args.replace(gate_bias=args.score_func == "sigmoid")
    state = abstract_state(args, options.jnp_dtype, mtp=mtp)
    flat = list(nnx.to_flat_state(state))
    main = nnx.from_flat_state([(p, v) for p, v in flat if str(p[0]) != MTP_STATE])
    items = parameter_bytes_per_device(main, layout)
    if mtp:
        extra = nnx.from_flat_state([(p, v) for p, v in flat if str(p[0]) == MTP_STATE])
        items["MTP layer"] = sum(parameter_bytes_per_device(extra, layout).values())
    return items


def cache_bytes(args: ModelArgs, layout: Layout, options: RunOptions, batch: int, seq_len: int,
                mtp: bool = False) -> dict[str, float]:
    """Bytes of each cache array on one device (`model.cache.allocate_cache`: rows padded to the
    batch split, each axis divided into the parts its PartitionSpec names)."""
    shapes = cache_shapes(args, options.attn_impl, layout.padded_batch(batch), seq_len, mtp)
    specs = cache_specs(options.attn_impl, layout)
    itemsize = np.dtype(options.jnp_dtype).itemsize
    return {f"cache {name}": float(math.prod(_local_shape(shape, specs[name], layout))) * itemsize
            for name, shape in shapes.items()}


def _local_shape(shape: tuple[int, ...], spec, layout: Layout) -> tuple[int, ...]:
    sizes = dict(zip(layout.mesh_axes, layout.mesh_shape))
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    parts = [1 if e is None else math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e)) for e in entries]
    return tuple(d // p for d, p in zip(shape, parts))


def step_bytes(args: ModelArgs, layout: Layout, options: RunOptions, batch: int,
               seq_len: int) -> dict[str, dict[str, float]]:
    """The working set on one device of a prefill chunk of min(prefill_chunk, seq_len) tokens in every
    row, attending to seq_len positions: {"step": what lives through the step, "attention": one
    layer's attention, "dense MLP": one dense layer's MLP, "experts" and "expert outputs": one layer's routed
    experts up to the w1, w3 products and after them (`_routed_expert_phases`), "head": the output head}."""
    act = np.dtype(options.jnp_dtype).itemsize
    rows = layout.padded_batch(batch) // layout.size("batch")  # this device's rows
    chunk, kv_len = min(options.prefill_chunk, seq_len), seq_len
    heads = args.n_heads // layout.size("heads")
    tokens = rows * chunk
    if options.attn_impl == "naive":  # the new entries are per-head keys and values
        entry = heads * (args.qk_head_dim + args.v_head_dim)
    else:
        entry = args.kv_lora_rank + args.qk_rope_head_dim
    attention = {
        "attention: keys + values per head of the window (one layer)":
            rows * kv_len * heads * (args.qk_head_dim + args.v_head_dim) * act,
        "attention: latent window (one layer)": rows * kv_len * (args.kv_lora_rank + args.qk_rope_head_dim) * act,
        "attention: queries + float32 accumulators": tokens * heads * (args.qk_head_dim * act + args.v_head_dim * 4),
    }
    if options.prefill_attn == "dense":
        attention["attention: scores (float32, dense)"] = tokens * heads * kv_len * 4
    return {
        "step": {"hidden state (x2: residual + branch)": 2 * tokens * args.dim * act,
                 "new cache entries (all layers)": args.n_layers * tokens * entry * act},
        "attention": attention,
        **_dense_mlp_phase(args, layout, tokens, act),
        **_routed_expert_phases(args, _gathered_rows(layout, tokens, "experts", "expert_ffn"), act),
        "head": {"logits (float32, full vocab)": rows * args.vocab_size * 4},
    }


def _gathered_rows(layout: Layout, tokens: int, *logical: str) -> int:
    """Rows a layer split over `logical` computes on one device: this device's tokens, all-gathered over the
    axes the batch is split over too (`Layout.reduction`)."""
    gathered, _ = layout.reduction(*logical)
    return tokens * math.prod(layout.mesh_shape[layout.mesh_axes.index(a)] for a in gathered)


def _dense_mlp_phase(args: ModelArgs, layout: Layout, tokens: int, act: int) -> dict[str, dict[str, float]]:
    """One dense layer's MLP: its w1 and w3 products and their SwiGLU, this device's share of the hidden units."""
    if not args.n_dense_layers:
        return {}
    hidden = _gathered_rows(layout, tokens, "ffn") * (args.inter_dim // layout.size("ffn"))
    return {"dense MLP": {"dense MLP: w1, w3 products and their SwiGLU": 3 * hidden * act}}


def _routed_expert_phases(args: ModelArgs, tokens: int, act: int) -> dict[str, dict[str, float]]:
    """One layer's routed experts over `tokens` tokens, as the grouped GEMMs (Pallas kernel or `ragged_dot`) hold it:
    their products are float32 (`moe.grouped_matmul`). "experts": the sorted rows and the w1, w3 products;
    "expert outputs": the SwiGLU rows, the down projection's rows and the float32 sum per token."""
    if not args.n_moe_layers:
        return {}
    rows, inter, dim = tokens * args.n_activated_experts, args.moe_inter_dim, args.dim
    return {"experts": {"routed rows": rows * dim * act, "w1, w3 products (float32)": rows * 2 * inter * 4},
            "expert outputs": {"SwiGLU rows": rows * inter * act, "down projection (float32)": rows * dim * 4,
                               "sum per token (float32)": tokens * dim * 4}}


def plan(args: ModelArgs, layout: Layout, options: RunOptions, batch: int, seq_len: int, *,
         mtp: bool = False) -> dict[str, float]:
    """item -> bytes on one device: the weights, the cache and a prefill chunk's working set."""
    phases = step_bytes(args, layout, options, batch, seq_len)
    return {**weight_bytes(args, layout, options, mtp), **cache_bytes(args, layout, options, batch, seq_len, mtp),
            **{item: b for phase in phases.values() for item, b in phase.items()}}


def peak_bytes(weights: float, args: ModelArgs, layout: Layout, options: RunOptions, batch: int, seq_len: int,
               mtp: bool = False) -> float:
    """Bytes one device holds at the peak of the largest step, given the weights' bytes: weights,
    cache, what lives through the step and the largest of the other phases of `step_bytes`."""
    phases = step_bytes(args, layout, options, batch, seq_len)
    widest_phase = max(sum(items.values()) for name, items in phases.items() if name != "step")
    return (weights + sum(cache_bytes(args, layout, options, batch, seq_len, mtp).values())
            + sum(phases["step"].values()) + widest_phase)


def device_capacity(devices=None, device_bytes: int | None = None) -> int | None:
    """Bytes one device may hold: `given_capacity(device_bytes)`, else the least
    `memory_stats()["bytes_limit"]` of this process's `devices` (default: all local ones); None where
    the devices report no limit (the CPU, whose host RAM is not what the plan is about)."""
    given = given_capacity(device_bytes)
    if given is not None:
        return given
    local = [d for d in (devices if devices is not None else jax.local_devices())
             if d.process_index == jax.process_index()]
    limits = [stats["bytes_limit"] for stats in (d.memory_stats() for d in local) if stats and "bytes_limit" in stats]
    return min(limits) if limits else None


def given_capacity(device_bytes: int | None = None) -> int | None:
    """The capacity the caller states: `device_bytes`, else $DSV3_DEVICE_BYTES (a number of bytes), else None."""
    if device_bytes is not None:
        return int(device_bytes)
    given = os.environ.get(DEVICE_BYTES_ENV)
    if not given:
        return None
    try:
        return int(float(given))
    except ValueError:
        raise MemoryPlanError(f"${DEVICE_BYTES_ENV} must be a number of bytes, got {given!r}") from None


def check_fits(args: ModelArgs, layout: Layout, options: RunOptions, *, batch: int | None = None,
               seq_len: int | None = None, mtp: bool = False, devices=None, device_bytes: int | None = None) -> None:
    """Raise `MemoryPlanError` when the planned peak (`peak_bytes`) of (batch, seq_len) -- default
    (max_batch_size, max_seq_len) -- exceeds the capacity of a device (`device_capacity`), naming what
    fits instead; nothing is checked where the capacity is unknown."""
    capacity = device_capacity(devices, device_bytes)
    if capacity is None:
        return
    batch, seq_len = batch or args.max_batch_size, seq_len or args.max_seq_len
    weights = sum(weight_bytes(args, layout, options, mtp).values())
    need = peak_bytes(weights, args, layout, options, batch, seq_len, mtp)
    if need <= capacity:
        return
    note = " (XLA's share, set by XLA_PYTHON_CLIENT_MEM_FRACTION)" if given_capacity(device_bytes) is None else ""
    where = f"{size(capacity)} per device{note} with layout {layout.name!r} on {math.prod(layout.mesh_shape)} device(s)"
    if weights > capacity:
        raise MemoryPlanError(f"the weights alone need {size(weights)} of the {where}: use more devices "
                              "or a layout that splits more of them")
    cache = sum(cache_bytes(args, layout, options, batch, seq_len, mtp).values())
    fits = fitting(args, layout, options, capacity, mtp, weights)
    longest = largest(lambda s: fits(batch, s), seq_len - 1)
    widest = largest(lambda b: fits(b, seq_len), batch - 1)
    at_batch = (f"the largest max_seq_len that fits at max_batch_size {batch} is {longest}" if longest
                else f"no max_seq_len fits at max_batch_size {batch}")
    at_length = (f"the largest max_batch_size that fits at max_seq_len {seq_len} is {widest}" if widest
                 else f"no max_batch_size fits at max_seq_len {seq_len}")
    chunk = min(options.prefill_chunk, seq_len)
    smaller = [c for c in choices("prefill_chunk") if c < chunk and fitting(
        args, layout, dataclasses.replace(options, prefill_chunk=c), capacity, mtp, weights)(batch, seq_len)]
    at_chunk = f"; with prefill_chunk {max(smaller)} it fits as it is" if smaller else ""
    raise MemoryPlanError(
        f"max_batch_size {batch} x max_seq_len {seq_len} does not fit in {where}: it plans "
        f"{size(need)} (weights {size(weights)}, cache {size(cache)}, a prefill chunk of "
        f"{chunk} tokens {size(need - weights - cache)}); {at_batch}; {at_length}{at_chunk}")


def size(n: float) -> str:
    """n bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def fitting(args: ModelArgs, layout: Layout, options: RunOptions, capacity: float, mtp: bool = False,
            weights: float | None = None):
    """fits(batch, seq_len) -> whether the planned peak fits in `capacity` bytes (the weights,
    given or counted here, counted once)."""
    if weights is None:
        weights = sum(weight_bytes(args, layout, options, mtp).values())
    return lambda batch, seq_len: peak_bytes(weights, args, layout, options, batch, seq_len, mtp) <= capacity


def largest(fits, upper: int) -> int:
    """The largest n in [1, upper] with fits(n), for fits true up to some n and false after; 0: none."""
    low, high = 0, upper
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
