"""Loading checkpoints: files split with and without an index, bf16 storage, and every bad-input error."""
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # a test-only package

import jax

import dsv3_jax
from dsv3_jax.checkpoint.safetensors import SafetensorsFile, save_file
from dsv3_jax.errors import CheckpointError
from hf_models import LOADED, PREFILL, hf_model, save

# a prefill of the shape tests/test_model.py runs on a model of this config and cache shape
# (hf_models.LOADED): the session's compilation cache serves its compiled step
TOKENS = np.random.default_rng(7).integers(0, 512, size=(LOADED["max_batch_size"], PREFILL))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = hf_model("v3", seed=7)
    return model, save(model, tmp_path_factory.mktemp("tiny"))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(directory, edit):
    """Apply edit(dict of numpy tensors) to the single safetensors file of a checkpoint copy."""
    path = directory / "model.safetensors"
    file = SafetensorsFile(path)
    tensors = {name: np.array(file.tensor(name)) for name in file.keys()}
    del file
    edit(tensors)
    save_file(tensors, path)


def _logits(directory, **kwargs):
    model = dsv3_jax.load(directory, compute_dtype="float32", **LOADED, **kwargs)
    return np.asarray(model.forward(TOKENS, 0))


def test_sharded_with_and_without_index_and_bf16(tiny, tmp_path):
    hf, directory = tiny
    reference = _logits(directory)
    split = save(hf, tmp_path / "split", max_shard_size="100KB")
    assert len(list(split.glob("*.safetensors"))) > 2 and (split / "model.safetensors.index.json").exists()
    np.testing.assert_allclose(_logits(split), reference, atol=1e-6)
    (split / "model.safetensors.index.json").unlink()
    np.testing.assert_allclose(_logits(split), reference, atol=1e-6)
    bf16 = save(hf.to(torch.bfloat16), tmp_path / "bf16")
    hf.to(torch.float32)
    stored = SafetensorsFile(bf16 / "model.safetensors")
    assert stored.dtype("model.embed_tokens.weight") == np.dtype(ml_dtypes.bfloat16)
    assert np.linalg.norm(_logits(bf16) - reference) / np.linalg.norm(reference) < 0.05


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"), "missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}), "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    (lambda t: t.update({"model.layers.2.self_attn.kv_b_proj.weight": np.zeros((4, 4), np.float32)}), "tensor 'model.layers.2.self_attn.kv_b_proj.weight' has shape (4, 4)"),
])
def test_bad_tensors_are_named(tiny, tmp_path, edit, message):
    directory = _copy(tiny[1], tmp_path / "bad")
    _rewrite(directory, edit)
    with pytest.raises(CheckpointError) as err:
        _logits(directory)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_mtp_layers_are_ignored(tiny, tmp_path):
    directory = _copy(tiny[1], tmp_path / "mtp")
    reference = _logits(tiny[1])
    _rewrite(directory, lambda t: t.update({"model.layers.4.eh_proj.weight": np.ones((64, 128), np.float32)}))
    np.testing.assert_allclose(_logits(directory), reference, atol=0)


def test_truncated_and_corrupt_files(tiny, tmp_path):
    directory = _copy(tiny[1], tmp_path / "truncated")
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        _logits(directory)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="corrupt"):
        _logits(directory)


def test_missing_config_and_directory(tiny, tmp_path):
    directory = _copy(tiny[1], tmp_path / "noconfig")
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        _logits(directory)
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        dsv3_jax.load(tmp_path / "absent")


def test_config_contradicting_checkpoint(tiny, tmp_path):
    directory = _copy(tiny[1], tmp_path / "contradiction")
    config = json.loads((directory / "config.json").read_text())
    config["moe_intermediate_size"] = 48
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"shape \(32, 64\), the config implies \(48, 64\)"):
        _logits(directory)


def test_indivisible_mesh_and_bad_options(tiny):
    directory = tiny[1]
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by the 3 devices"):
        dsv3_jax.load(directory, num_devices=3)
    with pytest.raises(ValueError, match="num_devices=9 but 4 devices"):
        dsv3_jax.load(directory, num_devices=9)
    for option, value in (("dtype", "float8"), ("compute_dtype", "fp8"), ("unroll", "yes"), ("attn_impl", "flash"),
                          ("gemm_impl", "int8"), ("moe_impl", "loop"), ("decode_attn", "flash")):
        with pytest.raises(ValueError, match=option):
            dsv3_jax.load(directory, **{option: value})
    with pytest.raises(TypeError, match="unknown run option 'max_seq'"):
        dsv3_jax.load(directory, max_seq=16)


def test_forward_input_errors(tiny):
    model = dsv3_jax.load(tiny[1], compute_dtype="float32", max_batch_size=2, max_seq_len=16)
    cases = [
        (np.zeros((3, 2), int), 0, "batch 3 exceeds max_batch_size=2"),
        (np.zeros((1, 10), int), 8, "positions up to 18 exceed max_seq_len=16"),
        (np.full((1, 2), 512), 0, r"token ids must lie in \[0, 512\)"),
        (np.zeros(4, int), 0, "2-D integer array"),
        (np.zeros((1, 2)), 0, "2-D integer array"),
        (np.zeros((1, 2), int), -1, "start_pos must not be negative"),
        (np.zeros((2, 2), int), [0, 1, 2], "start_pos has 3 entries for a batch of 2 rows"),
    ]
    for tokens, start, message in cases:
        with pytest.raises(ValueError, match=message):
            model.forward(tokens, start)
    for start in (2.7, [0.0, 1.0], "2", [[0, 1]]):
        with pytest.raises(TypeError, match="start_pos must be an int or a list of one int per row"):
            model.forward(np.zeros((2, 2), int), start)


def test_progress_bar_counts_bytes_and_tensors(tiny, capsys):
    """progress=True draws a bar on stderr; the default (None) draws none when stderr is no terminal."""
    dsv3_jax.load(tiny[1], max_batch_size=1, max_seq_len=16)
    assert capsys.readouterr().err == ""
    model = dsv3_jax.load(tiny[1], max_batch_size=1, max_seq_len=16, progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    count = len(jax.tree_util.tree_leaves(model.state))
    assert bar.startswith("loading: 100%") and f"{count}/{count} tensors" in bar and "B/" in bar, bar


def test_explicit_mesh(tiny):
    """load(mesh=...) uses the caller's mesh (here the last two devices) and gives the 1-device logits."""
    from dsv3_jax.sharding import make_mesh
    import jax

    mesh = make_mesh(devices=jax.devices()[2:4])
    model = dsv3_jax.load(tiny[1], compute_dtype="float32", mesh=mesh, **LOADED)
    assert model.mesh is mesh and {d.id for d in model.state["head"]["weight"][...].sharding.device_set} == {
        d.id for d in jax.devices()[2:4]}
    np.testing.assert_allclose(np.asarray(model.forward(TOKENS, 0)), _logits(tiny[1]), atol=2e-5)


def test_auto_num_devices_takes_the_most_the_dimensions_divide_into(configs_dir):
    """On the tests' 4 host devices: the tiny model (heads, experts and widths all even) takes all 4;
    the demo's 6 heads take 2 (3 does not divide its 8,192-token vocabulary), and the reason names the
    heads; a bad count is one line naming the argument."""
    from dsv3_jax.api import auto_num_devices

    assets = configs_dir.parent / "dsv3_jax" / "assets"
    options = dsv3_jax.RunOptions()
    tiny = dsv3_jax.ModelArgs.from_file(assets / "tiny" / "config.json")
    demo = dsv3_jax.ModelArgs.from_file(assets / "demo" / "config.json")
    assert auto_num_devices(tiny, options) == (4, None)
    count, reason = auto_num_devices(demo, options)
    assert count == 2 and reason.startswith("n_heads=6 is not divisible by the 4 devices")
    assert auto_num_devices(demo, dsv3_jax.RunOptions.make(layout="rep-attn"))[0] == 4
    model = dsv3_jax.load(assets / "demo", num_devices="auto", max_batch_size=1, max_seq_len=64)
    assert model.mesh.devices.size == 2
    for bad in (0, "all", 2.0):
        with pytest.raises(ValueError, match="num_devices must be a positive int or 'auto'"):
            dsv3_jax.load(assets / "tiny", num_devices=bad)
