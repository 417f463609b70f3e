"""Generation: the sampler against exact probabilities, greedy `generate` against Hugging Face's,
the reference's generate contract, and the compiled steps (no recompilation, no buffer growth,
the cache donated)."""
import functools
import gc
import logging
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # a test-only package

import dsv3_jax
from dsv3_jax import generate as gen
from dsv3_jax.decode.step import make_step
from hf_models import hf_model, save

TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"
SAMPLES = 40_000


@functools.partial(jax.jit, static_argnames=("top_k", "top_p"))
def sample_many(logits, temperature, top_k=0, top_p=1.0):
    """SAMPLES draws per row of `logits`, one key each (split from key 7): (SAMPLES, rows). Logits and
    temperature are arguments, so that every temperature of one filter runs one compiled program."""
    keys = jax.random.split(jax.random.key(7), SAMPLES)
    return jax.vmap(lambda k: gen.sample(logits, temperature, k, top_k=top_k, top_p=top_p))(keys)


def draw(logits: np.ndarray, temperature: float, **filters) -> np.ndarray:
    """SAMPLES draws per row, one key each: (SAMPLES, rows)."""
    return np.asarray(sample_many(logits, np.float32(temperature), **filters))


def frequencies(draws: np.ndarray, vocab: int) -> np.ndarray:
    return np.stack([np.bincount(draws[:, r], minlength=vocab) / len(draws) for r in range(draws.shape[1])])


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                   [0.1, 0.2, 0.3, 0.4, 0.5, 3.0]], np.float32)
TOL = 4.0 / np.sqrt(SAMPLES)  # ~4 standard errors of a frequency


def test_sampling_draws_from_softmax_over_temperature():
    for temperature in (1.0, 0.5):
        expected = softmax64(LOGITS / temperature)
        got = frequencies(draw(LOGITS, temperature), LOGITS.shape[1])
        assert np.abs(got - expected).max() < TOL, (temperature, got, expected)


def test_temperature_zero_is_argmax():
    assert (draw(LOGITS, 0.0)[:50] == LOGITS.argmax(-1)).all()


def test_top_k_and_top_p_renormalise_the_kept_tokens():
    probs = softmax64(LOGITS)
    keep_k = np.zeros_like(probs, bool)
    for row, order in enumerate(np.argsort(-probs, axis=-1)):
        keep_k[row, order[:2]] = True
    expected = np.where(keep_k, probs, 0)
    got = frequencies(draw(LOGITS, 1.0, top_k=2), LOGITS.shape[1])
    assert np.abs(got - expected / expected.sum(-1, keepdims=True)).max() < TOL

    top_p = 0.8  # the smallest set, most likely first, whose mass reaches 0.8
    keep_p = np.zeros_like(probs, bool)
    for row, order in enumerate(np.argsort(-probs, axis=-1)):
        mass = 0.0
        for token in order:
            keep_p[row, token] = True
            mass += probs[row, token]
            if mass >= top_p:
                break
    assert keep_p.sum(-1).tolist() == [3, 2]  # the filter really removes tokens in both rows
    expected = np.where(keep_p, probs, 0)
    got = frequencies(draw(LOGITS, 1.0, top_p=top_p), LOGITS.shape[1])
    assert np.abs(got - expected / expected.sum(-1, keepdims=True)).max() < TOL


# ------------------------------------------------------------------------------ greedy parity with HF
@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    hf = hf_model("v3", seed=3)
    directory = save(hf, tmp_path_factory.mktemp("hf_v3"))
    return hf, dsv3_jax.load(directory, compute_dtype="float32", max_batch_size=4, max_seq_len=128)


def hf_next_tokens(hf, prompt: list[int], completion: list[int]) -> list[int]:
    """HF's greedy choice after each prefix prompt + completion[:i] (i < len(completion)), from one causal
    forward over prompt + completion[:-1] (run alone: no padding). Greedy decoding takes exactly these
    argmaxes, so a completion equal to them is HF's greedy completion of the prompt (one HF forward
    instead of one per token)."""
    ids = torch.tensor([prompt + completion[:-1]])
    with torch.no_grad():
        logits = hf(ids, use_cache=False).logits[0, len(prompt) - 1:]
    return logits.argmax(-1).tolist()


def test_greedy_generate_equals_hf_greedy(hf_pair):
    hf, model = hf_pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 11, 6, 21)]
    expected = model.generate(prompts, 40, eos_id=-1, temperature=0.0)
    assert [len(e) for e in expected] == [40] * 4
    assert [hf_next_tokens(hf, p, e) for p, e in zip(prompts, expected)] == expected

    # an eos that one row emits midway: that row stops before it, the others go on. HF's greedy run with
    # that eos is its run without one up to the eos (greedy decoding does not look ahead): the greedy
    # completions cut before the eos are the oracle, without running HF again.
    eos = expected[1][9]
    cut = [e[:e.index(eos)] if eos in e else e for e in expected]
    assert len(cut[1]) <= 9 and max(len(c) for c in cut) == 40
    assert model.generate(prompts, 40, eos_id=eos, temperature=0.0) == cut


# ------------------------------------------------------------------------------ contract and steps
@pytest.fixture(scope="module")
def tiny():
    """The tiny checkpoint at max_seq_len 64. The contract tests give it three prompts in the bucket of 64
    tokens, so that they share the compiled steps (and `greedy_by_forward` the shapes of its prompts);
    only the warm-up test uses the bucket of 16, which it must compile itself."""
    return dsv3_jax.load(TINY, compute_dtype="float32", max_batch_size=3, max_seq_len=64)


def greedy_by_forward(model, prompts: list[list[int]], new_tokens: int,
                      prompt_piece: int | None = None) -> list[list[int]]:
    """Greedy continuations of equal-length prompts through `Model.forward`: the prompts, in forward calls
    of `prompt_piece` tokens (None: one call), then one token at a time (host argmax)."""
    tokens = np.array(prompts)
    piece = prompt_piece or tokens.shape[1]
    for start in range(0, tokens.shape[1], piece):
        logits = model.forward(tokens[:, start:start + piece], start_pos=start)
    out = [np.argmax(np.asarray(logits), -1)]
    for index in range(new_tokens - 1):
        logits = model.forward(out[-1][:, None], start_pos=tokens.shape[1] + index)
        out.append(np.argmax(np.asarray(logits), -1))
    return np.stack(out, 1).tolist()


def test_budgets_follow_the_reference_near_max_seq_len(tiny):
    """total_len = min(max_seq_len, max_new + longest); row i gets min(max_new, total_len - len_i)."""
    rng = np.random.default_rng(1)
    lengths, max_new = (5, 40, 64), 30  # total_len = min(64, 94) = 64 -> budgets 30, 24, 0
    prompts = [rng.integers(4, 1024, n).tolist() for n in lengths]
    with pytest.warns(dsv3_jax.MaxSeqLenWarning, match=r"prompts \[1, 2\] stopped at max_seq_len=64") as caught:
        out = tiny.generate(prompts, max_new, eos_id=-1, temperature=0.0)
    assert len(caught) == 1
    assert [len(c) for c in out] == [30, 24, 0]
    # the 5-token prompt token by token: the one-token step that decoding compiles anyway
    assert [out[0]] == greedy_by_forward(tiny, [prompts[0]], 30, prompt_piece=1)
    assert [out[1]] == greedy_by_forward(tiny, [prompts[1]], 24)


def test_bad_prompts_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="prompt 1 has 65 tokens, more than max_seq_len=64"):
        tiny.generate([[1, 2], [3] * 65], 4, eos_id=1)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        tiny.generate([[]], 4, eos_id=1)
    with pytest.raises(ValueError, match="exceed max_batch_size=3"):
        tiny.generate([[1]] * 4, 4, eos_id=1)
    with pytest.raises(ValueError, match="outside"):
        tiny.generate([[1, 5000]], 4, eos_id=1)
    with pytest.raises(ValueError, match=r"prompt_tokens must be a list of token lists .* prompt_tokens\[0\] is int"):
        tiny.generate([0, 5, 6], 4, eos_id=1)  # one prompt, not wrapped in a list
    with pytest.raises(ValueError, match="prompt_tokens must be a non-empty list of token lists"):
        tiny.generate("0 5 6", 4, eos_id=1)
    with pytest.raises(ValueError, match="prompt 0 holds values that are not integer token ids"):
        tiny.generate([[1.5, 2]], 4, eos_id=1)
    with pytest.raises(ValueError, match=r"prompt_tokens as an array must be 2-D integer \(batch, seq\)"):
        tiny.generate(np.array([1, 2, 3]), 4, eos_id=1)
    for temperature in (float("nan"), -1.0, "0.5"):
        with pytest.raises(ValueError, match="temperature must be a number >= 0"):
            tiny.generate([[1, 2]], 4, eos_id=1, temperature=temperature)


def test_a_2d_integer_array_of_prompts_is_accepted_like_forward(tiny):
    prompts = np.random.default_rng(2).integers(4, 1024, (3, 40)).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dsv3_jax.MaxSeqLenWarning)  # whole budgets: no warning
        expected = tiny.generate(prompts, 6, eos_id=-1, temperature=0.0)
        assert tiny.generate(np.array(prompts, np.int32), 6, eos_id=-1, temperature=0.0) == expected
        assert tiny.generate(jnp.asarray(prompts), 6, eos_id=-1, temperature=0.0) == expected
    assert [expected[0]] == greedy_by_forward(tiny, [prompts[0]], 6)


def test_seeded_sampling_and_streaming(tiny):
    prompts = [[0, 2, 50, 60, 70], [0, 2, 80], list(range(100, 140))]
    first = tiny.generate(prompts, 20, eos_id=-1, temperature=1.0, seed=5)
    assert tiny.generate(prompts, 20, eos_id=-1, temperature=1.0, seed=5) == first
    assert tiny.generate(prompts, 20, eos_id=-1, temperature=1.0, seed=6) != first
    seen = []
    final = tiny.generate(prompts, 20, eos_id=-1, temperature=1.0, seed=5,
                          on_tokens=lambda c: seen.append([list(row) for row in c]))
    assert final == first and len(seen) == 20
    assert all(len(row) == step + 1 for step, rows in enumerate(seen) for row in rows)
    assert seen[-1] == final


def test_warm_up_compiles_and_decoding_holds_no_growing_buffers(tiny):
    prompts = [[0, 2, 11, 12, 13], [0, 2, 14], [0, 2, 15, 16, 17, 18, 19]]
    gen.warm_up(tiny, [len(p) for p in prompts], 50)  # compiles what 50 new tokens need (window 64)
    compiled = tiny.decode_step._cache_size(), gen.prefill_chunk_step._cache_size(), gen.start_decoding._cache_size()
    cache_before = tiny.cache["kv"]
    live = []

    def count(completions):
        if len(completions[0]) % 9 == 1 and len(completions[0]) < 50:  # steps 1, 10, ..., 46 (gc is slow)
            gc.collect()
            live.append(len(jax.live_arrays()))

    out = tiny.generate([p[::-1] for p in prompts], 55, eos_id=-1, temperature=0.3, seed=9, on_tokens=count)
    assert [len(c) for c in out] == [55] * 3  # 54 decode steps in the same (batch, window)
    assert (tiny.decode_step._cache_size(), gen.prefill_chunk_step._cache_size(),
            gen.start_decoding._cache_size()) == compiled, "a step recompiled"
    assert len(live) == 6 and len(set(live)) == 1, f"live device buffers changed during decoding: {live}"
    assert cache_before.is_deleted(), "the cache was not donated to the steps"
    assert not tiny.cache["kv"].is_deleted()


# ------------------------------------------------------------------------------ chunked prefill
CHUNK = 64
# The forward test's rows: chunks of 64, 64, 52 from position 0 (windows 64, 128, 256), then from positions
# 3 and 70, which end by position 250: every step of the second start attends over the window of 256, as
# steps of the first do, whose compiled programs it reuses.
FORWARD_LEN = 180
# inside, just before, at and past chunk boundaries: bucket 512, 8 chunks. The first as long as the forward
# test's rows, so that checking its greedy completion through `forward` reuses that test's compiled steps.
UNEQUAL = (FORWARD_LEN, 63, 64, 257)
# The sampled generations' top-k (a static argument of the sampling steps). The greedy ones take it too, so
# that all of them share one compiled start_decoding and decode step: at temperature 0 the token is the
# argmax, which every top-k keeps.
TOP_K = 50


@pytest.fixture(scope="module")
def chunk_pair():
    """The tiny model with max_seq_len 512, prefilling in one step and in chunks of 64 (the same weights).
    One device: the chunks are cut on the host (`prefill_chunks`, `Model._prefill_chunks`) and merged
    outside the model's shard_map, whatever the mesh. On 4 devices prefill_chunk=64 runs end to end in
    test_mtp.py::test_greedy_output_is_identical_with_mtp_and_chunked_prefill[4dev] (the main model's and
    the MTP module's chunks, greedy and sampled, the chunk that redoes part of the one before), and cached
    multi-token steps from nonzero positions in test_prefill_attention.py::test_flash_prefill_chunks_match_hf
    [absorb-4] (against HF)."""
    whole = dsv3_jax.load(TINY, compute_dtype="float32", max_batch_size=4, max_seq_len=512)
    return whole, chunked_twin(whole)


def chunked_twin(model):
    """A model on `model`'s weights and mesh that prefills in chunks of CHUNK tokens (its own jitted step)."""
    return dsv3_jax.Model(model.args, model.graphdef, model.state, model.mesh,
                          dsv3_jax.RunOptions.make(model.options, prefill_chunk=CHUNK))


def test_chunked_forward_equals_one_step(chunk_pair):
    whole, chunked = chunk_pair
    tokens = np.random.default_rng(11).integers(0, 1024, (2, FORWARD_LEN))
    for start in (0, [3, 70]):  # rows starting at unequal positions: their chunks straddle different boundaries
        expected = np.asarray(whole.forward(tokens, start_pos=start))
        got = np.asarray(chunked.forward(tokens, start_pos=start))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        # the cache holds the same entries: the next token's logits agree too
        after = np.array([[5], [9]])
        end = np.asarray(start) + FORWARD_LEN
        np.testing.assert_allclose(np.asarray(chunked.forward(after, start_pos=end)),
                                   np.asarray(whole.forward(after, start_pos=end)), rtol=1e-5,
                                   atol=1e-5 * np.abs(expected).max())


def test_chunked_generate_equals_one_step_prefill(chunk_pair):
    whole, chunked = chunk_pair
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 1024, n).tolist() for n in UNEQUAL]
    greedy = whole.generate(prompts, 10, eos_id=-1, temperature=0.0, top_k=TOP_K)
    assert chunked.generate(prompts, 10, eos_id=-1, temperature=0.0, top_k=TOP_K) == greedy
    # the one-step side is itself right (two rows, as in the forward test: its compiled steps)
    assert greedy_by_forward(whole, [prompts[0]] * 2, 10) == [greedy[0]] * 2
    sampled = whole.generate(prompts, 10, eos_id=-1, temperature=1.0, seed=4, top_k=TOP_K)
    assert chunked.generate(prompts, 10, eos_id=-1, temperature=1.0, seed=4, top_k=TOP_K) == sampled


def compiled(caplog, run) -> list[str]:
    """The names of the functions jax compiles while `run()` runs (from its compilation log)."""
    caplog.clear()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        run()
    return [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("Compiling ")]


def test_chunked_prefill_compiles_per_window_not_per_prompt_length(chunk_pair, caplog):
    make_step.cache_clear()  # the step builders are memoized: forget them, so that the twin's step is new
    chunked = chunked_twin(chunk_pair[0])  # a new step: nothing compiled for it yet
    rng = np.random.default_rng(13)

    def run(lengths):  # one new token: the prefill and the first token's sampling, no decode step
        return lambda: chunked.generate([rng.integers(0, 1024, n).tolist() for n in lengths], 1, eos_id=-1,
                                        temperature=0.0, top_k=TOP_K)

    # bucket 512 in chunks of 64 ending at 64, 128, ..., 512: windows 64 (the first chunk), 128, 256, 512
    assert compiled(caplog, run(UNEQUAL)).count("jit(prefill_chunk_step)") == 4
    for lengths in [(300, 5, 200, 411), (129, 70, 3, 255), (65, 64, 128, 500)]:  # buckets 512, 256, 512
        names = compiled(caplog, run(lengths))
        assert "jit(prefill_chunk_step)" not in names and "jit(start_decoding)" not in names, (lengths, names)
