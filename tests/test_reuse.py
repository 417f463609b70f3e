"""A second model of the same graph, split, config, mesh and options shares the first one's jitted
programs (random initialisation and steps) instead of tracing and compiling them again, and still
holds its own weights and cache."""
from pathlib import Path

import jax
import numpy as np

import dsv3_jax
from dsv3_jax.api import _random_init

TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"


def weights(model) -> np.ndarray:
    return np.concatenate([np.asarray(leaf, np.float32).ravel() for leaf in jax.tree.leaves(model.state)])


def test_building_again_reuses_the_program_but_not_the_weights():
    """Would catch a memoized initialisation that ignored the seed (two seeds, one set of weights) or that
    was not reused (a miss for the same config)."""
    args = dsv3_jax.ModelArgs.from_file(TINY / "config.json").replace(max_batch_size=1, max_seq_len=32)
    first = dsv3_jax.build(args, seed=1)
    hits = _random_init.cache_info().hits
    again, other = dsv3_jax.build(args, seed=1), dsv3_jax.build(args, seed=2)
    assert _random_init.cache_info().hits == hits + 2
    assert np.array_equal(weights(first), weights(again))
    assert not np.allclose(weights(first), weights(other))


def test_loading_again_shares_the_steps_and_keeps_its_own_cache():
    """Would catch steps rebuilt per model (every program traced again) or shared state between models:
    the second model's generation runs on its own cache and gives the first one's tokens."""
    # loaded, and prompted (3 rows in the 16-token bucket), as tests/test_decode_graph.py and
    # tests/test_generate.py load and prompt the tiny model: the session's compilation cache serves
    # the programs of their generate calls
    first, second = (dsv3_jax.load(TINY, compute_dtype="float32", max_batch_size=3, max_seq_len=64) for _ in range(2))
    assert first.step is second.step and first.decode_step is second.decode_step
    assert first.cache["kv"] is not second.cache["kv"]
    prompts = [[0, 5, 6, 7], [0, 9], [0, 2, 15, 16, 17]]
    expected = first.generate(prompts, 6, eos_id=-1, temperature=0.0)
    assert second.generate(prompts, 6, eos_id=-1, temperature=0.0) == expected
    other = dsv3_jax.load(TINY, compute_dtype="float32", max_batch_size=3, max_seq_len=64, attn_impl="naive")
    assert other.step is not first.step  # other options: other programs
