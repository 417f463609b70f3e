"""The device mesh and the `Layout`: how every parameter, the cache and a step's rows are split.

Parameters (and the cache and a step's activations) name *logical* axes (`LOGICAL_AXES`: "heads",
"experts", "vocab_out", "batch", ...); one rules table, made by `Layout` from its per-layer-kind
choices and the mesh's axes, maps each logical axis to the mesh axes it is split over. Modules
never name a mesh axis: their collectives take the mesh axes from the step's layout
(`StepContext.layout`). A mesh has one or two axes: a 1-D mesh's axis is the *model* axis; a 2-D
mesh (outer, inner) has a *data* axis (outer: rows of the batch) and a model axis (inner).
Routed experts are split over every device of the mesh.

Layer kinds and their choices (`KINDS`), combined into the named presets of `PRESETS`:
  attention  "tp": heads split over the model axis (row-parallel `wo`, one psum per layer);
             "dp": weights replicated, the step's rows and the cache split by batch over every axis;
             "replicated": weights and cache replicated over the model axis, every device runs all rows.
  experts    "ep": routed experts split over every device, one reduction per MoE layer.
  mlp        the dense MLP and the shared experts: "tp" (hidden units split: the dense MLP over the
             model axis, the shared experts like the routed ones, reduced together) or "replicated".
  head       the embedding and the output head: "tp" (vocabulary split) or "replicated".
When a layer's split axes include axes the batch is split over (e.g. "dp" attention before "ep"
experts), the layer first gathers the rows of those devices and reduce-scatters its output back
(`Layout.reduction`): the same count of collectives as a psum, on the same bytes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels import FP8_BLOCK

from .config import ModelArgs

LOGICAL_AXES = {
    "batch": "the rows of a step and of the cache",
    "layers": "the layers of a stack",
    "embed": "the model dimension",
    "vocab_in": "the embedding's vocabulary",
    "vocab_out": "the head's vocabulary",
    "heads": "the attention heads",
    "q_lora": "the query's low-rank dimension",
    "kv_lora": "the latent and rotary-key dimension",
    "ffn": "the dense MLP's hidden units",
    "shared_ffn": "the shared experts' hidden units",
    "experts": "the routed experts",
    "expert_ffn": "each routed expert's hidden units",
    "router": "the gate's rows (one per routed expert)",
}
KINDS = {"attention": ("tp", "dp", "replicated"), "experts": ("ep",), "mlp": ("tp", "replicated"),
         "head": ("tp", "replicated")}
PRESETS = {
    # today's split: attention TP, experts EP, dense MLP and shared experts TP, vocabulary split
    "tp": dict(attention="tp", experts="ep", mlp="tp", head="tp"),
    # attention and its cache split by batch; only the routed experts split (a gather and a
    # reduce-scatter around each MoE layer, nothing around attention or the dense layers)
    "dp-attn": dict(attention="dp", experts="ep", mlp="replicated", head="replicated"),
    # attention as "dp-attn", the rest split as "tp" (less memory than "dp-attn"; each split layer
    # gathers the rows and reduce-scatters its output, the embedding and head once per step)
    "dp-attn-tp": dict(attention="dp", experts="ep", mlp="tp", head="tp"),
    # attention replicated (no collective), the rest as "tp": one psum per layer
    "rep-attn": dict(attention="replicated", experts="ep", mlp="tp", head="tp"),
    # only the routed experts split: one psum per MoE layer and none elsewhere
    "ep-only": dict(attention="replicated", experts="ep", mlp="replicated", head="replicated"),
}
DEFAULT_AXES = {1: ("model",), 2: ("data", "model")}  # the axes `make_mesh` names


def make_mesh(num_devices: int | None = None, devices=None, data: int = 1) -> Mesh:
    """A mesh over `num_devices` devices (default: all): 1-D, axis "model", or with `data` > 1 2-D,
    axes ("data", "model") of shape (data, num_devices // data).

    Under `jax.distributed` the devices of every process take part, in process order.
    """
    devices = list(devices) if devices is not None else jax.devices()
    num_devices = num_devices or len(devices)
    if num_devices < 1 or num_devices > len(devices):
        raise ValueError(f"num_devices={num_devices} but {len(devices)} devices are available")
    if data < 1 or num_devices % data:
        raise ValueError(f"a data axis of {data} does not divide the {num_devices} devices")
    if data == 1:
        return Mesh(np.array(devices[:num_devices]), DEFAULT_AXES[1])
    return Mesh(np.array(devices[:num_devices]).reshape(data, num_devices // data), DEFAULT_AXES[2])


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a model is split over a mesh of `mesh_shape` (axes `mesh_axes`): one choice per layer
    kind (`KINDS`) and the rules table they make (logical axis -> mesh axes, `axes`).

    Made from a preset (`Layout.preset`, `Layout.for_mesh`); the default, no mesh axes, splits
    nothing (a model run outside `shard_map`). Mesh axes of size 1 are left out of the rules, so
    a layout on one device has no collective.
    """

    mesh_axes: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    attention: str = "tp"
    experts: str = "ep"
    mlp: str = "tp"
    head: str = "tp"
    name: str = "tp"
    split_batch: bool = True  # False: every device runs every row (`unsplit_batch`)
    rules: tuple[tuple[str, tuple[str, ...]], ...] = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self):
        if len(self.mesh_axes) != len(self.mesh_shape) or len(self.mesh_axes) > 2:
            raise ValueError(f"a layout's mesh has one or two axes, got axes {self.mesh_axes} of shape "
                             f"{self.mesh_shape}")
        for kind, allowed in KINDS.items():
            if getattr(self, kind) not in allowed:
                raise ValueError(f"layout {kind} must be one of {allowed}, got {getattr(self, kind)!r}")
        sized = [(axis, size) for axis, size in zip(self.mesh_axes, self.mesh_shape) if size > 1]
        model = tuple(a for a, _ in sized if a == self.mesh_axes[-1])
        data = tuple(a for a, _ in sized if a != self.mesh_axes[-1])
        every = data + model
        experts = every
        rules = {name: () for name in LOGICAL_AXES}
        rules.update(
            batch=(every if self.attention == "dp" else data) if self.split_batch else (),
            heads=model if self.attention == "tp" else (),
            experts=experts,
            ffn=model if self.mlp == "tp" else (),
            shared_ffn=experts if self.mlp == "tp" else (),
            vocab_in=model if self.head == "tp" else (),
            vocab_out=model if self.head == "tp" else (),
        )
        object.__setattr__(self, "rules", tuple(rules.items()))

    @classmethod
    def preset(cls, name: str, mesh_axes: tuple[str, ...] = (), mesh_shape: tuple[int, ...] = ()) -> Layout:
        """The preset `name` (`PRESETS`) on a mesh of these axes and shape."""
        if name not in PRESETS:
            raise ValueError(f"unknown layout {name!r}; the layouts are {', '.join(PRESETS)}")
        return cls(tuple(mesh_axes), tuple(mesh_shape), name=name, **PRESETS[name])

    @classmethod
    def for_mesh(cls, name: str, mesh: Mesh) -> Layout:
        return cls.preset(name, tuple(mesh.axis_names), tuple(mesh.devices.shape))

    def unsplit_batch(self) -> Layout:
        """This layout with every row on every device ("dp" attention then runs as "replicated"):
        for computations whose rows are replicated, such as `training.sequence_nll`."""
        return dataclasses.replace(self, split_batch=False)

    # ------------------------------------------------------------------ the rules
    def axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes logical axis `logical` is split over (None: never split)."""
        if logical is None:
            return ()
        table = dict(self.rules)
        if logical not in table:
            raise ValueError(f"unknown logical axis {logical!r}; the logical axes are {', '.join(LOGICAL_AXES)}")
        return table[logical]

    def size(self, logical: str | None) -> int:
        """How many parts logical axis `logical` is split into."""
        shape = dict(zip(self.mesh_axes, self.mesh_shape))
        return math.prod(shape[a] for a in self.axes(logical))

    def spec(self, *logical: str | None) -> P:
        """The PartitionSpec of an array whose axes are these logical axes."""
        entries = [self.axes(name) for name in logical]
        return P(*(None if not e else e[0] if len(e) == 1 else e for e in entries))

    def reduction(self, *logical: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(gathered, summed): the collectives of a layer whose partial outputs are split over the
        mesh axes of `logical` while its input rows are split over those of "batch". Rows are
        all-gathered over `gathered` (split axes the batch is split over too) before the layer,
        the output reduce-scattered back over them and psummed over `summed` (the rest)."""
        split = [a for a in self.mesh_axes if any(a in self.axes(name) for name in logical)]
        gathered = tuple(a for a in self.axes("batch") if a in split)
        return gathered, tuple(a for a in split if a not in gathered)

    # ------------------------------------------------------------------ inside shard_map
    def index(self, logical: str) -> jnp.ndarray:
        """This device's part of logical axis `logical` (0 when it is not split)."""
        axes = self.axes(logical)
        return jax.lax.axis_index(axes) if axes else jnp.int32(0)

    def psum(self, x: jnp.ndarray, logical: str) -> jnp.ndarray:
        """x summed over the devices logical axis `logical` is split over."""
        axes = self.axes(logical)
        return jax.lax.psum(x, axes) if axes else x

    @staticmethod
    def gather_rows(x: jnp.ndarray, gathered: tuple[str, ...]) -> jnp.ndarray:
        """The rows (axis 0) of every device along `gathered`, in mesh order."""
        return jax.lax.all_gather(x, gathered, axis=0, tiled=True) if gathered else x

    @staticmethod
    def reduce_rows(y: jnp.ndarray, gathered: tuple[str, ...], summed: tuple[str, ...]) -> jnp.ndarray:
        """The inverse of `gather_rows` for a partial output: summed over `gathered` and `summed`,
        each device keeping its own rows."""
        if gathered:
            y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, summed) if summed else y

    def own_rows(self, x: jnp.ndarray, gathered: tuple[str, ...]) -> jnp.ndarray:
        """This device's rows of rows gathered over `gathered` (`gather_rows`'s inverse, no sum)."""
        if not gathered:
            return x
        shape = dict(zip(self.mesh_axes, self.mesh_shape))
        rows = x.shape[0] // math.prod(shape[a] for a in gathered)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(gathered) * rows, rows, axis=0)

    # ------------------------------------------------------------------ the rows of a step
    def padded_batch(self, batch: int) -> int:
        """Rows a step of `batch` rows runs: a multiple of the devices the batch is split over."""
        parts = self.size("batch")
        return -(-batch // parts) * parts

    def row_order(self, batch: int) -> np.ndarray:
        """The order in which a step's (padded) rows are laid out for the batch split: row i goes to
        device i % parts as its local row i // parts, so that it meets the same cache row whatever
        the batch (the cache rows of device d are its contiguous block). Rows past the caller's
        batch are padding; they write their cache rows, which no row of the call reads."""
        parts = self.size("batch")
        return np.arange(batch).reshape(batch // parts, parts).T.reshape(-1)


def check_layout(args: ModelArgs, layout: Layout, what: str = "devices of the mesh") -> None:
    """Every dimension of the weights the layout splits must divide evenly into its parts (`what`
    names the devices or ranks); fp8 weights into whole 128-blocks. (Rows are padded instead:
    `Layout.padded_batch`.)"""
    sizes = {"heads": ("n_heads", args.n_heads), "vocab_in": ("vocab_size", args.vocab_size),
             "vocab_out": ("vocab_size", args.vocab_size), "ffn": ("inter_dim", args.inter_dim)}
    if args.n_moe_layers:
        sizes["experts"] = ("n_routed_experts", args.n_routed_experts)
        sizes["expert_ffn"] = ("moe_inter_dim", args.moe_inter_dim)
        if args.n_shared_experts:
            sizes["shared_ffn"] = ("n_shared_experts * moe_inter_dim", args.n_shared_experts * args.moe_inter_dim)
    for logical, (name, size) in sizes.items():
        parts = layout.size(logical)
        if size % parts:
            raise ValueError(f"{name}={size} is not divisible by the {parts} {what} (layout {layout.name!r} "
                             f"splits {LOGICAL_AXES[logical]})")
    if not args.quantized:
        return
    rows = [("heads", "n_heads * qk_head_dim", args.n_heads * args.qk_head_dim),
            ("heads", "n_heads * (qk_nope_head_dim + v_head_dim)",
             args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)),
            ("heads", "n_heads * v_head_dim", args.n_heads * args.v_head_dim), ("ffn", "inter_dim", args.inter_dim)]
    if args.n_moe_layers:
        rows.append(("expert_ffn", "moe_inter_dim", args.moe_inter_dim))
        if args.n_shared_experts:
            rows.append(("shared_ffn", "n_shared_experts * moe_inter_dim", args.n_shared_experts * args.moe_inter_dim))
    for logical, name, size in rows:
        parts = layout.size(logical)
        if parts > 1 and (size // parts) % FP8_BLOCK:
            raise ValueError(f"fp8: {name}={size} split over {parts} {what} does not give each whole "
                             f"{FP8_BLOCK}-blocks")


def check_divisible(args: ModelArgs, parts: int, what: str = "devices of the mesh") -> None:
    """`check_layout` for today's split ("tp") over `parts` devices or ranks: what the reference's
    per-rank checkpoints (`dsv3-convert --model-parallel`) are cut by."""
    check_layout(args, Layout.preset("tp", DEFAULT_AXES[1], (parts,)), what)


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


def parameter_bytes_per_device(state: nnx.State, layout: Layout) -> dict[str, float]:
    """Bytes of the parameters of each role (`parameter_role`) that one device holds under
    `layout` (split axes divided into their parts); `state` may be abstract."""
    roles: dict[str, float] = {}
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        shape = [d // layout.size(axis) for d, axis in zip(value.shape, variable.get_metadata()["partition"])]
        role = parameter_role(tuple(str(p) for p in path))
        roles[role] = roles.get(role, 0.0) + float(np.prod(shape)) * np.dtype(value.dtype).itemsize
    return roles


def partition_specs(state: nnx.State, layout: Layout):
    """The PartitionSpec of every parameter under `layout`, from its logical axes (`partition` metadata)."""
    return jax.tree.map(lambda v: layout.spec(*v.get_metadata()["partition"]), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_shardings(mesh: Mesh, specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))
