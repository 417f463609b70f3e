"""The device mesh, the partition spec of every parameter, and the divisibility rules of the split."""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels import FP8_BLOCK

from .config import ModelArgs
from .layers import MODEL_AXIS


def make_mesh(num_devices: int | None = None, devices=None) -> Mesh:
    """A 1-D mesh over `num_devices` devices (default: all), axis MODEL_AXIS.

    Under `jax.distributed` the devices of every process take part, in process order.
    """
    devices = list(devices) if devices is not None else jax.devices()
    num_devices = num_devices or len(devices)
    if num_devices < 1 or num_devices > len(devices):
        raise ValueError(f"num_devices={num_devices} but {len(devices)} devices are available")
    return Mesh(np.array(devices[:num_devices]), (MODEL_AXIS,))


def check_divisible(args: ModelArgs, parts: int, what: str = "devices of the mesh") -> None:
    """Every split dimension must divide evenly over the `parts` devices of a mesh, or the ranks of
    a per-rank checkpoint (`what` names them); fp8 weights into whole 128-blocks."""
    sizes = {"n_heads": args.n_heads, "vocab_size": args.vocab_size, "inter_dim": args.inter_dim}
    if args.n_moe_layers:
        sizes["n_routed_experts"] = args.n_routed_experts
        if args.n_shared_experts:
            sizes["n_shared_experts * moe_inter_dim"] = args.n_shared_experts * args.moe_inter_dim
    for name, size in sizes.items():
        if size % parts:
            raise ValueError(f"{name}={size} is not divisible by the {parts} {what}")
    if args.quantized and parts > 1:
        split_rows = {"n_heads * qk_head_dim": args.n_heads * args.qk_head_dim,
                      "n_heads * (qk_nope_head_dim + v_head_dim)": args.n_heads * (args.qk_nope_head_dim + args.v_head_dim),
                      "n_heads * v_head_dim": args.n_heads * args.v_head_dim, "inter_dim": args.inter_dim}
        if args.n_moe_layers and args.n_shared_experts:
            split_rows["n_shared_experts * moe_inter_dim"] = args.n_shared_experts * args.moe_inter_dim
        for name, size in split_rows.items():
            if (size // parts) % FP8_BLOCK:
                raise ValueError(f"fp8: {name}={size} split over {parts} {what} does not give each whole "
                                 f"{FP8_BLOCK}-blocks")


def parameter_role(path: tuple[str, ...]) -> str:
    """The paper noun a parameter belongs to (fp8 block scales go with their weight)."""
    if path[0] in ("embed", "head", "norm"):
        return {"embed": "embedding", "head": "head", "norm": "norms"}[path[0]]
    if "attn" in path:
        return "attention"
    if "shared_experts" in path:
        return "shared experts"
    if "experts" in path:
        return "routed experts"
    if "gate" in path:
        return "gate"
    if path[0] == "dense_layers" and "ffn" in path:
        return "dense MLP"
    return "norms"


def parameter_bytes_per_device(state: nnx.State, devices: int) -> dict[str, float]:
    """Bytes of the parameters of each role (`parameter_role`) that one of `devices` devices holds
    (split axes divided by the device count); `state` may be abstract."""
    roles: dict[str, float] = {}
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        shape = [d // devices if axis else d for d, axis in zip(value.shape, variable.get_metadata()["partition"])]
        role = parameter_role(tuple(str(p) for p in path))
        roles[role] = roles.get(role, 0.0) + float(np.prod(shape)) * np.dtype(value.dtype).itemsize
    return roles


def partition_specs(state: nnx.State):
    """The PartitionSpec of every parameter, read from its `partition` metadata."""
    return jax.tree.map(lambda v: P(*v.get_metadata()["partition"]), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_shardings(mesh: Mesh, specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))
