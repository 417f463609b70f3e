"""Models made without a random initialiser. `dsv3_jax.build`'s random weights come from a program
of their own, compiled once per config, mesh and dtype; here the weights are zeros from numpy
(`zero_model`: for tests that only trace, lower or inspect a model's step, whose program depends
on the weights' shapes and splits, not their values, or that check what a model refuses before
any step runs), or `model_shapes` says which dtype each weight takes (to hold given weights as a
model of another compute dtype does)."""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

import dsv3_jax
from dsv3_jax.model.transformer import Transformer
from dsv3_jax.sharding import make_mesh


def model_shapes(args: dsv3_jax.ModelArgs, param_dtype, *, mtp: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """The graph of `args`'s model and its weights' shapes and dtypes (jax.ShapeDtypeStruct), as
    `dsv3_jax.build` makes them for compute dtype `param_dtype`, with no weight made."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(args, param_dtype=param_dtype, mtp=mtp)))


def zero_model(args: dsv3_jax.ModelArgs, *, num_devices: int = 1, mtp: bool = False, **choices) -> dsv3_jax.Model:
    """The model `dsv3_jax.build(args, num_devices=..., mtp=..., **choices)` makes, but every weight 0:
    the same arguments, shapes, splits, options and step."""
    options = dsv3_jax.RunOptions.make(**choices)
    if args.gate_bias is None:  # as build decides it
        args = args.replace(gate_bias=args.score_func == "sigmoid")
    graphdef, shapes = model_shapes(args, options.jnp_dtype, mtp=mtp)
    state = jax.tree.map(lambda shape: np.zeros(shape.shape, shape.dtype), shapes)
    return dsv3_jax.Model(args, graphdef, state, make_mesh(num_devices), options)
