"""The public entry points: `load` a checkpoint or `build` a random model, then `Model.forward`.

A `Model` holds the parameters (sharded over its mesh), one cache for (max_batch_size,
max_seq_len), and the jitted step. The step is compiled once per (batch, chunk length, cache
window) and updates the donated cache in place; a prompt longer than `RunOptions.prefill_chunk`
goes in as several steps of at most that many tokens per row.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from .checkpoint.load import CONFIG_HINT, ReferenceLayoutIndex, find_config, home_rank, load_state
from .checkpoint.orbax import OrbaxMTPIndex, has_array, is_orbax_checkpoint, restore_state
from .checkpoint.safetensors import TensorIndex
from .checkpoint.schema import MTP_STATE, hf_name, mtp_probe, rank_files, with_gate_bias
from .config import ModelArgs, trained_positions, window_for
from .decode.generate import generate, make_decode_step
from .decode.speculative import make_mtp_steps
from .decode.step import StepParts, make_step
from .errors import CheckpointError, NoMTPLayerError
from .memory import check_fits
from .model.cache import allocate_cache, cache_window
from .model.transformer import Transformer
from .options import RunOptions
from .progress import progress_bar
from .sharding import Layout, check_layout, make_mesh, named_shardings, partition_specs


class Model:
    """A DeepSeek-V2/V3 model on a mesh, with its cache and jitted step (see `decode.step.make_step`)."""

    def __init__(self, args: ModelArgs, graphdef: nnx.GraphDef, state: nnx.State, mesh: Mesh,
                 options: RunOptions = RunOptions(), *, layout: Layout | None = None):
        """`state` is placed as `options.layout` splits it on `mesh` (no copy where it already is);
        `layout`: that split, when the caller has already resolved it (`model_layout`)."""
        self.args, self.graphdef, self.mesh, self.options = args, graphdef, mesh, options
        self.layout = layout or model_layout(args, options, mesh)
        specs = partition_specs(state, self.layout)
        self.state = jax.device_put(state, named_shardings(mesh, specs))
        self.has_mtp = MTP_STATE in state
        self.parts = StepParts(graphdef, specs, args, mesh, options, self.layout)
        self.step = make_step(self.parts)
        self.decode_step = make_decode_step(self.parts)
        self.cache = allocate_cache(args, options.attn_impl, mesh, self.layout, options.jnp_dtype, mtp=self.has_mtp)
        self._mtp_steps = None

    @property
    def mtp_steps(self):
        """The jitted MTP prefill and speculative step (`speculative.make_mtp_steps`), made on first use."""
        if not self.has_mtp:
            raise ValueError("this model has no MTP module: load it with mtp=True (or build(..., mtp=True))")
        if self.layout.size("batch") > 1:
            raise ValueError(f"MTP speculative decoding needs a layout that does not split the batch, not "
                             f"{self.layout.name!r}")
        if self._mtp_steps is None:
            self._mtp_steps = make_mtp_steps(self.parts)
        return self._mtp_steps

    def forward(self, tokens, start_pos=0) -> jax.Array:
        """Logits (float32, (B, vocab)) of each row's last token, caching positions [start_pos, start_pos + S).

        tokens: int (B, S) with B <= max_batch_size; start_pos: an int or one int per row.
        Like the reference's `Transformer.forward`, but any chunk may start at any position; S beyond
        `options.prefill_chunk` runs as consecutive steps of that many tokens (the same result).
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
        start = np.asarray(start_pos)
        if not np.issubdtype(start.dtype, np.integer) or start.ndim > 1:
            raise TypeError(f"start_pos must be an int or a list of one int per row, got {start_pos!r}")
        if start.ndim == 1 and start.size != batch:
            raise ValueError(f"start_pos has {start.size} entries for a batch of {batch} rows")
        start = np.broadcast_to(start.astype(np.int64), (batch,))
        if start.min() < 0:
            raise ValueError(f"start_pos must not be negative, got {start.min()}")
        end = int(start.max()) + seq
        if end > self.args.max_seq_len:
            raise ValueError(f"positions up to {end} exceed max_seq_len={self.args.max_seq_len}")
        return self._prefill_chunks(tokens, start)

    def _prefill_chunks(self, tokens: np.ndarray, start: np.ndarray) -> jax.Array:
        """`forward` after its checks: consecutive steps of at most `options.prefill_chunk` tokens per
        row, each attending over the cache window that covers its end; the last step's logits."""
        chunk = self.options.prefill_chunk
        for offset in range(0, tokens.shape[1], chunk):
            piece = tokens[:, offset:offset + chunk]
            end = int(start.max()) + offset + piece.shape[1]
            # numpy operands: the step takes them as they are (an eager jnp cast or fill would compile
            # one small program per chunk shape)
            logits, self.cache = self.step(self.state, self.cache, np.asarray(piece, np.int32),
                                           np.asarray(start + offset, np.int32),
                                           np.full((piece.shape[0],), piece.shape[1] - 1, np.int32),
                                           kv_len=cache_window(end, self.args.max_seq_len))
        return logits

    def generate(self, prompt_tokens: list[list[int]], max_new_tokens: int, eos_id: int, temperature: float = 1.0,
                 seed: int = 0, *, top_k: int = 0, top_p: float = 1.0, on_tokens=None, mtp: bool = False,
                 stats: dict | None = None) -> list[list[int]]:
        """Complete each prompt (the reference's `generate`, rows advancing on their own positions).

        Completions stop before the first `eos_id` and after max_new_tokens; temperature 0 is greedy.
        See `dsv3_jax.decode.generate.generate` for the options (and the `MaxSeqLenWarning` naming
        completions that max_seq_len cut short). mtp=True decodes speculatively with the
        MTP module's drafts (same outputs when greedy, same distribution when sampling; see
        `dsv3_jax.decode.speculative`); `stats` (a dict) then receives the drafts' acceptance rate.
        """
        return generate(self, prompt_tokens, max_new_tokens, eos_id, temperature, seed, top_k=top_k, top_p=top_p,
                        on_tokens=on_tokens, mtp=mtp, stats=stats)


def _check_gemm_impl(args: ModelArgs, options: RunOptions, path: Path) -> None:
    """gemm_impl "fp8" quantises activations for fp8 weights: asked of other weights, it would not run."""
    if options.gemm_impl == "fp8" and not args.quantized:
        raise ValueError(f"gemm_impl 'fp8' (--gemm-impl fp8) multiplies fp8 weights, but {path} holds {args.dtype} "
                         "weights: use gemm_impl 'bf16', the default")


def _run_options(options: RunOptions | None, dtype: str | None, choices: dict) -> RunOptions:
    """The RunOptions of a `load`/`build` call: `options` with the keyword choices applied.
    `dtype` is the former name of `compute_dtype`, still accepted."""
    if dtype is not None:
        choices = {"compute_dtype": dtype, **choices}
    return RunOptions.make(options, **choices)


def auto_num_devices(args: ModelArgs, options: RunOptions, available: int | None = None) -> tuple[int, str | None]:
    """The most devices, at most `available` (default: all), that `options.layout` splits the model over
    evenly, and when that is fewer than `available` the reason (what does not divide). Under several
    processes: all of them, since every process's devices belong to the mesh."""
    available = available or jax.device_count()
    if jax.process_count() > 1:
        return available, None
    reason = None
    for count in range(available, 1, -1):
        try:
            check_layout(args, Layout.for_mesh(options.layout, make_mesh(count)))
            return count, reason
        except ValueError as error:
            reason = reason or str(error)
    return 1, reason


def _mesh_for(args: ModelArgs, options: RunOptions, num_devices: int | str, mesh: Mesh | None) -> Mesh:
    """`mesh`, or one over `num_devices` devices ("auto": `auto_num_devices`)."""
    if mesh is not None:
        return mesh
    if num_devices == "auto":
        num_devices = auto_num_devices(args, options)[0]
    elif isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int or 'auto', got {num_devices!r}")
    return make_mesh(num_devices)


def model_layout(args: ModelArgs, options: RunOptions, mesh: Mesh) -> Layout:
    """The layout `options.layout` names on `mesh`, checked against the model's dimensions."""
    layout = Layout.for_mesh(options.layout, mesh)
    check_layout(args, layout)
    return layout


def load(path, *, options: RunOptions | None = None, num_devices: int | str = 1, mesh: Mesh | None = None,
         max_batch_size: int = 8, max_seq_len: int | None = None, config=None, dtype: str | None = None,
         progress: bool | None = None, mtp: bool = False, **choices) -> Model:
    """Load a checkpoint directory onto `num_devices` devices (or `mesh`), each device reading its own shard;
    num_devices "auto": the most devices the layout splits the model's dimensions over (`auto_num_devices`).

    The directory holds a Hugging Face checkpoint (config.json + *.safetensors), the reference's
    per-rank files `model{r}-mp{MP}.safetensors` (`dsv3-convert`; they carry no config, so
    `config` is required), or an orbax checkpoint (`dsv3-to-orbax`).
    config: None (read `config.json`), a path to a reference or HF JSON, or a `ModelArgs`.
    options / choices: the `RunOptions`, or any of its fields as keywords (compute_dtype="float32",
    attn_impl=..., gemm_impl=..., moe_impl=..., decode_attn=..., layout=..., unroll=...); `layout`
    names how the model is split over the mesh (`dsv3_jax.sharding.PRESETS`: "tp", "dp-attn",
    "rep-attn", "ep-only"), and loading reads each device's shard for that split.
    progress: a bar of the bytes and tensors read (process 0 only); None: when stderr is a terminal.
    mtp: also load the multi-token-prediction module (layer num_hidden_layers), for
    `generate(..., mtp=True)`; without it no MTP tensor is read.
    max_seq_len: positions of the cache (prompt + completion); None: 4096, or fewer when the Hugging Face
    config says the model was trained at fewer (max_position_embeddings without rope scaling); a larger
    request is cut to those positions with a `PositionLimitWarning` (past them the model is untrained).
    Before anything is read, the weights, the cache and a prefill chunk's working set are planned
    against the devices' memory (`dsv3_jax.memory.check_fits`): a `MemoryPlanError` names what fits.
    """
    options = _run_options(options, dtype, choices)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    ranked = rank_files(path)
    if config is None and ranked:
        raise CheckpointError(f"{path} holds the reference's per-rank files, which carry no config: "
                              f"{CONFIG_HINT}")
    if config is None:
        config = find_config(path)
    args = config if isinstance(config, ModelArgs) else ModelArgs.from_file(config)
    limit = None if isinstance(config, ModelArgs) else trained_positions(config)
    args = args.replace(max_batch_size=max_batch_size, max_seq_len=window_for(max_seq_len, limit))
    _check_gemm_impl(args, options, path)
    mesh = _mesh_for(args, options, num_devices, mesh)
    layout = model_layout(args, options, mesh)
    check_fits(args, layout, options, mtp=mtp, devices=mesh.devices.flat)  # before any weight is read
    if is_orbax_checkpoint(path):
        args = with_gate_bias(args, lambda name: has_array(path, ("moe_layers", "ffn", "gate", "bias")))
        graphdef, abstract_state = _abstract(args, options, mtp=mtp)
        main, mtp_part = _split_mtp(abstract_state)
        # orbax restores the whole state in one call: the bar can only say when it is done
        with progress_bar(1, desc="restoring orbax state", unit="checkpoint", enabled=progress) as bar:
            state = restore_state(path, main, args, mesh, layout)
            bar.update(1)
        if mtp:
            index = OrbaxMTPIndex(path, args)
            if hf_name(mtp_probe(args)) not in index:
                raise NoMTPLayerError(f"{path} holds no MTP layer (no {mtp_probe(args)!r} under 'mtp'): "
                                      "load it without mtp=True")
            state = _join(state, load_state(index, mtp_part, args, mesh, layout, hf_name, progress=progress))
    else:
        if ranked:
            index, naming = ReferenceLayoutIndex(path, args.n_routed_experts, home_rank(mesh, len(ranked))), str
        else:
            index, naming = TensorIndex(path), hf_name
        args = with_gate_bias(args, lambda name: naming(name) in index)
        if mtp and naming(mtp_probe(args)) not in index:
            raise NoMTPLayerError(f"{path} holds no MTP layer (no tensor {naming(mtp_probe(args))!r}): "
                                  "load it without mtp=True")
        graphdef, abstract_state = _abstract(args, options, mtp=mtp)
        state = load_state(index, abstract_state, args, mesh, layout, naming, progress=progress)
    return Model(args, graphdef, state, mesh, options, layout=layout)


def _abstract(args: ModelArgs, options: RunOptions, seed: int | None = None, mtp: bool = False):
    """(graphdef, abstract state) of the model: shapes only, no memory."""
    return nnx.split(nnx.eval_shape(
        lambda: Transformer(args, param_dtype=options.jnp_dtype, rngs=None if seed is None else nnx.Rngs(seed),
                            mtp=mtp)))


def _split_mtp(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the main model's part of a state, the MTP module's part, under "mtp")."""
    flat = list(nnx.to_flat_state(state))
    main = [(p, v) for p, v in flat if str(p[0]) != MTP_STATE]
    return nnx.from_flat_state(main), nnx.from_flat_state([(p, v) for p, v in flat if str(p[0]) == MTP_STATE])


def _join(*states: nnx.State) -> nnx.State:
    return nnx.from_flat_state([item for state in states for item in nnx.to_flat_state(state)])


def build(args: ModelArgs, *, seed: int = 0, options: RunOptions | None = None, num_devices: int | str = 1,
          mesh: Mesh | None = None, dtype: str | None = None, mtp: bool = False, **choices) -> Model:
    """A model with random weights generated directly on the mesh shards (benchmarks, demos);
    `options` / `choices` as in `load`; mtp=True adds a random MTP module."""
    options = _run_options(options, dtype, choices)
    if args.gate_bias is None:
        args = args.replace(gate_bias=args.score_func == "sigmoid")
    mesh = _mesh_for(args, options, num_devices, mesh)
    graphdef, abstract_state = _abstract(args, options, seed, mtp=mtp)
    layout = model_layout(args, options, mesh)
    check_fits(args, layout, options, mtp=mtp, devices=mesh.devices.flat)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    leaves, structure = jax.tree.flatten(named_shardings(mesh, partition_specs(abstract_state, layout)))
    make = _random_init(args, options.jnp_dtype, mtp, structure, tuple(leaves))
    return Model(args, graphdef, make(np.uint32(seed)), mesh, options, layout=layout)


@functools.lru_cache(maxsize=8)
def _random_init(args: ModelArgs, param_dtype, mtp: bool, structure, shardings: tuple):
    """The jitted `seed -> state` of `build`, its weights placed by `shardings` (the leaves of the state's
    tree `structure`). Memoized, as the step builders are: building the same model again, with any seed,
    traces and compiles nothing."""
    return jax.jit(lambda seed: nnx.split(Transformer(args, param_dtype=param_dtype,
                                                      rngs=nnx.Rngs(jax.random.key(seed)),
                                                      mtp=mtp))[1],
                   out_shardings=jax.tree.unflatten(structure, shardings))
