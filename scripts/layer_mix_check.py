"""Run prefill + decode for one layer mix of a reference config on the default device; print OK or the error.

    PYTHONPATH=. python3 scripts/layer_mix_check.py --config configs/config_671B.json --dense 1 --moe 1 \
        --weights fp8 --gemm-impl fp8 --moe-impl auto

A GPU fault kills the process, so a driver runs one mix per process (see --all).
"""
from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time


def one(opts) -> None:
    import jax
    import numpy as np

    import dsv3_jax
    from dsv3_jax.config import ModelArgs

    args = ModelArgs.from_reference_json(opts.config)
    changes = dict(n_layers=opts.dense + opts.moe, n_dense_layers=opts.dense, dtype=opts.weights,
                   max_batch_size=4, max_seq_len=128)
    if opts.experts:
        changes.update(n_routed_experts=opts.experts, n_expert_groups=1, n_limited_groups=1)
    args = args.replace(**changes)
    model = dsv3_jax.build(args, seed=0, gemm_impl=opts.gemm_impl, moe_impl=opts.moe_impl)
    rng = np.random.default_rng(0)
    batch, length = 2, 48
    tokens = rng.integers(0, args.vocab_size, (batch, length)).astype(np.int32)
    zeros = np.zeros((batch,), np.int32)
    logits, model.cache = model.step(model.state, model.cache, tokens, zeros, zeros + length - 1, kv_len=64)
    jax.block_until_ready(logits)
    pos = zeros + length
    for _ in range(2):
        tok = np.asarray(logits).argmax(-1).astype(np.int32)[:, None]
        logits, model.cache = model.step(model.state, model.cache, tok, pos, zeros, kv_len=64)
        pos = pos + 1
    out = np.asarray(logits)
    assert np.isfinite(out).all(), "non-finite logits"
    print("OK", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--dense", type=int, default=1)
    p.add_argument("--moe", type=int, default=1)
    p.add_argument("--weights", default="fp8", choices=("bf16", "fp8"))
    p.add_argument("--gemm-impl", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--moe-impl", default="auto")
    p.add_argument("--experts", type=int, default=0, help="override n_routed_experts (smaller, faster)")
    p.add_argument("--all", action="store_true", help="run every mix in --mixes, one process each")
    p.add_argument("--mixes", default="1+1,3+1,0+1,1+2,3+0,1+0")
    p.add_argument("--combos", default="fp8/fp8,fp8/bf16,bf16/bf16", help="weights/gemm_impl pairs")
    p.add_argument("--timeout", type=int, default=180)
    opts = p.parse_args()
    if not opts.all:
        return one(opts)
    for mix, combo in itertools.product(opts.mixes.split(","), opts.combos.split(",")):
        dense, moe = mix.split("+")
        weights, gemm = combo.split("/")
        cmd = [sys.executable, __file__, "--config", opts.config, "--dense", dense, "--moe", moe, "--weights", weights,
               "--gemm-impl", gemm, "--moe-impl", opts.moe_impl, "--experts", str(opts.experts)]
        t0 = time.time()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout)
            tail = (r.stdout + r.stderr).strip().splitlines()
            status = "OK" if r.returncode == 0 else "FAIL " + next((l for l in reversed(tail) if "Error" in l or "error" in l), tail[-1] if tail else "")[:160]
        except subprocess.TimeoutExpired:
            status = "TIMEOUT"
        print(f"{mix:5s} {combo:10s} moe={opts.moe_impl:6s} {time.time() - t0:5.1f}s {status}", flush=True)


if __name__ == "__main__":
    main()
