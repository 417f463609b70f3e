"""The OpenAI-compatible server on 127.0.0.1, driven by the official `openai` client and raw HTTP.

One server (the tiny model, float32, 64 rows, continuous batching with 16-token prefill chunks)
runs in a thread for the module; its greedy outputs are checked against `generate` on a separate
copy of the model, one prompt at a time. The CLI entry is started once as a subprocess, with the
thread's settings (SERVER_FLAGS), so that it finds the thread's decode steps in the session's
compilation cache.
"""
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

# the server's stack and the tests' client are extras (serve, test): absent, this module is skipped
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import dsv3_jax  # noqa: E402
from dsv3_jax.cli.serve import load, main, parse_args  # noqa: E402
from dsv3_jax.decode.generate import generate  # noqa: E402
from dsv3_jax.decode.sampling import distribution  # noqa: E402
from dsv3_jax.serving.app import Limits, Service, make_app  # noqa: E402
from dsv3_jax.serving.engine import Engine  # noqa: E402
from dsv3_jax.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"
MAX_SEQ_LEN, ROWS, MAX_QUEUE, MAX_BODY = 128, 64, 8, 64 * 1024
PROMPTS = ["Hello there", "Tell me about the weather and the sea, and then about music and cooking, please.",
           "What is 3 plus 4?", "Hi", "A language model predicts the next token. Attention lets a token look at",
           "Good evening, Ada.", "The piano has", "Describe a red lamp."]
# The server's settings as dsv3-serve flags: the CLI's process decodes with the thread's steps. Only its
# prefill chunk differs: the thread's 16 tokens (prompts take several chunks) is below the flag's range.
SERVER_FLAGS = ["--tiny", "--compute-dtype", "float32", "--num-devices", "1", "--max-batch-size", str(ROWS),
                "--max-seq-len", str(MAX_SEQ_LEN), "--prefill-rows", "4", "--decode-buckets", str(ROWS),
                "--min-window", str(MAX_SEQ_LEN)]
PREFILL_CHUNK = 16


def serve_in_thread(service: Service):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(service), log_level="warning", lifespan="on",
                                           timeout_keep_alive=60))  # no idle connection closed under a client
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def server():
    args = parse_args(SERVER_FLAGS)
    model, tokenizer, name = load(args)
    assert name == "tiny" and model.args.max_batch_size == ROWS and model.options.compute_dtype == "float32"
    engine = Engine(model, chunk=PREFILL_CHUNK, prefill_rows=args.prefill_rows, buckets=args.decode_buckets,
                    min_window=args.min_window)
    service = Service(model, tokenizer, engine, model_name=name, max_queue=MAX_QUEUE,
                      limits=Limits(max_body_bytes=MAX_BODY))
    uv, thread, url = serve_in_thread(service)
    yield service, url
    uv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def reference():
    """Greedy completions of PROMPTS (raw text and one chat turn each) by `generate`, one prompt at a time."""
    model = dsv3_jax.load(TINY, max_batch_size=1, max_seq_len=MAX_SEQ_LEN, compute_dtype="float32")
    tokenizer = Tokenizer.from_dir(TINY)

    def complete(ids, max_tokens):
        tokens = generate(model, [ids], max_tokens, tokenizer.eos_id, 0.0, window=MAX_SEQ_LEN)[0]
        return tokenizer.decode(tokens), len(tokens)

    text = {p: complete(tokenizer.encode(p), 24) for p in PROMPTS}
    chat = {p: complete(tokenizer.apply_chat_template([{"role": "user", "content": p}]), 24) for p in PROMPTS[:4]}
    return text, chat


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def finish(count, max_tokens=24):
    return "length" if count == max_tokens else "stop"


def wait_idle(url, timeout=20.0):
    """/health once every row is free again (the scheduler frees rows within an iteration or two)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        if (health["running"], health["waiting"], health["free_rows"]) == (0, 0, ROWS) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_greedy_completions_equal_generate_alone_and_concurrently(server, reference):
    _, url = server
    text, chat = reference
    api = client(url)
    for prompt in PROMPTS:  # one at a time, not streamed
        answer = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert (answer.choices[0].text, answer.usage.completion_tokens) == text[prompt], prompt
        assert answer.choices[0].finish_reason == finish(text[prompt][1])

    async def stream_all():
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(prompt):
            pieces, reason = [], None
            stream = await api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                  stream=True)
            async for chunk in stream:
                pieces.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            return "".join(pieces), reason

        async def chat_one(prompt):
            answer = await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                       max_tokens=24, temperature=0)
            return answer.choices[0].message.content, answer.usage.completion_tokens

        return await asyncio.gather(*[one(p) for p in PROMPTS * 2], *[chat_one(p) for p in chat])

    results = asyncio.run(stream_all())
    for prompt, (got, reason) in zip(PROMPTS * 2, results):
        assert got == text[prompt][0], prompt
        assert reason == finish(text[prompt][1])
    assert results[len(PROMPTS) * 2:] == [chat[p] for p in chat]
    assert wait_idle(url)["free_rows"] == ROWS


def test_chat_stream_with_usage_and_stop_string(server, reference):
    _, url = server
    _, chat = reference
    api = client(url)
    prompt = PROMPTS[1]
    full, count = chat[prompt]
    stream = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-2].choices[0].finish_reason == finish(count) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == count and chunks[-1].usage.prompt_tokens > 0
    stop = full[len(full) // 2:len(full) // 2 + 3]  # a piece from the middle of the answer
    answer = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=24, temperature=0, stop=[stop, "never appears"])
    assert answer.choices[0].message.content == full[:full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_seeded_sampling_does_not_depend_on_the_batch(server):
    _, url = server
    api = client(url)
    settings = dict(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=1.0, top_p=0.9,
                    extra_body={"top_k": 40})
    alone = [api.completions.create(**settings, seed=seed).choices[0].text for seed in (1, 2)]

    async def crowded():
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        calls = [api.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0.7, seed=i)
                 for i, p in enumerate(PROMPTS)]
        calls += [api.completions.create(**settings, seed=seed) for seed in (1, 2)]
        return [a.choices[0].text for a in (await asyncio.gather(*calls))[-2:]]

    assert asyncio.run(crowded()) == alone
    assert alone[0] != alone[1]  # two seeds, two draws


def filtered64(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 softmax(logits / T), top-k then top-p (the smallest most-likely set reaching top_p), renormalised."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    keep[order[:top_k or len(p)]] = True
    p = np.where(keep, p, 0) / p[keep].sum()
    ordered = p[order]
    out = np.zeros_like(p)
    kept = order[(np.cumsum(ordered) - ordered) < top_p]
    out[kept] = p[kept]
    return out / out.sum()


def test_per_row_distribution_equals_float64_filters():
    """One batch, each row with its own temperature, top_k and top_p (as the server samples), against
    float64 numpy; and the same rows with shared, static parameters (as `generate` samples). Jitted, as
    both callers run it (one program per call form, where eager dispatch compiles every op)."""
    rng = np.random.default_rng(zlib.crc32(b"row_distribution"))
    logits = rng.normal(size=(4, 300)).astype(np.float32) * 3
    settings = [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8), (0.5, 50, 0.6)]
    temperature, top_k, top_p = (np.array(column, dtype) for column, dtype in
                                 zip(zip(*settings), (np.float32, np.int32, np.float32)))
    per_row, shared_filters = jax.jit(distribution), jax.jit(distribution, static_argnames=("top_k", "top_p"))
    got = np.asarray(per_row(logits, temperature, top_k=top_k, top_p=top_p), np.float64)
    got /= got.sum(-1, keepdims=True)  # the top-p cut is left unnormalised (a draw does not need it)
    for row, (t, k, p) in enumerate(settings):
        want = filtered64(logits[row], t, k, p)
        np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-7)
        assert ((got[row] > 0) == (want > 0)).all()
        assert (want > 0).sum() < 300 if k or p < 1 else (want > 0).all()  # the filters really cut
        shared = np.asarray(shared_filters(logits[row:row + 1], np.float32(t), top_k=k, top_p=p), np.float64)[0]
        shared /= shared.sum()
        np.testing.assert_allclose(shared, want, rtol=1e-4, atol=1e-7)


def raw(url, body, *, path="/v1/completions", headers=None):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=data, headers=headers or {"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("body, status, param, words", [
    (b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    (b'[1, 2]', 400, None, "JSON object"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    ({"model": "tiny", "prompt": 5}, 400, "prompt", "string or a non-empty array"),
    ({"model": "tiny", "prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    ({"model": "tiny", "prompt": "hi", "stop": [1]}, 400, "stop", "strings"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
    ({"prompt": "hi"}, 400, "model", "required"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "at least 1"),
    ({"model": "tiny", "prompt": "word " * 200}, 400, "prompt", "maximum context length is 128"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 500}, 400, "max_tokens", "maximum context length is 128"),
    ({"model": "tiny", "prompt": [5, 99999]}, 400, "prompt", "token ids"),
    ({"model": "tiny", "prompt": "hi", "n": 3}, 400, "n", "one choice"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 2}, 400, "logprobs", "not supported"),
])
def test_bad_requests_get_openai_errors(server, body, status, param, words):
    _, url = server
    response = raw(url, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"]


def test_chat_errors_and_other_routes(server):
    _, url = server
    response = raw(url, {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]},
                   path="/v1/chat/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].role"
    response = raw(url, {"model": "tiny", "messages": "hi"}, path="/v1/chat/completions")
    assert response.status_code == 400 and "non-empty array" in response.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert httpx.get(url + "/v1/completions").status_code == 405
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_oversized_bodies_are_refused(server):
    _, url = server
    big = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY + 10)})
    response = raw(url, big)
    assert response.status_code == 413 and "exceeds" in response.json()["error"]["message"]

    def chunks():  # no content-length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 8192

    response = httpx.post(url + "/v1/completions", content=chunks(), timeout=60)
    assert response.status_code == 413
    assert client(url).completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_queue_over_its_limit_gets_429_with_retry_after(server):
    _, url = server

    async def flood():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:
            body = {"model": "tiny", "prompt": "Tell me about the sea.", "max_tokens": 100, "temperature": 0}
            return await asyncio.gather(*[http.post(url + "/v1/completions", json=body)
                                          for _ in range(ROWS + MAX_QUEUE + 16)])

    responses = asyncio.run(flood())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= ROWS
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
    answers = {(r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]) for r in responses
               if r.status_code == 200}
    assert len(answers) == 1  # one greedy answer, whichever row it ran in
    assert wait_idle(url)["free_rows"] == ROWS


def test_a_vanished_client_frees_its_row(server):
    _, url = server
    body = json.dumps({"model": "tiny", "prompt": "Hello there", "max_tokens": 120, "stream": True,
                       "temperature": 0}).encode()
    for read in (2, 0):  # mid-stream, and before any token
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            received = b""
            while received.count(b"data: ") < read:
                received += sock.recv(4096)
        assert wait_idle(url)["free_rows"] == ROWS
    assert client(url).completions.create(model="tiny", prompt="Hi", max_tokens=3).choices[0].finish_reason


def test_load_64_streams_500_requests(server, reference):
    """Bounded load: 520 streamed requests, 64 at a time; each complete, well-formed and equal to its
    greedy reference; afterwards no row held and the process's memory about where it was."""
    service, url = server
    text, _ = reference
    want = {p: text[p] for p in PROMPTS}

    async def run(count):
        gate = asyncio.Semaphore(64)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as http:
            async def one(index):
                prompt = PROMPTS[index % len(PROMPTS)]
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with gate, http.stream("POST", url + "/v1/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line]
                assert response.status_code == 200 and lines[-1] == "data: [DONE]"
                chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
                assert all(c["object"] == "text_completion" for c in chunks)
                got = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                return prompt, got, chunks[-2]["choices"][0]["finish_reason"], chunks[-1]["usage"]

            return await asyncio.gather(*[one(i) for i in range(count)])

    asyncio.run(run(64))  # warm: every connection and buffer made once
    rss = psutil.Process().memory_info().rss
    started = time.perf_counter()
    results = asyncio.run(run(520))
    elapsed = time.perf_counter() - started
    grown = (psutil.Process().memory_info().rss - rss) / 2**20
    for prompt, got, reason, counts in results:
        reference_text, reference_count = want[prompt]
        tokens = min(6, reference_count)
        assert counts["completion_tokens"] == tokens
        assert reference_text.startswith(got) and reason == ("length" if reference_count >= 6 else "stop")
    health = wait_idle(url)
    assert health["free_rows"] == ROWS and health["running"] == 0
    assert grown < 64, f"RSS grew {grown:.0f} MiB over 520 requests"
    host, iteration = service.scheduler.overhead()
    print(f"\n520 requests in {elapsed:.1f} s; scheduler host time {1e3 * host:.2f} ms per iteration of "
          f"{1e3 * iteration:.2f} (medians); RSS +{grown:.1f} MiB")
    metrics = httpx.get(url + "/metrics").text
    assert 'dsv3_requests_total{endpoint="completions",status="200"}' in metrics
    assert "dsv3_time_to_first_token_seconds_count" in metrics and "dsv3_running_rows 0.0" in metrics


def test_cli_serves_the_tiny_model():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    process = subprocess.Popen([sys.executable, "-m", "dsv3_jax.serve", *SERVER_FLAGS, "--port", str(port)],
                               cwd=ROOT, env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
                time.sleep(0.2)
        # greedy: the thread's server compiled that decode step (test_greedy_completions_...)
        stream = client(url).completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                                stream=True)
        assert len(list(stream)) >= 2
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "model name 'tiny'" in process.stderr.read()


def test_cli_rejects_bad_flags(capfd):
    """dsv3-serve's main (what `python -m dsv3_jax.serve` exits with) in this process, one jax start for the
    three: a bad flag, a missing checkpoint and --mtp on a model without an MTP layer, each refused before
    any weight is read, with one line on stderr (capfd: the file descriptor, as a process's stderr)."""
    with pytest.raises(SystemExit) as exit:
        main(["--max-batch-size", "0"])
    assert exit.value.code == 2 and "--max-batch-size must be at least 1" in capfd.readouterr().err
    assert main(["--ckpt-path", "/nonexistent"]) == 1 and "does not exist" in capfd.readouterr().err
    status, lines = main(["--tiny", "--mtp"]), capfd.readouterr().err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and "holds no multi-token-prediction (MTP) layer" in lines[0]
