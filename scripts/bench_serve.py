"""Benchmark a running dsv3-serve (or any OpenAI-compatible server): Poisson arrivals at several rates.

    dsv3-serve --random-config configs/config_16B.json --max-batch-size 64 --max-seq-len 512 \
        --decode-buckets 64 --min-window 512 --port 8000 &
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --rates 4,16,inf --num-requests 256 \
        --prompt-len 128 --max-tokens 256 --max-concurrency 64 --out bench-serve.json

Each request is a streamed /v1/completions call with a random token-id prompt of --prompt-len
tokens and exactly --max-tokens new tokens (ignore_eos). For every rate (requests/s; inf: all at
once) it reports output throughput, time to first token (TTFT) and inter-token latency (ITL,
the gaps between a stream's chunks) percentiles, and the server's median scheduler host time per
iteration; all of it also as JSON (--out). Needs only httpx (and numpy).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time

import httpx
import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None, help="model name (default: the server's first in /v1/models)")
    parser.add_argument("--rates", default="1,4,16,inf", help="comma list of request rates per second (inf: all "
                        "at once)")
    parser.add_argument("--num-requests", type=int, default=128, help="requests per rate")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per request")
    parser.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    parser.add_argument("--warmup", type=int, default=None, help="requests sent before measuring (they compile "
                        "the server's steps; default: --max-concurrency)")
    parser.add_argument("--token-range", default="10,250", help="prompt token ids are drawn from [lo, hi)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for the server to come up")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        args.rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rates.split(",") if r.strip()]
        args.token_range = tuple(int(t) for t in args.token_range.split(","))
    except ValueError as err:
        parser.error(str(err))
    if not args.rates or any(r <= 0 for r in args.rates) or len(args.token_range) != 2:
        parser.error("--rates must be positive numbers or inf; --token-range must be lo,hi")
    return args


async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """Send one streamed completion; its start, chunk arrival times, token count and any error."""
    started = time.perf_counter()
    arrivals, usage, error = [], None, None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    elif "error" in chunk:
                        error = chunk["error"]["message"]
                    elif chunk["choices"] and chunk["choices"][0]["text"]:
                        arrivals.append(time.perf_counter())
    except httpx.HTTPError as err:
        error = f"{type(err).__name__}: {err}"
    tokens = usage["completion_tokens"] if usage else 0
    if error is None and tokens != body["max_tokens"]:
        error = f"got {tokens} tokens, asked for {body['max_tokens']}"
    return {"started": started, "arrivals": arrivals, "tokens": tokens, "error": error}


async def run_rate(args, model: str, rate: float, count: int, rng: np.random.Generator) -> list[dict]:
    lo, hi = args.token_range
    gate = asyncio.Semaphore(args.max_concurrency)
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        async def gated(body):
            async with gate:
                return await one_request(http, args.url, body)

        tasks = []
        for _ in range(count):
            body = {"model": model, "prompt": rng.integers(lo, hi, args.prompt_len).tolist(),
                    "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(gated(body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        return await asyncio.gather(*tasks)


def percentiles(values, name: str) -> dict:
    if not values:
        return {}
    values = np.asarray(values) * 1e3
    return {f"{name}_ms_mean": float(values.mean()),
            **{f"{name}_ms_p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}}


def summarize(results: list[dict], rate: float, elapsed: float) -> dict:
    done = [r for r in results if r["error"] is None]
    ttft = [r["arrivals"][0] - r["started"] for r in done if r["arrivals"]]
    itl = [b - a for r in done for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(r["tokens"] for r in done)
    errors = sorted({r["error"] for r in results if r["error"] is not None})
    return {"rate": "inf" if math.isinf(rate) else rate, "requests": len(results), "completed": len(done),
            "failed": len(results) - len(done), "errors": errors[:5], "seconds": elapsed,
            "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed, "requests_per_s": len(done) / elapsed,
            **percentiles(ttft, "ttft"), **percentiles(itl, "itl")}


def scheduler_overhead(url: str) -> dict:
    """The server's median scheduler host and iteration times (dsv3-serve's /metrics), if it has them."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found = dict(re.findall(r"^(dsv3_scheduler_(?:host|iteration)_seconds) ([0-9.e+-]+)$", text, re.M))
    return {name.replace("dsv3_", "").replace("_seconds", "_ms"): float(value) * 1e3 for name, value in found.items()}


def show(row: dict) -> str:
    keys = ["ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99"]
    cells = " ".join(f"{k.replace('_ms_', ' ')}={row[k]:.1f}ms" for k in keys if k in row)
    return (f"rate {row['rate']:>5}: {row['completed']}/{row['requests']} ok in {row['seconds']:.1f}s, "
            f"{row['output_tokens_per_s']:.0f} tok/s, {cells}, scheduler host "
            f"{row.get('scheduler_host_ms', float('nan')):.2f} ms/iteration of "
            f"{row.get('scheduler_iteration_ms', float('nan')):.2f}")


def wait_for_server(url: str, seconds: float) -> None:
    """Poll /health until the server answers (it may still be loading its model)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_serve: no healthy server at {url} after {seconds:.0f} s")
        time.sleep(1)


async def bench(args) -> dict:
    wait_for_server(args.url, args.wait)
    model = args.model or httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng = np.random.default_rng(args.seed)
    warmup = args.max_concurrency if args.warmup is None else args.warmup
    if warmup:
        warm = await run_rate(args, model, math.inf, warmup, rng)
        failed = [r["error"] for r in warm if r["error"]]
        print(f"warm-up: {warmup - len(failed)}/{warmup} ok{'; ' + failed[0] if failed else ''}", file=sys.stderr)
    rows = []
    for rate in args.rates:
        started = time.perf_counter()
        results = await run_rate(args, model, rate, args.num_requests, rng)
        row = {**summarize(results, rate, time.perf_counter() - started), **scheduler_overhead(args.url)}
        print(show(row), file=sys.stderr, flush=True)
        rows.append(row)
    return {"url": args.url, "model": model, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "max_concurrency": args.max_concurrency, "num_requests": args.num_requests, "results": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(bench(args))
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if all(r["failed"] == 0 for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
