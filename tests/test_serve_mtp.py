"""The server's speculative (MTP) decoding: the demo model (it has an MTP layer) served with and
without `SpeculativeEngine` in one process, their greedy answers against `generate` one prompt at
a time; and the speculative engine's sampled tokens against the main model's exact distribution."""
import asyncio
import zlib
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import dsv3_jax  # noqa: E402
from dsv3_jax.decode.generate import generate  # noqa: E402
from dsv3_jax.serving.app import Service  # noqa: E402
from dsv3_jax.serving.engine import Engine  # noqa: E402
from dsv3_jax.serving.plan import DecodeRow, PrefillRow, RowParams, StepPlan  # noqa: E402
from dsv3_jax.serving.speculative import SpeculativeEngine  # noqa: E402
from dsv3_jax.tokenizer import Tokenizer  # noqa: E402
from mtp_models import SAMPLING_ROWS, SAMPLING_SEQ, VOCAB, build_tiny_mtp, three_token_distribution  # noqa: E402
from test_serve import serve_in_thread  # noqa: E402

ASSETS = Path(dsv3_jax.__file__).parent / "assets"
DEMO = ASSETS / "demo"
MAX_SEQ_LEN, ROWS, MAX_TOKENS = 128, 8, 24
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):", "for i in range(10):",
           "    return", "x = [", "def main():\n    parser = argparse.ArgumentParser(", "with open(path) as f:"]


@pytest.fixture(scope="module")
def servers():
    """{"plain": url, "mtp": url}: the demo model served by each engine."""
    tokenizer = Tokenizer.from_dir(DEMO)
    running, urls = [], {}
    for name, kind in (("plain", Engine), ("mtp", SpeculativeEngine)):
        model = dsv3_jax.load(DEMO, max_batch_size=ROWS, max_seq_len=MAX_SEQ_LEN, compute_dtype="float32",
                              mtp=kind is SpeculativeEngine)
        engine = kind(model, chunk=16, prefill_rows=2, buckets=(ROWS,), min_window=MAX_SEQ_LEN)
        uv, thread, urls[name] = serve_in_thread(Service(model, tokenizer, engine, model_name="demo"))
        running.append((uv, thread))
    yield urls
    for uv, thread in running:
        uv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def reference():
    """Greedy (text, token count, text of the first 7 tokens) of each prompt by `generate`, alone."""
    model = dsv3_jax.load(DEMO, max_batch_size=1, max_seq_len=MAX_SEQ_LEN, compute_dtype="float32")
    tokenizer = Tokenizer.from_dir(DEMO)
    out = {}
    for prompt in PROMPTS:
        tokens = generate(model, [tokenizer.encode(prompt)], MAX_TOKENS, tokenizer.eos_id, 0.0, window=MAX_SEQ_LEN)[0]
        out[prompt] = tokenizer.decode(tokens), len(tokens), tokenizer.decode(tokens[:7])
    return out


def test_greedy_answers_with_and_without_mtp_equal_generate(servers, reference):
    async def ask_all():
        async with httpx.AsyncClient(timeout=120) as http:
            async def one(url, prompt, max_tokens):
                body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                answer = (await http.post(url + "/v1/completions", json=body)).json()
                return answer["choices"][0]["text"], answer["usage"]["completion_tokens"], \
                    answer["choices"][0]["finish_reason"]

            # both servers at once, every prompt twice, and budgets of every parity (a 2-token step at the end)
            calls = [(name, p, n) for name in servers for p in PROMPTS * 2 for n in (MAX_TOKENS, 7)]
            return calls, await asyncio.gather(*[one(servers[name], p, n) for name, p, n in calls])

    calls, answers = asyncio.run(ask_all())
    for (name, prompt, max_tokens), (text, count, reason) in zip(calls, answers):
        full, full_count, first_seven = reference[prompt]
        want = (full, full_count) if max_tokens == MAX_TOKENS else (first_seven, min(7, full_count))
        assert (text, count) == want, (name, prompt, max_tokens)
        assert reason == ("length" if count == max_tokens else "stop"), (name, prompt)
    plain = [a for (name, *_), a in zip(calls, answers) if name == "plain"]
    assert plain == [a for (name, *_), a in zip(calls, answers) if name == "mtp"]


def test_mtp_stream_usage_stop_and_seeded_sampling(servers, reference):
    url = servers["mtp"]
    api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = PROMPTS[2]
    full, count, _ = reference[prompt]
    chunks = list(api.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-2].choices[0].finish_reason == ("length" if count == MAX_TOKENS else "stop")
    assert chunks[-1].usage.completion_tokens == count
    stop = full[len(full) // 2:len(full) // 2 + 3]
    answer = api.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert answer.choices[0].text == full[:full.index(stop)] and answer.choices[0].finish_reason == "stop"

    settings = dict(model="demo", prompt=PROMPTS[0], max_tokens=20, temperature=1.0, top_p=0.9,
                    extra_body={"top_k": 40})
    alone = [api.completions.create(**settings, seed=seed).choices[0].text for seed in (1, 2)]

    async def crowded():
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        calls = [api.completions.create(model="demo", prompt=p, max_tokens=20, temperature=0.7, seed=i)
                 for i, p in enumerate(PROMPTS[:6])]
        calls += [api.completions.create(**settings, seed=seed) for seed in (1, 2)]
        return [a.choices[0].text for a in (await asyncio.gather(*calls))[-2:]]

    assert asyncio.run(crowded()) == alone and alone[0] != alone[1]


# ------------------------------------------------------------------ sampled rows keep the main model's distribution
def test_speculative_rows_sample_the_main_models_distribution():
    """64 rows, half unfiltered and half with top_k 4 / top_p 0.8 (one batch, per-row filters), each
    with its own seed: the first three tokens (the prefill's, then one or two per speculative step)
    against the exact joint distribution of the main model (float64 from its logits), by chi-square."""
    model = build_tiny_mtp(SAMPLING_ROWS, SAMPLING_SEQ)
    vocab, prompt, rows = VOCAB, (1, 5, 2), SAMPLING_ROWS
    filters = [(0, 1.0), (4, 0.8)]
    expected = [three_token_distribution(model, prompt, top_k, top_p) for top_k, top_p in filters]
    engine = SpeculativeEngine(model, chunk=16, prefill_rows=rows, min_window=64)
    counts = [(np.zeros((vocab, vocab)), np.zeros(vocab)) for _ in filters]
    for round_ in range(24):
        params = [RowParams(1.0, *filters[row % 2], seed=zlib.crc32(b"spec") % 1000 + round_ * rows + row)
                  for row in range(rows)]
        engine.run(StepPlan(prefill=tuple(PrefillRow(row, 0, prompt, 0, True, 3, params[row]) for row in range(rows))))
        tokens = [list(t) for t in engine.fetch(engine.results)]
        for step in range(2):  # at least one token each: three in all (the budget caps them at three)
            engine.run(StepPlan(decode=tuple(DecodeRow(row, len(prompt) + len(tokens[row]) - 1, params[row])
                                             for row in range(rows))))
            for row, emitted in enumerate(engine.fetch(engine.results)):
                tokens[row] += emitted
        for row, emitted in enumerate(tokens):
            assert len(emitted) == 3, emitted
            pair, single = counts[row % 2]
            pair[emitted[0], emitted[1]] += 1
            single[emitted[2]] += 1
    for (pair, single), (joint, third) in zip(counts, expected):
        n = pair.sum()
        for observed, want in ((pair.ravel(), joint.ravel() * n), (single, third * n)):
            keep = want > 5
            chi2 = (((observed[keep] - want[keep]) ** 2) / want[keep]).sum()
            dof = keep.sum() - 1
            assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # about a 5-sigma bound
            assert observed[want == 0].sum() == 0  # filtered-out tokens never appear
