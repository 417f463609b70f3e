"""scripts/bench_model.py's decode benchmark on the tiny checkpoint: its prefill keeps to the model's
prefill chunk (a large batch's whole prompt in one step would ask batch x context tokens' working set)."""
from pathlib import Path

import numpy as np

import dsv3_jax
from script_modules import load_script

TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"


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
