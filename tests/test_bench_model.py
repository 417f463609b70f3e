"""scripts/bench_model.py's decode benchmark on the tiny checkpoint: its prefill keeps to the model's
prefill chunk (a large batch's whole prompt in one step would ask batch x context tokens' working set), and a
decode row is on disk before `generate()` is timed (a run cut short keeps it) or without it (`--no-generate`)."""
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import dsv3_jax
from script_modules import load_script

TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"
VARIANT = dict(moe_impl="auto", decode_attn="auto", layout="tp")


def test_decode_benchmark_prefills_in_chunks_and_decodes_from_the_prompt():
    bench_model = load_script("bench_model")
    model = dsv3_jax.load(TINY, compute_dtype="float32", max_batch_size=2, max_seq_len=256, prefill_chunk=64)
    step, shapes = model.step, []

    def spy(state, cache, tokens, *rest, **kw):
        shapes.append(np.shape(tokens))
        return step(state, cache, tokens, *rest, **kw)

    model.step = spy
    result = bench_model.bench_decode(model, batch=2, context=150, steps=2)
    prefill = [s for s in shapes if s[1] > 1]
    # 150 prompt positions in steps of 64, 64 and 22 tokens a row; then 1 + 4 + 2 one-token decode steps
    assert prefill == [(2, 64), (2, 64), (2, 22)], shapes
    assert shapes[len(prefill):] == [(2, 1)] * 7, shapes
    assert result["ms_per_step"] > 0 and result["context"] == 150
    # the cache holds the prompt's 150 positions and the 7 decoded ones, none past them
    kv = np.asarray(model.cache["kv"])
    assert np.abs(kv[:, :2, :157]).max(axis=-1).min() > 0 and not np.abs(kv[:, :2, 157:]).any()


def _bench(bench_model, model, out_dir, generate: bool):
    """What `bench_model.main` hands `bench_variant`: the tiny model, one decode batch of 2."""
    opts = bench_model.parse_args(["--config", "tiny.json", "--decode-batches", "2", "--prefill-batches", "",
                                   "--context", "40", "--steps", "2", "--out-dir", str(out_dir)]
                                  + ([] if generate else ["--no-generate"]))
    return SimpleNamespace(opts=opts, args=model.args, options=model.options, device=jax.local_devices()[0],
                           bandwidth=1e12, model=model, build_s=0.0, leader=True, say=lambda *a, **k: None, rows=[],
                           name="tiny", out=out_dir, stem="model-cpu-tiny")


def test_decode_row_is_saved_before_generate_and_generate_can_be_left_out(tmp_path, monkeypatch):
    bench_model = load_script("bench_model")
    model = dsv3_jax.load(TINY, compute_dtype="float32", max_batch_size=2, max_seq_len=64)
    record = tmp_path / "model-cpu-tiny.json"

    def cut_off(*args, **kwargs):  # a time limit that ends the run while generate() is timed
        raise TimeoutError("cut off")

    monkeypatch.setattr(bench_model, "bench_generate", cut_off)
    with pytest.raises(TimeoutError):
        bench_model.bench_variant(_bench(bench_model, model, tmp_path, generate=True), model, "t", **VARIANT)
    (row,) = json.loads(record.read_text())["rows"]
    assert row["kind"] == "decode" and row["batch"] == 2 and row["ms_per_step"] > 0
    assert "generate_ms_per_token" not in row

    bench = _bench(bench_model, model, tmp_path, generate=False)
    bench_model.bench_variant(bench, model, "t", **VARIANT)  # cut_off is never called
    bench_model.save(bench, final=True)
    (row,) = json.loads(record.read_text())["rows"]
    assert row["ms_per_step"] > 0 and "generate_ms_per_token" not in row
    table_row = (tmp_path / "model-cpu-tiny.md").read_text().splitlines()[-1]
    assert table_row.startswith("| decode b=2 (auto") and table_row.split("|")[-3].strip() == "-"
