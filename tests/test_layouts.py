"""Every layout (`dsv3_jax.sharding.PRESETS`) on 4 devices, and on a 2x2 mesh (tp, dp-attn-tp and
rep-attn, which make there every split that dp-attn and ep-only make), computes what the 1-device
model computes (float32): the logits of a prefill and of decode steps whose rows sit at different
positions (3 rows: the batch split pads them), and greedy completions of prompts of unequal
lengths. Also the rules the presets make, the collectives each asks for per layer, and the errors
of a bad layout."""
import jax
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.decode.generate import MIN_PREFILL_BUCKET, prefill_chunk_step
from dsv3_jax.model.cache import cache_window
from dsv3_jax.sharding import PRESETS, Layout, make_mesh
from script_modules import load_script
from zero_models import zero_model

TOL = 2e-5
PROMPTS = [[5, 17, 300, 2, 9, 44, 101], [7, 7, 1], [400, 33, 8, 250, 3]]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """A tiny V3 checkpoint (MoE with shared experts, a dense layer, q_lora, YaRN)."""
    from hf_models import hf_model, save  # test-only packages: the GPU test below needs none

    return save(hf_model("v3", seed=11), tmp_path_factory.mktemp("v3_layouts"))


def load(directory, **kwargs):
    return dsv3_jax.load(directory, compute_dtype="float32", max_batch_size=4, max_seq_len=64, **kwargs)


@pytest.fixture(scope="module")
def on_four(v3):
    """on_four(layout) -> the checkpoint on 4 devices under `layout`, loaded once for the module's tests."""
    loaded = {}

    def get(layout: str) -> dsv3_jax.Model:
        if layout not in loaded:
            loaded[layout] = load(v3, num_devices=4, layout=layout)
        return loaded[layout]

    return get


def prefill_rows(model, tokens: np.ndarray) -> jax.Array:
    """The logits at the last of `tokens` (rows of equal length, cached from position 0), through
    the prefill step `generate` runs for PROMPTS (the rows right-padded to its 16-token bucket):
    one compiled program serves both."""
    rows, length = tokens.shape
    padded = np.zeros((rows, MIN_PREFILL_BUCKET), np.int32)
    padded[:, :length] = tokens
    logits, model.cache = prefill_chunk_step(model.state, model.cache, padded, np.int32(0),
                                             np.full(rows, length, np.int32), None, step=model.step,
                                             kv_len=cache_window(MIN_PREFILL_BUCKET, model.args.max_seq_len))
    return logits


def logits_of(model) -> list[np.ndarray]:
    """A prefill of 3 rows, then decode steps with the rows at positions 6, 4 and 5 (row 1 going
    back over its own positions, row 2 too)."""
    tokens = np.random.default_rng(7).integers(0, 512, size=(3, 12))
    out = [np.asarray(prefill_rows(model, tokens[:, :6]))]
    start = np.array([6, 4, 5])
    for i in range(3):
        out.append(np.asarray(model.forward(tokens[:, 6 + i: 7 + i], start + i)))
    return out


def completions_of(model) -> list[list[int]]:
    return model.generate(PROMPTS, max_new_tokens=6, eos_id=None, temperature=0.0)


@pytest.fixture(scope="module")
def one_device(v3):
    model = load(v3)
    return logits_of(model), completions_of(model)


def max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("layout", list(PRESETS))
def test_layout_equals_one_device(on_four, one_device, layout):
    """On 4 devices (2-way splits of each axis: test_two_dimensional_mesh; the same code)."""
    model = on_four(layout)
    assert model.layout.name == layout and model.mesh.devices.size == 4
    diff = max_diff(logits_of(model), one_device[0])
    print(f"{layout} on 4 devices: max |logit diff| vs 1 device = {diff:.2e}")
    assert diff <= TOL
    assert completions_of(model) == one_device[1]


def test_layouts_split_what_they_say(on_four):
    shard = lambda array: array.sharding.shard_shape(array.shape)  # noqa: E731
    dp = on_four("dp-attn")
    args = dp.args
    assert shard(dp.cache["kv"])[1] == 1  # 4 cache rows over 4 devices
    # 3 rows padded to 4: the padding row writes no cache entry
    prefill_rows(dp, np.ones((3, 6), np.int32))
    assert np.abs(np.asarray(dp.cache["kv"])).sum(axis=(0, 2, 3)).tolist()[3] == 0
    wq_b = dp.state["moe_layers"]["attn"]["wq_b"]["weight"][...]
    assert shard(wq_b) == wq_b.shape  # attention replicated
    assert shard(dp.state["head"]["weight"][...]) == (args.vocab_size, args.dim)
    experts = dp.state["moe_layers"]["ffn"]["experts"]["w1"]["weight"][...]
    assert shard(experts)[1] == args.n_routed_experts // 4
    tp = on_four("tp")
    assert shard(tp.cache["kv"]) == tp.cache["kv"].shape  # the latent cache replicated
    assert shard(tp.state["moe_layers"]["attn"]["wq_b"]["weight"][...])[1] == args.n_heads * args.qk_head_dim // 4


def test_presets_rules():
    dp = Layout.preset("dp-attn", ("model",), (2,))
    assert (dp.axes("batch"), dp.axes("heads"), dp.axes("experts"), dp.axes("vocab_out")) == (
        ("model",), (), ("model",), ())
    assert dp.reduction("experts") == (("model",), ())
    tp = Layout.preset("tp", ("data", "model"), (2, 4))
    assert (tp.axes("batch"), tp.axes("heads"), tp.axes("experts")) == (("data",), ("model",), ("data", "model"))
    assert tp.reduction("experts") == (("data",), ("model",))
    assert tp.spec("layers", "experts", "expert_ffn", "embed") == jax.sharding.PartitionSpec(
        None, ("data", "model"), None, None)
    one = Layout.preset("tp", ("model",), (1,))
    assert all(axes == () for _, axes in one.rules)  # one device: no collective
    assert dp.padded_batch(3) == 4 and list(dp.row_order(4)) == [0, 2, 1, 3]


# On the 2x2 mesh dp-attn and ep-only split only the rows and the routed experts, as dp-attn-tp and rep-attn
# split them there (test_two_dimensional_cases_cover_every_layout); their other weights are replicated, computed
# on each rank's own rows with no collective, as on 4 devices in a row (test_layout_equals_one_device).
TWO_DIMENSIONAL = ("tp", "dp-attn-tp", "rep-attn")
COVERED_BY = {"dp-attn": "dp-attn-tp", "ep-only": "rep-attn"}


def test_two_dimensional_cases_cover_every_layout():
    """Each layout left out of test_two_dimensional_mesh splits the rows and the routed experts on the 2x2 mesh
    as one it runs does (the same axes, the same reduction) and nothing else."""
    two = {name: Layout.preset(name, ("data", "model"), (2, 2)) for name in PRESETS}
    assert set(TWO_DIMENSIONAL) | set(COVERED_BY) == set(PRESETS) and set(COVERED_BY.values()) <= set(TWO_DIMENSIONAL)
    for covered, by in COVERED_BY.items():
        for axis in ("batch", "experts", "heads"):
            assert two[covered].axes(axis) == two[by].axes(axis), (covered, axis)
        assert two[covered].reduction("experts") == two[by].reduction("experts"), covered
        assert all(axes == () for axis, axes in two[covered].rules if axis not in ("batch", "experts")), covered


@pytest.mark.parametrize("layout", TWO_DIMENSIONAL)
def test_two_dimensional_mesh(v3, one_device, layout):
    """A 2x2 mesh ("data", "model") with no module edited: the data axis splits the rows."""
    model = load(v3, mesh=make_mesh(4, data=2), layout=layout)
    assert model.layout.mesh_shape == (2, 2)
    assert max_diff(logits_of(model), one_device[0]) <= TOL


def test_collectives_per_layer():
    """The lowered decode step asks for these collectives per layer (see scripts/count_collectives.py)."""
    counting = load_script("count_collectives")
    base = dsv3_jax.ModelArgs(**counting.TINY)
    expected = {  # layout: (per dense layer, per MoE layer), as {kind: count}
        "tp": ({"all-reduce": 2}, {"all-reduce": 2}),
        "dp-attn": ({}, {"all-gather": 1, "reduce-scatter": 1}),
        "dp-attn-tp": ({"all-gather": 1, "reduce-scatter": 1}, {"all-gather": 1, "reduce-scatter": 1}),
        "rep-attn": ({"all-reduce": 1}, {"all-reduce": 1}),
        "ep-only": ({}, {"all-reduce": 1}),
    }
    for layout, (dense, moe) in expected.items():
        counts = counting.per_layer_counts(base, layout, 2, 2, compiled=False)["lowered"]
        nonzero = lambda c: {k: n for k, n in c.items() if n}  # noqa: E731
        assert (nonzero(counts["dense layer"]), nonzero(counts["moe layer"])) == (dense, moe), layout


def test_bad_layouts_fail_clearly(v3):
    with pytest.raises(ValueError, match="layout must be one of"):
        load(v3, layout="fsdp")
    with pytest.raises(ValueError, match="unknown layout 'fsdp'"):
        Layout.preset("fsdp", ("model",), (2,))
    args = dsv3_jax.ModelArgs.from_file(v3 / "config.json").replace(max_batch_size=2, max_seq_len=32)
    model = zero_model(args, num_devices=2, layout="dp-attn", mtp=True, compute_dtype="float32")
    with pytest.raises(ValueError, match="MTP speculative decoding needs a layout that does not split the batch"):
        model.generate([[1, 2]], 2, eos_id=None, mtp=True)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(PRESETS))
def test_two_gpus_complete_like_one(layout):
    """On 2 GPUs every layout's greedy completions equal 1 GPU's (the tiny checkpoint, float32)."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    from dsv3_jax.cli.chat import ASSETS

    def complete(devices, layout):
        model = dsv3_jax.load(ASSETS / "tiny", compute_dtype="float32", num_devices=devices, layout=layout,
                              max_batch_size=3, max_seq_len=128)
        return model.generate(PROMPTS, max_new_tokens=24, eos_id=None, temperature=0.0)

    assert complete(2, layout) == complete(1, "tp")
