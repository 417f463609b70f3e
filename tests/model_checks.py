"""What makes two loaded models the same model: the same step parts and the same weights, bit for bit."""
import jax
import numpy as np


def assert_same_model(expected, other) -> None:
    """`other` (say a converted checkpoint, loaded alike) is `expected`: the same step parts (graphdef, args,
    mesh, options, layout), on which every step builder is memoized, so it runs the same compiled programs
    (its forward and generate, greedy or speculative, are `expected`'s), and every weight bit for bit in the
    same dtype and split."""
    assert other.has_mtp == expected.has_mtp and other.parts == expected.parts

    def leaves(model):
        return [(jax.tree_util.keystr(path), leaf) for path, leaf in
                jax.tree_util.tree_flatten_with_path(model.state)[0]]

    want, got = leaves(expected), leaves(other)
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, a), (_, b) in zip(want, got):
        assert b.dtype == a.dtype and b.sharding == a.sharding, name
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
