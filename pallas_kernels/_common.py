"""Helpers shared by the kernels: backend choice, argument checks, exact float32 arithmetic.

Nothing here holds state: the interpret-or-compile decision is taken at each call, so the
same code runs compiled on an NVIDIA GPU and in Pallas interpret mode on a CPU.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu
from jax.sharding import ManualAxisType

BLOCK = 128  # DeepSeek's FP8 block: scales cover 128 consecutive elements / 128x128 tiles
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4  # the reference clamps each block's amax to at least this
SHARED_MEMORY_BYTES = 232_448  # the most dynamic shared memory one block may use on sm_90 (H100, H200)


def use_interpret() -> bool:
    """True unless the default backend is a GPU.

    Pallas' Triton backend only compiles for GPUs; elsewhere the kernels run in interpret mode
    (a scan over the grid in plain XLA), which computes the same function, slowly.
    """
    return jax.default_backend() not in ("gpu", "cuda")


def hopper() -> bool:
    """True if the default device is a GPU of compute capability 9.x (H100, H200): wgmma and TMA."""
    if use_interpret():
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_at_most(x: int, cap: int) -> int:
    """Largest power of two <= min(x, cap) (at least 1): Triton block shapes must be powers of 2."""
    return max(1, min(cap, 1 << (max(1, x).bit_length() - 1)))


DEFAULT_SMS = 132  # grid sizing where the device reports no core count (interpret mode): an H100/H200


def num_sms() -> int:
    """Streaming multiprocessors of the default device (its `core_count`), for grid sizing."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or DEFAULT_SMS
    except RuntimeError:
        return DEFAULT_SMS


def fail(fn: str, msg: str) -> None:
    raise ValueError(f"{fn}: {msg}")


def check_dtype(fn: str, name: str, x, allowed: tuple, what: str) -> None:
    if jnp.dtype(x.dtype) not in tuple(jnp.dtype(d) for d in allowed):
        fail(fn, f"{name} has dtype {jnp.dtype(x.dtype).name}, expected {what}")


def check_block_size(fn: str, block_size: int) -> None:
    if block_size != BLOCK:
        fail(fn, f"block_size is {block_size!r}, only {BLOCK} (DeepSeek's FP8 block) is supported")


def check_out_dtype(fn: str, out_dtype) -> jnp.dtype:
    try:
        dt = jnp.dtype(out_dtype)
    except TypeError:
        dt = None
    if dt is None or dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        fail(fn, f"out_dtype is {out_dtype!r}, expected bfloat16, float16 or float32")
    return dt


def check_last_dim(fn: str, name: str, x) -> int:
    if x.ndim < 1:
        fail(fn, f"{name} is a scalar, expected shape (..., K)")
    k = x.shape[-1]
    if k % BLOCK:
        fail(fn, f"{name} has last dim K={k}, which must be a multiple of {BLOCK}")
    return k


def rows(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1])


def vma_union(*operands) -> frozenset:
    """Mesh axes along which any operand varies (non-empty only inside jax.shard_map)."""
    return frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in operands))


def match_vma(varying: frozenset, *operands) -> list:
    """Mark each operand as varying along all of `varying`, as a pallas_call inside shard_map
    with check_vma needs its operands and results to agree (a no-op outside shard_map)."""
    out = []
    for x in operands:
        missing = tuple(sorted(varying - jax.typeof(x).manual_axis_type.varying))
        out.append(lax.pcast(x, missing, to="varying") if missing else x)
    return out


def result(shape, dtype, varying: frozenset) -> jax.ShapeDtypeStruct:
    """pallas_call out_shape entry carrying the shard_map varying-axes type of the operands."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=ManualAxisType(varying=varying))


def interpret_in_shard_map(interpret: bool, *operands) -> bool:
    """True where a kernel would run in interpret mode on device-varying shard_map operands.

    JAX's Pallas interpreter traces the kernel body without shard_map's varying-axes check and
    then evaluates it with the check on, which rejects ordinary kernel code (JAX 0.11). There the
    wrappers compute the kernel's jnp twin instead: the same function (bit for bit for the
    quantisation kernels), only not through Pallas. Compiled GPU kernels are unaffected.
    """
    return interpret and bool(vma_union(*operands))


def ieee_div(x: jax.Array, y: jax.Array) -> jax.Array:
    """Correctly rounded float32 x / y in plain XLA.

    XLA's algebraic simplifier rewrites ``x / broadcast(y)`` (division by a scalar, a constant or
    a per-block scale) into ``x * (1 / y)``, which is off by an ulp about half the time. Hiding
    the broadcast divisor behind an optimization barrier keeps a true division.
    """
    x, y = jnp.broadcast_arrays(x.astype(jnp.float32), jnp.asarray(y, jnp.float32))
    return x / lax.optimization_barrier(y)


def exact_div(x: jax.Array, y: jax.Array, interpret: bool) -> jax.Array:
    """Correctly rounded float32 x / y inside a kernel.

    Triton lowers f32 division to PTX ``div.full.f32`` (about 2 ulp off), which would make the
    quantised values differ from the reference's ``x / s`` near rounding boundaries. On the GPU we
    therefore issue ``div.rn.f32`` (IEEE round-to-nearest) directly; in interpret mode the kernel
    body is plain XLA, see ieee_div.
    """
    if interpret:
        return ieee_div(x, y)
    x, y = jnp.broadcast_arrays(x.astype(jnp.float32), jnp.asarray(y, jnp.float32))
    [q] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, y],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return q


def launch_dependents(program: jax.Array) -> jax.Array:
    """`program` (an int32 program id), after this program has let the kernels queued behind this launch start.

    XLA launches its kernels and these with programmatic dependent launch on Hopper, each waiting at its start
    (`griddepcontrol.wait`) until the launch before it has finished and its writes are visible. Without a
    trigger the next launch begins only as this one's programs exit; with PTX `griddepcontrol.launch_dependents`
    here it begins once every program of this launch has started, so its launch and scheduling overlap this
    one's work. The instruction has no result: it runs inside an inline-asm copy of `program`, which the kernel
    then indexes with, so that it stays in the kernel. Elsewhere (interpret mode, GPUs before Hopper): program.
    """
    if use_interpret() or not hopper():
        return program
    [copy] = plgpu.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;",
        args=[jnp.full((1,), program, jnp.int32)],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)],
    )
    return jnp.sum(copy)


def pow2_ceil(s: jax.Array) -> jax.Array:
    """2**ceil(log2(s)) for positive normal float32 s, exactly, by bit arithmetic.

    Adding 0x7FFFFF to the bits carries into the exponent iff the mantissa is non-zero; masking
    the mantissa off then leaves the next power of two (or s itself if it already is one). This
    avoids log2/exp2, whose GPU versions are approximate and can land on the wrong power.
    """
    bits = lax.bitcast_convert_type(s, jnp.int32)
    bits = (bits + jnp.int32(0x7FFFFF)) & jnp.int32(0x7F800000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def byte_pairs(w: jax.Array) -> jax.Array:
    """A 1-byte (..., K) array viewed as uint16 (..., K/2): byte 2i in the low half of word i. Pallas' Triton lowering
    (jax 0.11.2) indexes a ref of at most 2^32 bytes with 32-bit signed element offsets, so a 1-byte ref of 2^31..2^32
    elements is addressed out of bounds; as uint16 the same bytes are half as many elements."""
    return jax.lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), jnp.uint16)


def even_odd_columns(x: jax.Array) -> jax.Array:
    """x (M, K) with each 128-column block reordered as its 64 even columns, then its 64 odd ones,
    to meet the low and high bytes of `byte_pairs` (a copy of x: small next to the weights)."""
    m, k = x.shape
    return x.reshape(m, k // BLOCK, BLOCK // 2, 2).swapaxes(2, 3).reshape(m, k)


def fp8_pairs(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint16 words -> (low bytes, high bytes) as e4m3 values."""
    low = jax.lax.bitcast_convert_type((words & jnp.uint16(0xFF)).astype(jnp.uint8), FP8)
    high = jax.lax.bitcast_convert_type((words >> jnp.uint16(8)).astype(jnp.uint8), FP8)
    return low, high
