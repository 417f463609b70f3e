"""The one-launch Pallas router (`pallas_kernels.router.route`, interpret mode on a CPU) against the
float64 numpy statement of the reference's Gate (tests/test_gate.py) and its jnp twin `route_ref`."""
import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.reference import route_ref
from pallas_kernels.router import route
from test_gate import reference_gate

CASES = [  # rows, experts, score_func, bias, groups, topk_groups, topk, normalize, route_scale
    (1, 64, "softmax", False, 1, 1, 6, False, 1.0),  # DeepSeek-V2-Lite, decode
    (5, 64, "softmax", False, 1, 1, 6, False, 1.0),
    (37, 160, "softmax", False, 8, 3, 6, False, 16.0),  # DeepSeek-V2: 160 experts (padded to 256 in the kernel)
    (1, 256, "sigmoid", True, 8, 4, 8, True, 2.5),  # DeepSeek-V3
    (20, 256, "sigmoid", True, 8, 4, 8, True, 2.5),
    (3, 32, "sigmoid", False, 4, 2, 3, True, 1.0),
]


@pytest.mark.parametrize("rows, experts, score_func, with_bias, groups, topk_groups, topk, normalize, scale", CASES)
def test_route_matches_float64_gate(rows, experts, score_func, with_bias, groups, topk_groups, topk, normalize,
                                    scale):
    check(rows, experts, score_func, with_bias, groups, topk_groups, topk, normalize, scale)


@pytest.mark.gpu
def test_route_compiled_on_gpu():
    for case in CASES:
        check(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("block_rows, num_warps", [(16, 4), (4, 2), (16, 1)])
def test_route_other_launches_on_gpu(block_rows, num_warps):
    """Launch shapes other than the default (one row a program on one warp) that scripts/sweep_route.py times,
    at V3's routing and V2's padded groups."""
    for case in (CASES[2], CASES[4]):
        check(*case, block_rows=block_rows, num_warps=num_warps)


def check(rows, experts, score_func, with_bias, groups, topk_groups, topk, normalize, scale, **launch):
    rng = np.random.default_rng(rows * 1000 + experts)
    logits = rng.standard_normal((rows, experts)).astype(np.float32) * 2
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1 if with_bias else None
    routing = dict(topk=topk, n_groups=groups, topk_groups=topk_groups, score_func=score_func,
                   route_scale=scale, normalize=normalize)
    weights, indices = route(jnp.asarray(logits), None if bias is None else jnp.asarray(bias), **routing, **launch)
    want_w, want_i = reference_gate(logits, np.eye(experts, dtype=np.float32), bias, score_func, groups,
                                    topk_groups, topk, normalize, scale)
    assert weights.dtype == jnp.float32 and indices.dtype == jnp.int32 and weights.shape == (rows, topk)
    np.testing.assert_array_equal(np.asarray(indices), want_i)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=2e-6, atol=1e-7)
    twin_w, twin_i = route_ref(jnp.asarray(logits), None if bias is None else jnp.asarray(bias), **routing)
    np.testing.assert_array_equal(np.asarray(twin_i), want_i)
    np.testing.assert_allclose(np.asarray(twin_w), want_w, rtol=2e-6, atol=1e-7)


def test_ties_go_to_the_lower_index():
    """Equal scores: the lower expert (and group) index wins, as with lax.top_k."""
    logits = jnp.zeros((2, 16), jnp.float32)
    for groups, topk_groups in ((1, 1), (4, 2)):
        weights, indices = route(logits, topk=3, n_groups=groups, topk_groups=topk_groups, score_func="sigmoid")
        np.testing.assert_array_equal(np.asarray(indices), [[0, 1, 2]] * 2)
        np.testing.assert_allclose(np.asarray(weights), 0.5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(logits=jnp.zeros((2, 8), jnp.bfloat16), topk=2), "logits must be float32"),
    (dict(logits=jnp.zeros((2, 8)), bias=jnp.zeros(4), topk=2), r"bias has shape \(4,\)"),
    (dict(logits=jnp.zeros((2, 8)), topk=2, score_func="relu"), "score_func is 'relu'"),
    (dict(logits=jnp.zeros((2, 8)), topk=2, n_groups=3), "n_groups=3 must divide the 8 experts"),
    (dict(logits=jnp.zeros((2, 8)), topk=5, n_groups=4, topk_groups=2), r"topk=5 must lie in \[1, 4\]"),
])
def test_errors_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        route(**kwargs)
