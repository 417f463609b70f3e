"""Training-side pieces: the next-token and MTP losses over a cache-free full-sequence pass, the
expert loads that drive bias balancing, and the export of trained parameters as a Hugging Face
checkpoint.

Everything here runs inside `jax.shard_map` over a mesh, split as a `Layout` (default: not split)
says, the layout naming the mesh axes of the modules' collectives; `shard_over` wraps a function
for a mesh. The forward is the inference model's own (`Transformer.hidden` and the MTP module
called without a cache, a chunk attending to itself), asked to return the MoE layers' expert loads.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from .checkpoint.mtp import mtp_hf_tensors
from .checkpoint.export import write_hf_checkpoint as write_checkpoint
from .checkpoint.schema import hf_name, reference_names, stacked_axes
from .config import ModelArgs
from .decode.step import StepParts, step_builder
from .model.mtp import MTP
from .model.transformer import Transformer, step_context
from .options import RunOptions
from .sharding import Layout, partition_specs

# the run options of training: per-head keys and values (no cache to absorb into), ragged_dot experts
TRAIN_OPTIONS = RunOptions(attn_impl="naive", moe_impl="ragged")


class TrainModel(nnx.Module):
    """The main model and its MTP modules (the parameters a training run optimises)."""

    def __init__(self, args: ModelArgs, *, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.model = Transformer(args, param_dtype=param_dtype, rngs=rngs)
        self.mtp = nnx.List([MTP(args, param_dtype=param_dtype, rngs=rngs) for _ in range(args.n_mtp_layers)])


def head_logits(model: Transformer, hidden: jnp.ndarray, layout: Layout = Layout()) -> jnp.ndarray:
    """float32 logits (..., vocab) of every position (the vocabulary-parallel head, gathered)."""
    return model.logits(hidden, layout)


def token_nll(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """-log p(target) per position, float32."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    return logz - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def forward_losses(model: Transformer, mtp: MTP | None, args: ModelArgs, tokens: jnp.ndarray, *, remat: bool = False,
                   options: RunOptions = TRAIN_OPTIONS, layout: Layout = Layout()) -> dict:
    """Teacher-forced pass over windows tokens (B, S + 1): per-position losses and routing loads.

    Returns nll (B, S) of t_{i+1}; with an MTP module, mtp_nll (B, S - 1) of t_{i+2},
    the MTP draft's argmax and the main model's argmax (to measure greedy acceptance); loads
    (n_moe_layers [+ 1 for the MTP block], E) of the routed experts."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch, seq = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], (batch, seq))
    ctx = step_context(args, positions, seq, options, layout)
    hidden, _, loads = model.hidden(inputs, ctx, None, loads=True, remat=remat)
    logits = head_logits(model, hidden, layout)
    out = {"nll": token_nll(logits, targets), "main_argmax": jnp.argmax(logits, -1)}
    all_loads = [loads] if loads is not None else []
    if mtp is not None:
        ctx = step_context(args, positions[:, 1:], seq - 1, options, layout)  # the block runs at position i + 1
        y, _, mtp_loads = mtp(model.embed(inputs[:, 1:], layout), hidden[:, :-1], ctx, loads=True)
        mtp_logits = head_logits(model, y, layout)
        out["mtp_nll"] = token_nll(mtp_logits, tokens[:, 2:])
        out["mtp_argmax"] = jnp.argmax(mtp_logits, -1)
        if mtp_loads is not None:
            all_loads.append(mtp_loads[None])
    out["loads"] = jnp.concatenate(all_loads) if all_loads else None
    return out


def shard_over(mesh: Mesh, fn, param_specs, n_other: int):
    """fn(params, *others) inside `jax.shard_map` on `mesh` (params split by `param_specs`, the rest replicated)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=(param_specs,) + (P(),) * n_other, out_specs=P(), check_vma=False)


# ------------------------------------------------------------------------ evaluating a loaded model
def sequence_nll(model, tokens, *, mtp: MTP | None = None, **choices):
    """Per-position -log p of windows tokens (B, S + 1) under an `api.Model` (a loaded checkpoint), on
    its mesh, with its run options (attention naive and experts ragged unless `choices` say otherwise);
    with `mtp` (replicated), also the MTP outputs (see forward_losses)."""
    layout = model.layout.unsplit_batch()  # the windows are replicated: every device runs every row
    options = RunOptions.make(model.options, **{"attn_impl": "naive", "moe_impl": "ragged", **choices})
    parts = StepParts(model.graphdef, partition_specs(model.state, layout), model.args, model.mesh, options, layout)
    mtp_graph, mtp_state = nnx.split(mtp) if mtp is not None else (None, None)
    return _scoring_pass(parts, mtp_graph)(model.state, mtp_state, jnp.asarray(tokens, jnp.int32))


@step_builder
def _scoring_pass(parts: StepParts, mtp_graph):
    """The jitted, shard_mapped pass of `sequence_nll` (memoized: every batch of an evaluation reuses it)."""
    def local(state, mtp_state, tokens):
        module = nnx.merge(mtp_graph, mtp_state) if mtp_state is not None else None
        with parts.options.precision_scope():
            out = forward_losses(nnx.merge(parts.graphdef, state), module, parts.args, tokens, options=parts.options,
                                 layout=parts.layout)
        out.pop("loads")
        return out

    return jax.jit(jax.shard_map(local, mesh=parts.mesh, in_specs=(parts.state_specs, P(), P()), out_specs=P(),
                                 check_vma=False))


# ------------------------------------------------------------------------ balancing and export
def update_gate_biases(state: dict, loads: jnp.ndarray, gamma: float) -> dict:
    """DeepSeek-V3's auxiliary-loss-free balancing: bias_i += gamma * sign(mean load - load_i), per MoE
    layer (the MoE stack's biases, then the MTP blocks'), on a pure-dict state; returns a new dict."""
    def nudge(bias, layer_loads):
        layer_loads = layer_loads.astype(jnp.float32)
        return bias + gamma * jnp.sign(layer_loads.mean(-1, keepdims=True) - layer_loads)

    state = jax.tree.map(lambda x: x, state)  # shallow structural copy
    row = 0
    model = state["model"]
    if "moe_layers" in model and "bias" in model["moe_layers"]["ffn"]["gate"]:
        gate = model["moe_layers"]["ffn"]["gate"]
        depth = gate["bias"].shape[0]
        gate["bias"] = nudge(gate["bias"], loads[row:row + depth])
        row += depth
    for key in sorted(state.get("mtp", {})):
        gate = state["mtp"][key]["block"]["ffn"].get("gate") if "ffn" in state["mtp"][key]["block"] else None
        if gate is not None and "bias" in gate:
            gate["bias"] = nudge(gate["bias"], loads[row])
            row += 1
    return state


def is_gate_bias(path: tuple) -> bool:
    names = [str(getattr(p, "key", p)) for p in path]
    return names[-2:] == ["gate", "bias"]


def transformer_hf_tensors(state: nnx.State, args: ModelArgs) -> dict[str, np.ndarray]:
    """Every tensor of a Transformer state under its Hugging Face name (stacks unstacked), numpy."""
    tensors = {}
    for path, variable in nnx.to_flat_state(state):
        path = tuple(str(p) for p in path)
        value = np.asarray(variable.get_value())
        names, axes = reference_names(path, args), stacked_axes(path)
        if axes == 0:
            tensors[hf_name(names)] = value
        elif axes == 1:
            for layer in range(value.shape[0]):
                tensors[hf_name(names(layer))] = value[layer]
        else:
            for layer in range(value.shape[0]):
                for expert in range(value.shape[1]):
                    tensors[hf_name(names(layer, expert))] = value[layer, expert]
    return tensors


def checkpoint_tensors(tm: TrainModel, args: ModelArgs, *, mtp_copies: bool = True) -> dict[str, np.ndarray]:
    """The whole model, MTP module at layer num_hidden_layers included, under Hugging Face names."""
    tensors = transformer_hf_tensors(nnx.split(tm.model)[1], args)
    if len(tm.mtp):
        embed = tensors["model.embed_tokens.weight"] if mtp_copies else None
        head = tensors["lm_head.weight"] if mtp_copies else None
        tensors.update(mtp_hf_tensors(nnx.split(tm.mtp[0])[1], args, embed, head))
    return tensors


def param_count(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


__all__ = ["TrainModel", "TRAIN_OPTIONS", "forward_losses", "sequence_nll", "update_gate_biases", "checkpoint_tensors",
           "write_checkpoint", "shard_over"]
