"""How a model runs, as opposed to what it is (`ModelArgs`): the runtime choices, in one place.

`RunOptions` is made once (by `load`/`build`, or from command-line flags with `add_flags` and
`from_flags`), checked once in its constructor, and then only read: the step, the cache and every
layer take their choices from it. `StepContext` carries it through one forward step together with
the step's positions and rotary angles.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from .sharding import PRESETS, Layout

COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32"}


def _choice(default, choices: tuple, help: str):
    return dataclasses.field(default=default, metadata={"choices": choices, "help": help})


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The runtime choices of a model; each field's metadata names its allowed values."""

    compute_dtype: str = _choice("bfloat16", tuple(COMPUTE_DTYPES),
                                 "dtype of activations and of the non-fp8 weights")
    attn_impl: str = _choice("absorb", ("absorb", "naive"),
                             "MLA: absorb wkv_b and cache the latent, or cache per-head keys and values")
    gemm_impl: str = _choice("bf16", ("bf16", "fp8"),
                             "fp8 weights: dequantise them, or quantise activations for the scaled fp8 GEMM")
    moe_impl: str = _choice("auto", ("auto", "kernel", "fused", "slots", "gather", "ragged"),
                            "routed experts: the Pallas grouped GEMM, the same fused into two launches "
                            "(w1+w3+silu*mul, w2+routing weights), those two over unsorted (token, expert) "
                            "slots (no sort or scatter), a gather of the experts in use, or ragged_dot "
                            "(auto: by step size on a GPU)")
    decode_attn: str = _choice("auto", ("auto", "xla", "kernel"),
                               "absorbed attention of single-token steps: XLA einsums or Pallas kernels (wkv_b "
                               "into the query, the latent cache read in place, the merge and wkv_b's value half; "
                               "auto: the kernels on a GPU)")
    router: str = _choice("auto", ("auto", "xla", "kernel", "norm-gate"),
                          "MoE routing after the gate GEMM (scores, group-limited top-k, weights): XLA ops or "
                          "one Pallas kernel (auto: the kernel on a GPU for decode-sized steps); norm-gate: the "
                          "kernel, with the gate GEMM inside the launch of the norm before the MoE where that norm "
                          "runs as a Pallas kernel (decode-sized steps on a GPU)")
    prefill_attn: str = _choice("auto", ("auto", "kernel", "jnp", "dense"),
                                "attention of multi-token steps (prefill chunks): flash attention over per-head "
                                "keys and values, as the Mosaic GPU kernel or its portable jnp twin (online "
                                "softmax over key blocks), or the dense scores (a small-size oracle; memory grows "
                                "with queries x keys). auto: the kernel on a Hopper GPU, the twin elsewhere")
    prefill_chunk: int = _choice(8192, tuple(1 << n for n in range(6, 18)),
                                 "tokens per row in one prefill step: longer prompts are prefilled chunk by chunk "
                                 "into the cache, which bounds activations and compilations (a power of two)")
    layout: str = _choice("tp", tuple(PRESETS),
                          "how the model is split over the devices, a preset of dsv3_jax.sharding.PRESETS: "
                          "attention tensor-parallel (tp), split by batch rows with its cache (dp-attn, "
                          "dp-attn-tp) or replicated (rep-attn, ep-only)")
    decode_graph: str = _choice("auto", ("off", "on", "auto"),
                                "generate()'s single-token decode steps with the layer scans unrolled and "
                                "compiled as CUDA graphs (XLA command buffers): one launch replays a step's "
                                "kernels; a longer first compile (auto, the default: on a GPU)")
    unroll: bool = dataclasses.field(default=False, metadata={"help": "unroll the layer scans (longer compile, "
                                                                     "no loop between layers)"})
    fuse_shared_experts: bool = dataclasses.field(default=True, metadata={
        "help": "run the shared experts inside the routed experts' kernels, as experts every token selects, "
                "where the step runs moe_impl slots or fused and each rank's shared hidden units split into "
                "whole experts"})

    def __post_init__(self):
        # the short names ModelArgs and the reference use for storage are accepted here too
        object.__setattr__(self, "compute_dtype", _DTYPE_ALIASES.get(self.compute_dtype, self.compute_dtype))
        for field in dataclasses.fields(self):
            value, allowed = getattr(self, field.name), field.metadata.get("choices", (False, True))
            if value not in allowed or type(value) is not type(field.default):
                raise ValueError(f"{field.name} must be one of {allowed}, got {value!r}")

    @classmethod
    def make(cls, options: RunOptions | None = None, **choices) -> RunOptions:
        """`options` with `choices` (field=value) replaced; the defaults when `options` is None."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(choices) - set(names))
        if unknown:
            raise TypeError(f"unknown run option {unknown[0]!r}; the run options are {', '.join(names)}")
        return dataclasses.replace(options or cls(), **choices)

    @property
    def jnp_dtype(self):
        """`compute_dtype` as a jnp dtype."""
        return COMPUTE_DTYPES[self.compute_dtype]

    @property
    def matmul_precision(self) -> str | None:
        """float32 means float32 on every backend: "highest" for float32 compute (XLA on a GPU would
        otherwise run float32 dots as TF32, 10-bit mantissas); None (the backend default) for bf16."""
        return "highest" if self.compute_dtype == "float32" else None

    def precision_scope(self):
        """The context a step is traced in: `jax.default_matmul_precision(matmul_precision)` when set."""
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)


def add_flags(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """A `--field-name` flag for every RunOptions field but `skip`, with its choices, default (RunOptions'
    unless `defaults` names another for this command) and help."""
    for field in dataclasses.fields(RunOptions):
        if field.name in skip:
            continue
        flag, help = "--" + field.name.replace("_", "-"), field.metadata["help"]
        if field.type == "bool":  # --name / --no-name
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                                help=f"{help} (default: {'on' if field.default else 'off'})")
        else:
            default = (defaults or {}).get(field.name, field.default)
            parser.add_argument(flag, default=default, type=type(field.default),
                                choices=field.metadata["choices"], help=f"{help} (default: {default})")


def from_flags(namespace: argparse.Namespace, **overrides) -> RunOptions:
    """The RunOptions named by flags that `add_flags` added (fields it skipped keep their defaults)."""
    given = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(RunOptions) if hasattr(namespace, f.name)}
    return RunOptions(**{**given, **overrides})


def choices(name: str) -> tuple:
    """The allowed values of RunOptions field `name`."""
    return next(f for f in dataclasses.fields(RunOptions) if f.name == name).metadata["choices"]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every layer of one forward step shares: per-row positions and their rotary angles,
    the cache window read by attention, the run options and the checkpoint's activation-scale format."""

    positions: jnp.ndarray  # (B, S) int32 absolute positions of the chunk's tokens
    cos: jnp.ndarray  # (B, S, rope_dim // 2) float32
    sin: jnp.ndarray
    kv_len: int  # attention reads cache positions [0, kv_len)
    options: RunOptions = RunOptions()
    scale_fmt: str | None = None  # ModelArgs.scale_fmt: None or "ue8m0"
    kv_start: int = 0  # attention reads cache positions [kv_start, kv_len) (the MTP block: 1)
    layout: Layout = Layout()  # how the step is split (the default: not at all, no collective)
    valid: jnp.ndarray | None = None  # (B,) bool: False for the padding rows of a batch split (None: none)

    @property
    def gemm(self) -> dict:
        """The keyword arguments of `Linear.__call__` that choose its GEMM."""
        return dict(gemm_impl=self.options.gemm_impl, scale_fmt=self.scale_fmt)
