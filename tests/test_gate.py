"""The router against a float64 numpy statement of the reference's Gate, over every combination
of score function, correction bias, expert groups, normalisation and route scale."""
import itertools
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.config import ModelArgs
from dsv3_jax.model.moe import Gate


def reference_gate(x, weight, bias, score_func, groups, topk_groups, topk, normalize, route_scale):
    logits = x.astype(np.float64) @ weight.astype(np.float64).T
    if score_func == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    original = scores.copy()
    if bias is not None:
        scores = scores + bias
    if groups > 1:
        grouped = scores.reshape(len(x), groups, -1)
        group_scores = grouped.max(-1) if bias is None else np.sort(grouped, -1)[..., -2:].sum(-1)
        keep = np.argsort(-group_scores, -1)[:, :topk_groups]
        mask = np.ones_like(group_scores, bool)
        np.put_along_axis(mask, keep, False, -1)
        scores = np.where(mask[..., None], -np.inf, grouped).reshape(len(x), -1)
    indices = np.argsort(-scores, -1)[:, :topk]
    weights = np.take_along_axis(original, indices, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * route_scale, indices


@pytest.mark.parametrize("score_func, with_bias, groups, norm", list(itertools.product(
    ["softmax", "sigmoid"], [False, True], [1, 4], [None, True, False])))
def test_gate_matches_float64_reference(score_func, with_bias, groups, norm):
    experts, dim, topk = 16, 32, 3
    args = ModelArgs(dim=dim, n_routed_experts=experts, n_activated_experts=topk, n_expert_groups=groups,
                     n_limited_groups=2 if groups > 1 else 1, score_func=score_func, route_scale=1.7,
                     gate_bias=with_bias, norm_topk_prob=norm, moe_inter_dim=8)
    rng = np.random.default_rng(zlib.crc32(repr((score_func, with_bias, groups, norm)).encode()))
    gate = Gate(args, param_dtype=jnp.float32, rngs=None)
    # logits of order 1: sigmoid saturates to exactly 1.0 in float32 past |logit| ~ 17, and such
    # ties would make the top-k order arbitrary (float64 still tells them apart)
    weight = (rng.standard_normal((experts, dim)) / np.sqrt(dim)).astype(np.float32)
    gate.weight.set_value(jnp.asarray(weight))
    bias = None
    if with_bias:
        bias = (0.3 * rng.standard_normal(experts)).astype(np.float32)
        gate.bias.set_value(jnp.asarray(bias))
    x = rng.standard_normal((64, dim)).astype(np.float32)
    got_w, got_i = (np.asarray(a) for a in gate(jnp.asarray(x)))
    normalize = (score_func == "sigmoid") if norm is None else norm
    want_w, want_i = reference_gate(x, weight, bias, score_func, groups, args.n_limited_groups, topk, normalize, 1.7)
    np.testing.assert_array_equal(np.sort(got_i, -1), np.sort(want_i, -1))
    order_got, order_want = np.argsort(got_i, -1), np.argsort(want_i, -1)
    np.testing.assert_allclose(np.take_along_axis(got_w, order_got, -1), np.take_along_axis(want_w, order_want, -1),
                               rtol=1e-5, atol=1e-6)
