"""Checkpoint tools (convert/): HF -> reference per-rank layout, HF -> orbax, fp8 -> bf16.

Sources are tiny random HF DeepSeek-V3/V2 checkpoints written by transformers (bf16, several files
with an index) or quantised here to the hub's block-wise fp8 layout, each with a fake
multi-token-prediction layer appended. Oracles: logits of `dsv3_jax.load` on the HF directory
itself at the same device count (bitwise), the source tensors sliced with numpy, and float64
dequantisation rounded to bf16 by hand.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # a test-only package
from safetensors import safe_open

import dsv3_jax
from dsv3_jax.checkpoint.load import ReferenceLayoutIndex
from dsv3_jax.checkpoint.safetensors import SafetensorsFile, TensorIndex, save_file
from chat_calls import python_each
from fp8_checkpoints import quantize_block_wise
from hf_models import LOADED, hf_model, save
from kernel_checks import kernel_twins
from model_checks import assert_same_model

BLOCK = 128
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
TOKENS = np.array([[5, 17, 300, 2, 9, 44, 101], [7, 7, 1, 400, 33, 8, 250]])
# Dimensions that split into whole 128-blocks over 2 ranks (fp8 needs them; the fp8 MoE needs 128-multiples)
FP8_DIMS = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, n_shared_experts=2,
                qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, kv_lora_rank=128, q_lora_rank=128,
                num_experts_per_tok=2, num_hidden_layers=3)
LINEAR = re.compile(r"_proj(_with_mqa)?\.weight$")


# ------------------------------------------------------------------ building sources
def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16 with one round-to-nearest-even of the 8-bit significand (no float32 detour)."""
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.round(mantissa * 256.0) / 256.0, exponent).astype(BF16)


def dequantize64(quantized: np.ndarray, scales: np.ndarray) -> np.ndarray:
    full = np.repeat(np.repeat(scales.astype(np.float64), BLOCK, 0), BLOCK, 1)
    return round_to_bf16(quantized.astype(np.float64) * full[: quantized.shape[0], : quantized.shape[1]])


def write_sharded(tensors: dict[str, np.ndarray], directory: Path, files: int) -> None:
    """Several files with an index; every `_scale_inv` lands in the file after its weight's."""
    weights = sorted(n for n in tensors if not n.endswith("_scale_inv"))
    placed = {name: i * files // len(weights) for i, name in enumerate(weights)}
    for name in tensors:
        if name.endswith("_scale_inv"):
            placed[name] = (placed[name[: -len("_scale_inv")]] + 1) % files
    weight_map = {}
    for part in range(files):
        filename = f"model-{part + 1:05d}-of-{files:05d}.safetensors"
        chunk = {n: tensors[n] for n in sorted(tensors) if placed[n] == part}
        save_file(chunk, directory / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, filename))
    total = sum(t.nbytes for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def mtp_tensors(tensors: dict[str, np.ndarray], n_layers: int, fp8: bool = False) -> dict[str, np.ndarray]:
    """A multi-token-prediction layer `model.layers.{n_layers}`: a copy of the last layer plus its own parts
    (eh_proj fp8 + scale in an fp8 checkpoint, as in V3's)."""
    last = f"model.layers.{n_layers - 1}."
    mtp = {name.replace(last, f"model.layers.{n_layers}."): array.copy()
           for name, array in tensors.items() if name.startswith(last)}
    embed = tensors["model.embed_tokens.weight"]
    dim = embed.shape[1]
    prefix = f"model.layers.{n_layers}."
    mtp[prefix + "embed_tokens.weight"] = embed.copy()
    mtp[prefix + "enorm.weight"] = np.ones(dim, embed.dtype)
    mtp[prefix + "hnorm.weight"] = np.ones(dim, embed.dtype)
    mtp[prefix + "eh_proj.weight"] = np.full((dim, 2 * dim), 0.01, embed.dtype)
    if fp8:
        mtp[prefix + "eh_proj.weight"], mtp[prefix + "eh_proj.weight_scale_inv"] = quantize_block_wise(
            np.full((dim, 2 * dim), 0.01, np.float32))
    mtp[prefix + "shared_head.norm.weight"] = np.ones(dim, embed.dtype)
    mtp[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    return mtp


def write_tokenizer(directory: Path) -> None:
    (directory / "tokenizer.json").write_text('{"model": "tiny"}')
    (directory / "tokenizer_config.json").write_text('{"tokenizer_class": "tiny"}')


def make_source(directory: Path, family: str, *, fp8: bool, files: int = 4, **overrides) -> Path:
    """A tiny HF checkpoint (bf16, or fp8 weights + float32 block scales) with an MTP layer, in several files."""
    model = hf_model(family, seed=3, **overrides)
    with torch.no_grad():
        for p in model.parameters():  # bf16 values, so bf16 storage and float32 compute agree exactly
            p.copy_(p.to(torch.bfloat16).float())
    save(model, directory)
    index = TensorIndex(directory)
    tensors = {}
    for name in index.names():
        array = np.asarray(index.tensor(name), np.float32)
        if fp8 and LINEAR.search(name):
            tensors[name], tensors[name + "_scale_inv"] = quantize_block_wise(array)
        else:
            tensors[name] = array.astype(BF16)
    config = json.loads((directory / "config.json").read_text())
    tensors.update(mtp_tensors(tensors, config["num_hidden_layers"], fp8))
    for stale in directory.glob("model*.safetensors*"):
        stale.unlink()
    write_sharded(tensors, directory, files)
    config["num_nextn_predict_layers"] = 1
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [BLOCK, BLOCK]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory)
    return directory


def reference_json(source: Path, destination: Path) -> Path:
    """The model's config as a reference-style JSON (reference keys plus the port's extra fields)."""
    args = dsv3_jax.ModelArgs.from_file(source / "config.json")
    destination.write_text(json.dumps(dataclasses.asdict(args)))
    return destination


def tool(name: str, *argv, module: bool = False) -> tuple[tuple, str]:
    """A tool's command line as `python convert/<name>.py` (the reference's way) or
    `python -m dsv3_jax.convert.<name>`, for `command_lines`."""
    return ((("-m", f"dsv3_jax.convert.{name}") if module else (f"convert/{name}.py",)) + argv), ""


def run_main(name: str, *argv) -> None:
    import importlib

    module = importlib.import_module(f"dsv3_jax.convert.{name}")
    module.main([str(a) for a in argv])


def logits(path, n: int, **kwargs) -> np.ndarray:
    """The loaded checkpoint's logits of TOKENS. The fp8 models' kernels run as their jnp twins
    (the subject here is what the tools write, and both sides of each comparison compute alike).
    Loaded as tests/test_model.py loads V3_TINY and V2_TINY (hf_models.LOADED), whose compiled steps
    for a prefill of TOKENS' shape the session's compilation cache then serves."""
    with kernel_twins():
        model = dsv3_jax.load(path, compute_dtype="float32", num_devices=n, **LOADED, **kwargs)
        return np.asarray(model.forward(TOKENS))


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.endswith(".partial")]


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("hf_bf16"), "v3", fp8=False)


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("hf_fp8"), "v3", fp8=True, files=3, **FP8_DIMS)


@pytest.fixture(scope="module")
def hf_logits(bf16_source) -> dict[int, np.ndarray]:
    return {n: logits(bf16_source, n) for n in (1, 2, 4)}


@pytest.fixture(scope="module")
def fp8_logits(fp8_source) -> np.ndarray:
    """The fp8 source's logits on 2 devices, loaded from its HF files."""
    return logits(fp8_source, 2)


@pytest.fixture(scope="module")
def reference_mp2(bf16_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "mp2"
    run_main("convert", "--hf-ckpt-path", bf16_source, "--save-path", out, "--n-experts", 8, "--model-parallel", 2)
    return out


@pytest.fixture(scope="module")
def command_lines(bf16_source, fp8_source, tmp_path_factory) -> dict[str, tuple]:
    """The tools run from the command line: per test, its paths and what each of its runs gave. All
    in one process (chat_calls.python_each: one start for all, each run as Python runs the command)."""
    root = tmp_path_factory.mktemp("command_lines")
    v2 = make_source(root / "v2", "v2", fp8=False, files=2)
    truncated = corrupt(bf16_source, root / "truncated", truncate)
    (root / "failure").mkdir()
    runs = {  # test -> its paths and command lines
        "cast": (root / "cast", [tool("fp8_cast_bf16", "--input-fp8-hf-path", fp8_source,
                                      "--output-bf16-hf-path", root / "cast")]),
        "v2": ((v2, root / "v2_mp4", root / "v2_orbax"), [
            tool("convert", "--hf-ckpt-path", v2, "--save-path", root / "v2_mp4", "--n-experts", 8,
                 "--model-parallel", 4),
            tool("to_orbax", "--hf-ckpt-path", v2, "--save-path", root / "v2_orbax", module=True)]),
        "failure": (root / "failure" / "out", [tool("convert", "--hf-ckpt-path", truncated, "--save-path",
                                                    root / "failure" / "out", "--n-experts", 8, "--model-parallel", 2)]),
    }
    results = iter(python_each(*(call for _, calls in runs.values() for call in calls)))
    return {name: (paths, *[next(results) for _ in calls]) for name, (paths, calls) in runs.items()}


# ------------------------------------------------------------------ convert.py: the reference layout
def test_reference_layout_names_ranges_and_splits(bf16_source, reference_mp2):
    """Each rank file holds exactly the reference's names, experts and slices (read back with `safetensors`)."""
    source = TensorIndex(bf16_source)
    assert sorted(p.name for p in reference_mp2.iterdir()) == [
        "model0-mp2.safetensors", "model1-mp2.safetensors", "tokenizer.json", "tokenizer_config.json"]
    hf = lambda name: np.asarray(source.tensor(name)).astype(np.float32)  # noqa: E731
    for rank in range(2):
        with safe_open(reference_mp2 / f"model{rank}-mp2.safetensors", "pt") as f:
            got = {k: f.get_tensor(k).float().numpy() for k in f.keys()}
        experts = {int(m.group(1)) for k in got if (m := re.match(r"layers\.\d+\.ffn\.experts\.(\d+)\.", k))}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        assert not any(k.startswith("layers.4.") for k in got)  # the MTP layer is skipped
        rows = slice(256 * rank, 256 * (rank + 1))
        np.testing.assert_array_equal(got["embed.weight"], hf("model.embed_tokens.weight")[rows])
        np.testing.assert_array_equal(got["head.weight"], hf("lm_head.weight")[rows])
        heads = slice(48 * rank, 48 * (rank + 1))  # 4 heads x 24 (q) over 2 ranks
        np.testing.assert_array_equal(got["layers.1.attn.wq_b.weight"],
                                      hf("model.layers.1.self_attn.q_b_proj.weight")[heads])
        np.testing.assert_array_equal(got["layers.2.attn.wo.weight"],
                                      hf("model.layers.2.self_attn.o_proj.weight")[:, 32 * rank: 32 * (rank + 1)])
        np.testing.assert_array_equal(got["layers.0.ffn.w2.weight"],
                                      hf("model.layers.0.mlp.down_proj.weight")[:, 48 * rank: 48 * (rank + 1)])
        np.testing.assert_array_equal(got["layers.3.ffn.shared_experts.w1.weight"],
                                      hf("model.layers.3.mlp.shared_experts.gate_proj.weight")[16 * rank:][:16])
        np.testing.assert_array_equal(got["layers.3.ffn.gate.bias"],
                                      hf("model.layers.3.mlp.gate.e_score_correction_bias"))
        np.testing.assert_array_equal(got["layers.1.attn.wkv_a.weight"],
                                      hf("model.layers.1.self_attn.kv_a_proj_with_mqa.weight"))
        e = 4 * rank + 1
        np.testing.assert_array_equal(got[f"layers.2.ffn.experts.{e}.w3.weight"],
                                      hf(f"model.layers.2.mlp.experts.{e}.up_proj.weight"))
        # every model tensor of the source, once per rank (experts: their owner only)
        expected = {n for n in source.names() if not n.startswith("model.layers.4.")}
        assert len(got) == len(expected) - 4 * 3 * 3  # 3 MoE layers x 4 foreign experts x w1/w2/w3


@pytest.mark.parametrize("n", [1, 2, 4])
def test_reference_layout_loads_like_hf(bf16_source, reference_mp2, hf_logits, tmp_path, n):
    config = reference_json(bf16_source, tmp_path / "config_tiny.json")
    np.testing.assert_array_equal(logits(reference_mp2, n, config=str(config)), hf_logits[n])


@pytest.mark.parametrize("layout", ["dp-attn", "rep-attn", "ep-only"])
def test_reference_layout_loads_for_every_layout(bf16_source, reference_mp2, hf_logits, tmp_path, layout):
    """Per-rank files cut for the "tp" split load into any layout (each device reading its window)."""
    config = reference_json(bf16_source, tmp_path / "config_tiny.json")
    for n in (2, 4):
        np.testing.assert_allclose(logits(reference_mp2, n, config=str(config), layout=layout), hf_logits[1],
                                   rtol=0, atol=2e-5)


def test_reference_layout_each_device_reads_its_own_file(reference_mp2, monkeypatch):
    """On a mesh of MP devices, the window of device r's shard touches only model{r}-mp{MP}.safetensors."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    index = ReferenceLayoutIndex(reference_mp2, n_routed_experts=8)
    touched = []
    original = SafetensorsFile.tensor
    monkeypatch.setattr(SafetensorsFile, "tensor",
                        lambda self, name: touched.append(self.path.name) or original(self, name))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("mp",))
    for name, spec in (("embed.weight", P("mp", None)), ("layers.2.attn.wo.weight", P(None, "mp")),
                       ("layers.0.ffn.w1.weight", P("mp", None))):
        shape = index.shape(name)
        for device, window in NamedSharding(mesh, spec).addressable_devices_indices_map(shape).items():
            touched.clear()
            block = np.asarray(index.tensor(name)[window])
            rank = list(mesh.devices.flat).index(device)
            assert set(touched) == {f"model{rank}-mp2.safetensors"}, (name, rank, touched)
            with safe_open(reference_mp2 / f"model{rank}-mp2.safetensors", "np") as f:
                assert f.get_slice(name).get_shape() == list(block.shape)


def test_reference_layout_needs_a_config(reference_mp2):
    with pytest.raises(dsv3_jax.CheckpointError, match="pass config="):
        dsv3_jax.load(reference_mp2)


def test_reference_layout_fp8(fp8_source, fp8_logits, tmp_path):
    """fp8 weights keep their bytes; scales are cut with their weights in whole 128-blocks; loads like HF."""
    out = tmp_path / "fp8_mp2"
    run_main("convert", "--hf-ckpt-path", fp8_source, "--save-path", out, "--n-experts", 8, "--model-parallel", 2)
    source = TensorIndex(fp8_source)
    rank1 = SafetensorsFile(out / "model1-mp2.safetensors")
    weight = rank1.tensor("layers.1.attn.wq_b.weight")
    assert weight.dtype == E4M3 and weight.shape == (256, 128)
    hf_weight = source.tensor("model.layers.1.self_attn.q_b_proj.weight")
    assert np.array_equal(weight.view(np.uint8), hf_weight[256:].view(np.uint8))
    np.testing.assert_array_equal(rank1.tensor("layers.1.attn.wq_b.scale"),
                                  source.tensor("model.layers.1.self_attn.q_b_proj.weight_scale_inv")[2:])
    np.testing.assert_array_equal(rank1.tensor("layers.1.attn.wo.scale"),
                                  source.tensor("model.layers.1.self_attn.o_proj.weight_scale_inv")[:, 1:])
    assert np.array_equal(rank1.tensor("layers.2.ffn.experts.5.w2.weight").view(np.uint8),
                          source.tensor("model.layers.2.mlp.experts.5.down_proj.weight").view(np.uint8))
    config = reference_json(fp8_source, tmp_path / "config_fp8.json")
    np.testing.assert_array_equal(logits(out, 2, config=str(config)), fp8_logits)


# ------------------------------------------------------------------ to_orbax.py
@pytest.fixture(scope="module")
def orbax_bf16(bf16_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    run_main("to_orbax", "--hf-ckpt-path", bf16_source, "--save-path", out)
    return out


def test_orbax_layout_and_mtp(bf16_source, orbax_bf16):
    import orbax.checkpoint as ocp

    from dsv3_jax.checkpoint.orbax import stored_arrays

    assert sorted(p.name for p in orbax_bf16.iterdir()) == [
        "config.json", "generation_config.json", "state", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((orbax_bf16 / "config.json").read_text()) == json.loads((bf16_source / "config.json").read_text())
    stored = stored_arrays(orbax_bf16)
    assert stored[("moe_layers", "ffn", "experts", "w1", "weight")] == ((3, 8, 32, 64), BF16)
    with ocp.PyTreeCheckpointer() as checkpointer:  # one storage chunk per (layer, expert): a device reads its experts
        metadata = checkpointer.metadata(orbax_bf16 / "state").item_metadata.tree
    assert metadata["moe_layers"]["ffn"]["experts"]["w1"]["weight"].storage.chunk_shape == (1, 1, 32, 64)
    assert stored[("dense_layers", "attn", "wq_b", "weight")] == ((1, 96, 32), BF16)
    source = TensorIndex(bf16_source)
    mtp = {"model." + ".".join(p[1:]) for p in stored if p[0] == "mtp"}
    assert mtp == {n for n in source.names() if n.startswith("model.layers.4.")}
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(orbax_bf16 / "state")
    np.testing.assert_array_equal(np.asarray(restored["mtp"]["layers"]["4"]["eh_proj"]["weight"]),
                                  source.tensor("model.layers.4.eh_proj.weight"))
    np.testing.assert_array_equal(np.asarray(restored["moe_layers"]["ffn"]["experts"]["w2"]["weight"][1, 6]),
                                  source.tensor("model.layers.2.mlp.experts.6.down_proj.weight"))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_orbax_restores_like_hf(orbax_bf16, hf_logits, n):
    model = dsv3_jax.load(orbax_bf16, compute_dtype="float32", num_devices=n, **LOADED)  # as logits()
    experts = model.state["moe_layers"]["ffn"]["experts"]["w1"]["weight"].get_value()
    assert {s.data.shape for s in experts.addressable_shards} == {(3, 8 // n, 32, 64)}
    np.testing.assert_array_equal(np.asarray(model.forward(TOKENS)), hf_logits[n])


def test_orbax_restores_into_a_batch_split_layout(orbax_bf16, hf_logits):
    model = dsv3_jax.load(orbax_bf16, compute_dtype="float32", num_devices=4, layout="dp-attn", **LOADED)
    np.testing.assert_allclose(np.asarray(model.forward(TOKENS)), hf_logits[1], rtol=0, atol=2e-5)


def test_orbax_checks_the_config(orbax_bf16):
    args = dsv3_jax.ModelArgs.from_file(orbax_bf16 / "config.json")
    with pytest.raises(dsv3_jax.CheckpointError, match=r"'embed/weight' has shape \(512, 64\).*\(1024, 64\)"):
        dsv3_jax.load(orbax_bf16, config=args.replace(vocab_size=1024))
    with pytest.raises(dsv3_jax.CheckpointError, match="lacks parameter .dense_layers/attn/wkv_a/scale."):
        dsv3_jax.load(orbax_bf16, config=args.replace(dtype="fp8"))


def test_orbax_fp8(fp8_source, fp8_logits, tmp_path):
    from dsv3_jax.checkpoint.orbax import stored_arrays

    out = tmp_path / "orbax_fp8"
    run_main("to_orbax", "--hf-ckpt-path", fp8_source, "--save-path", out)
    stored = stored_arrays(out)
    assert stored[("moe_layers", "attn", "wq_b", "weight")] == ((2, 512, 128), E4M3)
    assert stored[("moe_layers", "attn", "wq_b", "scale")] == ((2, 4, 1), np.dtype(np.float32))
    assert stored[("moe_layers", "ffn", "experts", "w2", "scale")] == ((2, 8, 1, 1), np.dtype(np.float32))
    np.testing.assert_array_equal(logits(out, 2), fp8_logits)


# ------------------------------------------------------------------ fp8_cast_bf16.py
def test_cast_matches_float64_dequantisation(fp8_source, command_lines):
    out, result = command_lines["cast"]
    assert result.returncode == 0, result.stderr
    source, cast = TensorIndex(fp8_source), TensorIndex(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(cast.names()) == {n for n in source.names() if not n.endswith("_scale_inv")}
    assert index["metadata"]["total_size"] == sum(cast.tensor(n).nbytes for n in cast.names())
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in fp8_source.glob("*.safetensors"))
    checked = 0
    for name in source.names():
        if name.endswith("_scale_inv"):
            continue
        got = cast.tensor(name)
        if source.dtype(name) == E4M3:
            scale = name + "_scale_inv"
            assert source.location[scale].path != source.location[name].path  # found through the index
            want = dequantize64(source.tensor(name), source.tensor(scale))
            checked += 1
        else:
            want = source.tensor(name)
        assert got.dtype == want.dtype == BF16, name
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), name
    assert checked > 50
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()
    # the cast checkpoint is a bf16 checkpoint that loads; bf16 compute of it equals bf16 compute of the
    # fp8 source (whose weights the model dequantises with the kernel's jnp twin, as in logits())
    with kernel_twins():
        bf16_logits = np.asarray(dsv3_jax.load(out, max_seq_len=64).forward(TOKENS))
        fp8_logits = np.asarray(dsv3_jax.load(fp8_source, max_seq_len=64).forward(TOKENS))
    np.testing.assert_allclose(bf16_logits, fp8_logits, rtol=0, atol=1e-6)


def test_cast_passes_through_a_weight_without_scale(fp8_source, tmp_path, capsys):
    source = tmp_path / "no_scale"
    source.mkdir()
    missing = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    index = TensorIndex(fp8_source)
    tensors = {n: np.array(index.tensor(n)) for n in index.names() if n != missing}
    write_sharded(tensors, source, 2)
    (source / "config.json").write_text((fp8_source / "config.json").read_text())
    out = tmp_path / "out"
    run_main("fp8_cast_bf16", "--input-fp8-hf-path", source, "--output-bf16-hf-path", out)
    assert f"warning: no {missing} for fp8 tensor" in capsys.readouterr().err
    cast = TensorIndex(out)
    weight = "model.layers.1.self_attn.o_proj.weight"
    assert cast.dtype(weight) == E4M3 and np.array_equal(cast.tensor(weight).view(np.uint8),
                                                         index.tensor(weight).view(np.uint8))
    assert not any(n.endswith("_scale_inv") for n in cast.names())


# ------------------------------------------------------------------ command line and failures
def test_cli_forms_and_v2(command_lines, tmp_path):
    """Both invocation forms work; a DeepSeek-V2 checkpoint (no q-LoRA, softmax, no bias) converts and loads."""
    (source, ref, orbax), *results = command_lines["v2"]
    for result in results:
        assert result.returncode == 0, result.stderr
    want = logits(source, 4)
    config = reference_json(source, tmp_path / "v2.json")
    np.testing.assert_array_equal(logits(ref, 4, config=str(config)), want)
    np.testing.assert_array_equal(logits(orbax, 4), want)


def corrupt(source: Path, destination: Path, edit) -> Path:
    shutil.copytree(source, destination)
    edit(destination)
    return destination


def truncate(directory: Path) -> None:
    victim = sorted(directory.glob("*.safetensors"))[1]
    victim.write_bytes(victim.read_bytes()[:-100])


def drop_tensor(name: str):
    def edit(directory: Path) -> None:
        index = TensorIndex(directory)
        file = index.location[name].path
        tensors = {n: np.array(index.files[file.name].tensor(n)) for n in index.files[file.name].keys() if n != name}
        del index
        save_file(tensors, file, metadata={"format": "pt"})
        weight_map = json.loads((directory / "model.safetensors.index.json").read_text())
        del weight_map["weight_map"][name]
        (directory / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    return edit


def add_tensor(name: str, shape: tuple[int, ...]):
    def edit(directory: Path) -> None:
        save_file({name: np.zeros(shape, BF16)}, directory / "extra.safetensors")
        weight_map = json.loads((directory / "model.safetensors.index.json").read_text())
        weight_map["weight_map"][name] = "extra.safetensors"
        (directory / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    return edit


def replace_tensor(name: str, shape: tuple[int, ...]):
    def edit(directory: Path) -> None:
        drop_tensor(name)(directory)
        add_tensor(name, shape)(directory)
    return edit


FAILURES = {
    "truncated": (truncate, "truncated safetensors file"),
    "missing": (drop_tensor("model.layers.2.mlp.experts.3.up_proj.weight"), "missing tensor"),
    "unknown": (add_tensor("model.layers.1.self_attn.q_extra.weight", (4, 4)), "unexpected tensor"),
    "shape": (replace_tensor("model.layers.1.self_attn.kv_b_proj.weight", (64, 16)), "the config implies"),
    "no config": (lambda d: (d / "config.json").unlink(), "no config.json"),
}
TOOLS = {
    "convert": lambda src, out: ("convert", "--hf-ckpt-path", src, "--save-path", out, "--n-experts", 8,
                                 "--model-parallel", 2),
    "to_orbax": lambda src, out: ("to_orbax", "--hf-ckpt-path", src, "--save-path", out),
    "fp8_cast_bf16": lambda src, out: ("fp8_cast_bf16", "--input-fp8-hf-path", src, "--output-bf16-hf-path", out),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_bad_input_fails_cleanly(bf16_source, tmp_path, failure, capsys):
    """Each tool rejects the bad checkpoint with one line, exit 1, and leaves no output (nor staging) behind."""
    from dsv3_jax.convert.common import run_tool

    edit, message = FAILURES[failure]
    source = corrupt(bf16_source, tmp_path / "src", edit)
    for name, argv in TOOLS.items():
        out = tmp_path / f"out_{name}"
        module = __import__(f"dsv3_jax.convert.{name}", fromlist=["main"])
        code = run_tool(module.main, [str(a) for a in argv(source, out)[1:]])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1 and ": error: " in err[0] and message in err[0], (name, err)
        assert not out.exists() and leftovers(tmp_path) == [], name


@pytest.mark.parametrize("name", TOOLS)
def test_failure_while_writing_leaves_nothing(fp8_source, tmp_path, monkeypatch, capsys, name):
    """A read error half-way through the output (after files were started) removes the staging directory."""
    from dsv3_jax.convert.common import run_tool

    module = __import__(f"dsv3_jax.convert.{name}", fromlist=["main"])
    reads = []
    original = module.read_tensor

    def failing_read(*args, **kwargs):
        reads.append(1)
        if len(reads) == 40:
            raise OSError("injected read failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "read_tensor", failing_read)
    out = tmp_path / "out"
    assert run_tool(module.main, [str(a) for a in TOOLS[name](fp8_source, out)[1:]]) == 1
    assert "injected read failure" in capsys.readouterr().err
    assert len(reads) == 40 and not out.exists() and leftovers(tmp_path) == []


def test_failure_exit_code_from_the_command_line(command_lines):
    out, result = command_lines["failure"]
    assert result.returncode == 1 and not out.exists() and leftovers(out.parent) == []
    assert len(result.stderr.strip().splitlines()) == 1 and "truncated" in result.stderr


@pytest.mark.parametrize("mp, n_experts, message", [
    (3, 8, "n_heads=4 is not divisible by the 3 ranks"), (8, 8, "n_heads=4 is not divisible"),
    (2, 6, "contradicts the config"),
])
def test_model_parallel_must_divide(bf16_source, tmp_path, mp, n_experts, message):
    from dsv3_jax.convert.convert import convert

    with pytest.raises(ValueError, match=message):
        convert(bf16_source, tmp_path / "out", n_experts, mp)
    assert not (tmp_path / "out").exists()


def test_model_parallel_must_divide_experts_and_vocab(tmp_path):
    from dsv3_jax.convert.convert import check_model_parallel

    args = dsv3_jax.ModelArgs(n_heads=8, n_routed_experts=6, vocab_size=512, n_layers=2, n_dense_layers=1)
    with pytest.raises(ValueError, match="n_routed_experts=6 is not divisible"):
        check_model_parallel(args, 6, 4)
    with pytest.raises(ValueError, match="vocab_size=500 is not divisible"):
        check_model_parallel(args.replace(vocab_size=500, n_routed_experts=8), 8, 8)


def test_fp8_split_must_be_block_aligned(tmp_path):
    """V3_TINY's fp8 wq_b has 96 rows: two ranks would each get 48, not whole 128-blocks."""
    from dsv3_jax.convert.convert import convert

    source = make_source(tmp_path / "fp8_small", "v3", fp8=True, files=2)
    with pytest.raises(ValueError, match="whole 128-blocks"):
        convert(source, tmp_path / "out", 8, 2)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    convert(source, tmp_path / "out1", 8, 1)  # one rank: nothing to cut
    assert (tmp_path / "out1" / "model0-mp1.safetensors").is_file()


def test_existing_output_is_not_overwritten(bf16_source, tmp_path):
    from dsv3_jax.convert.convert import convert

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        convert(bf16_source, out, 8, 2)
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("source", ["bf16_source", "fp8_source"])
def test_keep_mtp_loads_like_hf(source, tmp_path, request):
    """--keep-mtp: the per-rank files carry the MTP module and load as the model loaded from HF (the same
    step parts and weights, bit for bit); with fp8 weights the two also decode speculatively alike (the
    bf16-format weights' speculative decoding: tests/test_mtp.py, on 1 and 4 devices)."""
    fp8 = source == "fp8_source"
    source = request.getfixturevalue(source)
    out = tmp_path / "mp2"
    run_main("convert", "--hf-ckpt-path", source, "--save-path", out, "--n-experts", 8, "--model-parallel", 2,
             "--keep-mtp")
    config = reference_json(source, tmp_path / "config.json")
    names = SafetensorsFile(out / "model0-mp2.safetensors").keys()
    mtp = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    assert f"layers.{mtp}.eh_proj.weight" in names
    assert not any("shared_head.head" in n or f"layers.{mtp}.embed" in n for n in names)  # the copies stay out
    prompts = [[int(t) for t in row] for row in TOKENS]
    models, outputs = [], []
    for path, extra in ((source, {}), (out, {"config": str(config)})):
        with kernel_twins():  # as in logits()
            models.append(dsv3_jax.load(path, compute_dtype="float32", num_devices=2, max_seq_len=64, mtp=True,
                                        **extra))
            if fp8:
                outputs.append(models[-1].generate(prompts, 8, eos_id=-1, temperature=0.0, mtp=True))
    assert_same_model(*models)
    if fp8:
        assert outputs[0] == outputs[1]
