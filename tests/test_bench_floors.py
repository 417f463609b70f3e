"""The memory floors the benchmark scripts print beside their timings, against a count by hand of DeepSeek-V3's
matrices (fp8 weights 1 byte, the head bf16; scales, norms and the gate are under 0.3 % of the sum)."""
from pathlib import Path

import pytest

from dsv3_jax.config import ModelArgs
from script_modules import load_script

V3_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "config_671B.json"

DIM, Q_RANK, KV_RANK, HEADS, NOPE, ROPE, V = 7168, 1536, 512, 128, 128, 64, 128
ATTENTION = DIM * Q_RANK + Q_RANK * HEADS * (NOPE + ROPE) + DIM * (KV_RANK + ROPE) + KV_RANK * HEADS * (NOPE + V) \
    + HEADS * V * DIM
DENSE_MLP, EXPERT, HEAD = 3 * DIM * 18432, 3 * DIM * 2048, 2 * 129280 * DIM
EH_PROJ = 2 * DIM * DIM


def distinct_experts(tokens: int) -> float:
    return 256 * (1 - (1 - 8 / 256) ** tokens)


def moe_layer(tokens: int) -> float:
    return ATTENTION + EXPERT * (1 + distinct_experts(tokens))  # one shared expert, the distinct routed ones


@pytest.mark.parametrize("rows", [1, 8])
def test_speculative_step_floor_counts_both_token_sets_and_the_draft_head(rows):
    load_script("bench_model")
    bench_mtp = load_script("bench_mtp")
    context = 1024
    args = ModelArgs.from_file(V3_CONFIG).replace(
        n_layers=4, n_dense_layers=1, n_mtp_layers=1, max_batch_size=rows, max_seq_len=4096)
    cache = rows * context * (KV_RANK + ROPE) * 2  # one layer's cached rows, bf16
    dense = ATTENTION + DENSE_MLP
    want = {"plain": dense + 3 * moe_layer(rows) + HEAD + 4 * cache,
            "verify2": dense + 3 * moe_layer(2 * rows) + HEAD + 4 * cache}
    want["spec"] = want["verify2"] + EH_PROJ + moe_layer(2 * rows) + cache + HEAD
    got = bench_mtp.floor_bytes(args, rows, context)
    for step, nbytes in want.items():
        assert got[step] == pytest.approx(nbytes, rel=3e-3), step
