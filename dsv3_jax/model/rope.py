"""Rotary position embedding with YaRN frequency correction, as DeepSeek-V3 uses it.

Angles are computed from absolute positions on the fly (position * inv_freq in float32, the same
product as the reference's precomputed table), so any chunk can start at any per-row position.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.rotary import rotate_ref

from ..config import ModelArgs


def inverse_frequencies(args: ModelArgs) -> np.ndarray:
    """The (qk_rope_head_dim // 2,) float32 inverse frequencies, YaRN-corrected when YaRN is on."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    if not args.yarn_enabled:
        return freqs.astype(np.float32)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(args.original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(args.beta_fast), correction_dim(args.beta_slow)
    if args.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    freqs = freqs / np.float32(args.rope_factor) * (1 - smooth) + freqs * smooth
    return freqs.astype(np.float32)


def rotary_angles(positions: jnp.ndarray, inv_freq: np.ndarray, attention_factor: float = 1.0):
    """cos and sin of position * inv_freq: positions (B, S) int -> two float32 (B, S, rope_dim // 2)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, interleaved: bool = True) -> jnp.ndarray:
    """Rotate x (B, S, [H,] rope_dim) by the angles (B, S, rope_dim // 2), in float32, cast back.

    Interleaved (DeepSeek's layout): each adjacent pair (x[2i], x[2i+1]) is one complex number.
    Otherwise the pairs are (x[i], x[i + d/2]) (rotate-half layout). The math is the decode kernels'
    (`pallas_kernels.rotary.rotate_ref`, their twin), so both paths rotate alike.
    """
    if x.ndim == cos.ndim + 1:  # a heads axis
        cos, sin = cos[..., None, :], sin[..., None, :]
    return rotate_ref(x, cos, sin, interleaved)
