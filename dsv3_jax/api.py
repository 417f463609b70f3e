"""The public entry points: `load` a checkpoint or `build` a random model, then `Model.forward`.

A `Model` holds the parameters (sharded over its mesh), one cache for (max_batch_size,
max_seq_len), and the jitted step. The step is compiled once per (batch, chunk length, cache
window) and updates the donated cache in place.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from .attention import StepContext
from .cache import allocate_cache, cache_specs
from .checkpoint import (ReferenceLayoutIndex, find_config, hf_name, home_rank, load_state, rank_files,
                         reference_naming)
from .config import ModelArgs
from .model import Transformer
from .rope import inverse_frequencies, rotary_angles
from .orbax_io import has_array, is_orbax_checkpoint, restore_state
from .safetensors_io import CheckpointError, TensorIndex
from .sharding import check_divisible, make_mesh, named_shardings, partition_specs

DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}
ATTN_IMPLS = ("absorb", "naive")
GEMM_IMPLS = ("bf16", "fp8")
MOE_IMPLS = ("auto", "kernel", "gather", "ragged")
DECODE_ATTNS = ("xla", "kernel")


def make_step(graphdef: nnx.GraphDef, state_specs, args: ModelArgs, mesh: Mesh, attn_impl: str, gemm_impl: str,
              moe_impl: str = "auto", unroll: bool = False, decode_attn: str = "xla"):
    """The jitted forward step `(state, cache, tokens, start_pos, last_index, *, kv_len) -> (logits, cache)`.

    tokens (B, S) int32; start_pos (B,) int32, each row's position of tokens[:, 0]; last_index (B,)
    int32, the chunk index whose logits are returned (float32, (B, vocab)). The cache (argument 1)
    is donated and comes back updated at positions [start_pos, start_pos + S) of rows [0, B);
    attention reads cache positions [0, kv_len), a static bound that must cover every row's end.
    """
    inv_freq = inverse_frequencies(args)
    c_specs = cache_specs(attn_impl)

    def local_step(state, cache, tokens, positions, last_index, kv_len):
        model = nnx.merge(graphdef, state)
        cos, sin = rotary_angles(positions, inv_freq, args.rope_attention_factor)
        ctx = StepContext(positions, cos, sin, kv_len, attn_impl, gemm_impl, args.scale_fmt, moe_impl, unroll,
                          decode_attn)
        return model(tokens, ctx, cache, last_index)

    def step(state, cache, tokens, start_pos, last_index, *, kv_len: int):
        positions = start_pos[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        sharded = jax.shard_map(functools.partial(local_step, kv_len=kv_len), mesh=mesh,
                                in_specs=(state_specs, c_specs, P(), P(), P()), out_specs=(P(), c_specs),
                                check_vma=False)
        return sharded(state, cache, tokens, positions, last_index)

    return jax.jit(step, static_argnames=("kv_len",), donate_argnums=(1,))


def cache_window(end: int, max_seq_len: int) -> int:
    """The attention window for positions < end: the next power of two (at least 64), capped."""
    return min(max_seq_len, max(64, 1 << max(0, end - 1).bit_length()))


class Model:
    """A DeepSeek-V2/V3 model on a mesh, with its cache and jitted step (see `make_step`)."""

    def __init__(self, args: ModelArgs, graphdef: nnx.GraphDef, state: nnx.State, mesh: Mesh, *,
                 dtype=jnp.bfloat16, attn_impl: str = "absorb", gemm_impl: str = "bf16", moe_impl: str = "auto",
                 unroll: bool = False, decode_attn: str = "xla"):
        _check_choices(attn_impl=attn_impl, gemm_impl=gemm_impl, moe_impl=moe_impl, decode_attn=decode_attn)
        self.args, self.graphdef, self.state, self.mesh = args, graphdef, state, mesh
        self.dtype, self.attn_impl, self.gemm_impl, self.moe_impl = dtype, attn_impl, gemm_impl, moe_impl
        self.step = make_step(graphdef, partition_specs(state), args, mesh, attn_impl, gemm_impl, moe_impl, unroll,
                              decode_attn)
        self.cache = allocate_cache(args, attn_impl, mesh, dtype)

    def reset_cache(self) -> None:
        """Zero the cache (not needed between sequences: positions decide what attention reads)."""
        self.cache = allocate_cache(self.args, self.attn_impl, self.mesh, self.dtype)

    def forward(self, tokens, start_pos=0) -> jax.Array:
        """Logits (float32, (B, vocab)) of each row's last token, caching positions [start_pos, start_pos + S).

        tokens: int (B, S) with B <= max_batch_size; start_pos: an int or one int per row.
        Like the reference's `Transformer.forward`, but any chunk may start at any position.
        """
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 2-D integer array (batch, seq), got {tokens.dtype} {tokens.shape}")
        batch, seq = tokens.shape
        if batch < 1 or seq < 1:
            raise ValueError(f"tokens must not be empty, got shape {tokens.shape}")
        if batch > self.args.max_batch_size:
            raise ValueError(f"batch {batch} exceeds max_batch_size={self.args.max_batch_size}")
        if tokens.min() < 0 or tokens.max() >= self.args.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.args.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        start = np.broadcast_to(np.asarray(start_pos, dtype=np.int64), (batch,))
        if start.min() < 0:
            raise ValueError(f"start_pos must not be negative, got {start.min()}")
        end = int(start.max()) + seq
        if end > self.args.max_seq_len:
            raise ValueError(f"positions up to {end} exceed max_seq_len={self.args.max_seq_len}")
        logits, self.cache = self.step(self.state, self.cache, jnp.asarray(tokens, jnp.int32),
                                       jnp.asarray(start, jnp.int32), jnp.full((batch,), seq - 1, jnp.int32),
                                       kv_len=cache_window(end, self.args.max_seq_len))
        return logits

    def generate(self, prompt_tokens: list[list[int]], max_new_tokens: int, eos_id: int, temperature: float = 1.0,
                 seed: int = 0, *, top_k: int = 0, top_p: float = 1.0, on_tokens=None) -> list[list[int]]:
        """Complete each prompt (the reference's `generate`, rows advancing on their own positions).

        Completions stop before the first `eos_id` and after max_new_tokens; temperature 0 is greedy.
        See `dsv3_jax.generate.generate` for the options.
        """
        from .generate import generate

        return generate(self, prompt_tokens, max_new_tokens, eos_id, temperature, seed, top_k=top_k, top_p=top_p,
                        on_tokens=on_tokens)


def _check_choices(**choices) -> None:
    """attn_impl, gemm_impl, moe_impl, decode_attn: each one of its allowed values."""
    allowed = {"attn_impl": ATTN_IMPLS, "gemm_impl": GEMM_IMPLS, "moe_impl": MOE_IMPLS, "decode_attn": DECODE_ATTNS}
    for name, value in choices.items():
        if value not in allowed[name]:
            raise ValueError(f"{name} must be one of {allowed[name]}, got {value!r}")


def _resolve_options(dtype, attn_impl, gemm_impl, moe_impl="auto", decode_attn="xla"):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _check_choices(attn_impl=attn_impl, gemm_impl=gemm_impl, moe_impl=moe_impl, decode_attn=decode_attn)
    return DTYPES[dtype]


def _mesh_for(args: ModelArgs, num_devices: int, mesh: Mesh | None) -> Mesh:
    mesh = mesh if mesh is not None else make_mesh(num_devices)
    check_divisible(args, mesh.devices.size)
    return mesh


def load(path, *, dtype: str = "bfloat16", attn_impl: str = "absorb", gemm_impl: str = "bf16",
         num_devices: int = 1, mesh: Mesh | None = None, max_batch_size: int = 8, max_seq_len: int = 4096,
         config=None, moe_impl: str = "auto", decode_attn: str = "xla") -> Model:
    """Load a checkpoint directory onto `num_devices` devices (or `mesh`), each device reading its own shard.

    The directory holds a Hugging Face checkpoint (config.json + *.safetensors), the reference's
    per-rank files `model{r}-mp{MP}.safetensors` (convert/convert.py; they carry no config, so
    `config` is required), or an orbax checkpoint (convert/to_orbax.py).
    config: None (read `config.json`), a path to a reference or HF JSON, or a `ModelArgs`.
    """
    compute_dtype = _resolve_options(dtype, attn_impl, gemm_impl, moe_impl, decode_attn)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    ranked = rank_files(path)
    if config is None and ranked:
        raise CheckpointError(f"{path} holds the reference's per-rank files, which carry no config: "
                              "pass config= (a reference JSON or ModelArgs)")
    if config is None:
        args = ModelArgs.from_file(find_config(path))
    elif isinstance(config, ModelArgs):
        args = config
    else:
        args = ModelArgs.from_file(config)
    args = args.replace(max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    mesh = _mesh_for(args, num_devices, mesh)
    if is_orbax_checkpoint(path):
        if args.gate_bias is None:
            bias = ("moe_layers", "ffn", "gate", "bias")
            args = args.replace(gate_bias=args.n_moe_layers > 0 and has_array(path, bias))
        graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Transformer(args, dtype=compute_dtype)))
        state = restore_state(path, abstract_state, args, mesh)
    else:
        if ranked:
            index = ReferenceLayoutIndex(path, args.n_routed_experts, home_rank(mesh, len(ranked)))
            naming = reference_naming
        else:
            index, naming = TensorIndex(path), hf_name
        if args.gate_bias is None:
            probe = naming(f"layers.{args.n_dense_layers}.ffn.gate.bias")
            args = args.replace(gate_bias=args.n_moe_layers > 0 and probe in index)
        graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Transformer(args, dtype=compute_dtype)))
        state = load_state(index, abstract_state, args, mesh, naming)
    return Model(args, graphdef, state, mesh, dtype=compute_dtype, attn_impl=attn_impl, gemm_impl=gemm_impl,
                 moe_impl=moe_impl, decode_attn=decode_attn)


def build(args: ModelArgs, *, seed: int = 0, dtype: str = "bfloat16", attn_impl: str = "absorb",
          gemm_impl: str = "bf16", num_devices: int = 1, mesh: Mesh | None = None, moe_impl: str = "auto",
          decode_attn: str = "xla") -> Model:
    """A model with random weights generated directly on the mesh shards (benchmarks, demos)."""
    compute_dtype = _resolve_options(dtype, attn_impl, gemm_impl, moe_impl, decode_attn)
    if args.gate_bias is None:
        args = args.replace(gate_bias=args.score_func == "sigmoid")
    mesh = _mesh_for(args, num_devices, mesh)
    abstract = nnx.eval_shape(lambda: Transformer(args, dtype=compute_dtype, rngs=nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = named_shardings(mesh, partition_specs(abstract_state))
    make = jax.jit(lambda: nnx.split(Transformer(args, dtype=compute_dtype, rngs=nnx.Rngs(seed)))[1],
                   out_shardings=shardings)
    return Model(args, graphdef, make(), mesh, dtype=compute_dtype, attn_impl=attn_impl, gemm_impl=gemm_impl,
                 moe_impl=moe_impl, decode_attn=decode_attn)
