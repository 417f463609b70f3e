"""The demo-model trainer on a tiny slice, on the CPU: the loss falls, the checkpoint it writes is an
HF-layout checkpoint with the MTP module at layer num_hidden_layers, and it loads with dsv3_jax.load
(and dsv3_jax.checkpoint.mtp.load_mtp) to give the same held-out losses as the trained parameters;
the evaluation's position buckets (scripts/eval_demo.py) against a window-by-window computation.
The corpus: this interpreter's standard library, capped (scripts/make_demo_data.py)."""
import json
import math

import numpy as np
import pytest
from script_modules import load_script


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    make_demo_data = load_script("make_demo_data")
    out = tmp_path_factory.mktemp("corpus")
    make_demo_data.make_data(make_demo_data.parse_args(
        ["--out", str(out), "--packages", "", "--stdlib-cap-mb", "1.5", "--vocab-size", "1024", "--workers", "1",
         "--eval-mb", "0.02", "--bpe-sample-mb", "1"]))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    train_demo = load_script("train_demo")

    out = tmp_path_factory.mktemp("demo") / "ckpt"
    opts = train_demo.parse_args(["--out", str(out), "--data", str(corpus), "--preset", "tiny", "--steps", "8",
                                  "--batch", "4", "--seq", "32",
                                  "--eval-every", "4", "--eval-tokens", "256", "--eval-batch", "4",
                                  "--train-tokens", "50000", "--warmup", "2", "--lr", "5e-3", "--mtp-copies"])
    return out, train_demo.train(opts)


def test_loss_falls_and_checkpoint_reloads(trained):
    out, log = trained
    first, last = log["evals"][0], log["evals"][-1]
    assert last["train_loss"] < first["train_loss"] and last["heldout_loss"] < first["heldout_loss"]
    check = log["reload_check"]
    assert abs(check["reloaded_loss"] - check["trained_loss"]) < 1e-4
    assert abs(check["reloaded_mtp_loss"] - check["trained_mtp_loss"]) < 1e-4
    assert 0.0 <= last["mtp_acceptance"] <= 1.0


def test_checkpoint_layout(trained):
    from dsv3_jax.checkpoint.safetensors import TensorIndex

    out, log = trained
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    layer = config["num_hidden_layers"]
    names = set(TensorIndex(out).names())
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_a_proj.weight",
                   "mlp.gate.e_score_correction_bias", "mlp.experts.0.gate_proj.weight",
                   "mlp.shared_experts.down_proj.weight", "input_layernorm.weight"):
        assert f"model.layers.{layer}.{suffix}" in names, suffix
    for name in ("tokenizer.json", "tokenizer_config.json", "train_log.json", "train_log.md"):
        assert (out / name).is_file()
    assert log["checkpoint_bytes"] < 40e6
    assert config["max_position_embeddings"] == 32  # the trained length


def test_reloaded_logits_match_the_serving_path(trained):
    """The cache-free full-sequence pass and the cached serving step agree on the loaded checkpoint."""
    import dsv3_jax
    from dsv3_jax import training

    out, _ = trained
    model = dsv3_jax.load(out, compute_dtype="float32", max_seq_len=32, max_batch_size=2)
    tokens = np.random.default_rng(0).integers(0, model.args.vocab_size, (2, 17)).astype(np.int32)
    nll = np.asarray(training.sequence_nll(model, tokens)["nll"])
    logits = np.asarray(model.forward(tokens[:, :-1]))  # last position's logits, through the cache
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -logp[np.arange(2), tokens[:, -1]]
    np.testing.assert_allclose(nll[:, -1], expected, rtol=1e-4, atol=1e-4)


def test_sharded_write_reads_back(trained, tmp_path):
    """Checkpoints over the file limit go to the hub's sharded layout (files + index), read as one."""
    from dsv3_jax.checkpoint.safetensors import TensorIndex
    from dsv3_jax.training import write_checkpoint

    out, _ = trained
    source = TensorIndex(out)
    tensors = {name: np.asarray(source.tensor(name)) for name in source.names()}
    config = json.loads((out / "config.json").read_text())
    sharded = write_checkpoint(tmp_path / "sharded", config, tensors, out, max_file_bytes=2**17)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    index = TensorIndex(sharded)
    assert set(index.names()) == set(tensors)
    for name in list(tensors)[::7]:
        np.testing.assert_array_equal(np.asarray(index.tensor(name)), tensors[name])


def test_position_buckets_match_a_window_by_window_computation(trained, corpus):
    """eval_demo's batched, padded windows give the per-bucket losses, token count and bits per byte of
    scoring each window of the stream on its own and bucketing its tokens by position in Python.

    eval_demo scores three batches, the last one short (padded with copies of its first window, scored
    with weight 0); the window-by-window side cuts the windows from the stream itself, unpadded (the
    full ones as the rows of one call, whose rows do not interact, the shorter last one alone)."""
    import dsv3_jax
    from dsv3_jax import training
    from dsv3_jax.tokenizer import Tokenizer

    eval_demo = load_script("eval_demo")
    out, _ = trained
    seq, buckets = 32, ((0, 8), (8, 16), (16, 32))
    texts = eval_demo.read_eval_texts(corpus)["stdlib"][:3]
    tokenizer = Tokenizer.from_dir(out)
    model = dsv3_jax.load(out, compute_dtype="float32", max_seq_len=seq, max_batch_size=4)
    stream = eval_demo.domain_stream(tokenizer, texts)
    windows, mask = eval_demo.stream_windows(stream, seq, tokenizer.eos_id)
    batch = len(windows) // 3 + 1  # three batches, the third short
    assert len(windows) > 2 * batch
    scores = eval_demo.score_windows(model, None, windows, mask, batch=batch)
    table = eval_demo.bucket_table(scores["nll_sum"], scores["count"], buckets)

    starts = range(0, len(stream) - 1, seq)
    full = [start for start in starts if start + seq + 1 <= len(stream)]
    nll = list(np.asarray(training.sequence_nll(model, np.stack([stream[s:s + seq + 1] for s in full]))["nll"]))
    if len(full) < len(starts):
        nll.append(np.asarray(training.sequence_nll(model, stream[starts[-1]:][None])["nll"])[0])
    by_bucket = {b: [] for b in buckets}
    for window_nll in nll:
        for position, value in enumerate(window_nll):
            by_bucket[next(b for b in buckets if b[0] <= position < b[1])].append(float(value))
    assert sum(len(v) for v in by_bucket.values()) == len(stream) - 1 == int(scores["count"].sum())
    for (lo, hi), values in by_bucket.items():
        entry = table[f"{lo}-{hi}"]
        assert entry["tokens"] == len(values)
        assert entry["loss"] == pytest.approx(float(np.mean(values)), rel=1e-4)
    summary = eval_demo.summarize(scores, sum(len(t.encode()) for t in texts))
    total = sum(sum(v) for v in by_bucket.values())
    assert summary["bits_per_byte"] == pytest.approx(total / math.log(2) / summary["bytes"], rel=1e-4)


def test_generation_stops_at_the_trained_positions(trained):
    """A checkpoint trained at 32 positions (max_position_embeddings, no rope scaling): load's default
    window is 32; a larger max_seq_len is cut to 32 with a PositionLimitWarning; generate then stops at
    position 32 with a MaxSeqLenWarning, as does dsv3-chat, with its note. Both complete the same
    prompt (the chat's tokens), so the chat's prefill is the program already compiled here."""
    import subprocess
    import sys
    import warnings

    import dsv3_jax
    from dsv3_jax.config import trained_positions
    from dsv3_jax.tokenizer import Tokenizer

    out, _ = trained
    text = "def f(x):"
    assert trained_positions(out / "config.json") == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error", dsv3_jax.PositionLimitWarning)
        assert dsv3_jax.load(out, max_batch_size=1).args.max_seq_len == 32
    with pytest.warns(dsv3_jax.PositionLimitWarning, match="exceeds the 32 positions"):
        model = dsv3_jax.load(out, max_batch_size=1, max_seq_len=4096)
    assert model.args.max_seq_len == 32
    prompt = Tokenizer.from_dir(out).encode(text)  # as dsv3-chat --complete encodes it
    assert 0 < len(prompt) < 32
    with pytest.warns(dsv3_jax.MaxSeqLenWarning, match="stopped at max_seq_len=32"):
        completion = model.generate([prompt], 40, None, temperature=0.0)[0]
    assert len(prompt) + len(completion) == 32
    result = subprocess.run([sys.executable, "-m", "dsv3_jax.chat", "--ckpt-path", str(out), "--complete",
                             "--max-new-tokens", "400", "--temperature", "0", "--max-seq-len", "4096",
                             "--num-devices", "1", "--prompt", text], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "exceeds the 32 positions" in result.stderr
    assert "at --max-seq-len=32" in result.stderr


def test_trained_positions_only_without_rope_scaling(tmp_path):
    from dsv3_jax.config import trained_positions

    base = {"hidden_size": 64, "max_position_embeddings": 512}
    cases = [(base, 512), ({**base, "rope_scaling": None}, 512),
             ({**base, "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 128}}, None),
             ({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 512),
             ({"dim": 64, "max_seq_len": 512}, None)]  # the reference's JSON
    for i, (config, expected) in enumerate(cases):
        path = tmp_path / f"c{i}.json"
        path.write_text(json.dumps(config))
        assert trained_positions(path) == expected, config
