"""dsv3-serve over two CPU processes (2 host devices each, jax.distributed with gloo, one 4-device
mesh: attention replicated, the experts split), speculative (--mtp, the demo model): process 0 serves
HTTP and shares each iteration's plan, process 1 only runs the steps. Concurrent greedy answers through
process 0 equal `generate`'s on one process (what the single-process server answers with and without
--mtp, test_serve_mtp); SIGTERM to process 0 ends both with status 0."""
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import dsv3_jax  # noqa: E402
from dsv3_jax.decode.generate import generate  # noqa: E402
from dsv3_jax.tokenizer import Tokenizer  # noqa: E402
from processes import free_port, killed_on_exit, two_device_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = Path(dsv3_jax.__file__).parent / "assets" / "demo"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):", "for i in range(10):"]
MAX_SEQ_LEN, MAX_TOKENS = 128, 20
LAYOUT = "rep-attn"  # the demo's 6 heads do not split 4 ways; its 12 experts do (and MTP keeps the batch whole)


def wait_healthy(url: str, processes, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        for process in processes:
            assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.5)


def test_two_processes_serve_like_one():
    port, address = free_port(), f"127.0.0.1:{free_port()}"
    env = two_device_env()
    command = [sys.executable, "-m", "dsv3_jax.serve", "--mtp", "--port", str(port), "--max-seq-len", str(MAX_SEQ_LEN),
               "--max-batch-size", "4", "--min-window", str(MAX_SEQ_LEN), "--prefill-chunk", "64",
               "--compute-dtype", "float32", "--layout", LAYOUT, "--coordinator-address", address, "--num-processes", "2"]
    processes = [subprocess.Popen(command + ["--process-id", str(rank)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
                 for rank in (0, 1)]
    with killed_on_exit(*processes):
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, processes)

        async def ask_all():
            async with httpx.AsyncClient(timeout=240) as http:
                async def one(prompt):
                    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
                    answer = (await http.post(url + "/v1/completions", json=body)).json()
                    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]

                return await asyncio.gather(*[one(p) for p in PROMPTS])

        answers = asyncio.run(ask_all())
        processes[0].terminate()
        results = [p.communicate(timeout=120) for p in processes]
    for process, (_, err) in zip(processes, results):
        assert process.returncode == 0, err[-3000:]
    assert results[1][0] == "" and "http://" not in results[1][1]  # process 1 serves nothing
    assert "4 device(s) of 2 processes" in results[0][1]

    model = dsv3_jax.load(DEMO, num_devices=4, max_batch_size=1, max_seq_len=MAX_SEQ_LEN, compute_dtype="float32",
                          layout=LAYOUT)
    tokenizer = Tokenizer.from_dir(DEMO)
    for prompt, answer in zip(PROMPTS, answers):
        tokens = generate(model, [tokenizer.encode(prompt)], MAX_TOKENS, tokenizer.eos_id, 0.0, window=MAX_SEQ_LEN)[0]
        assert answer == (tokenizer.decode(tokens), len(tokens)), prompt
