"""The tiny random model with an MTP module that the speculative-decoding tests share, and the exact
distribution of the first three tokens it samples.

One config, seed and dtype for all of them, so that the random initialisation (a compiled program
that does not depend on max_batch_size or max_seq_len) compiles once for the session; the sampling
tests also share the sizes (SAMPLING_ROWS, SAMPLING_SEQ), and the greedy ones theirs (SPEC_SIZES,
SPEC_PROMPT_LENGTHS), so their steps compile once too."""
import json
from pathlib import Path

import numpy as np

import dsv3_jax
from dsv3_jax.config import ModelArgs
from dsv3_jax.model.cache import cache_window
from sampling_oracle import filtered

TINY_CONFIG = Path(dsv3_jax.__file__).parent / "assets" / "tiny" / "config.json"
VOCAB = 8  # small enough for the exact joint distribution of two tokens (VOCAB ** 2 outcomes)
SAMPLING_ROWS, SAMPLING_SEQ = 64, 64  # the sampling tests' model: max_batch_size, max_seq_len
# The greedy speculative tests' model sizes (5 cache rows for batches of 4; max_seq_len not a power of
# two) and the prompt lengths of their first batch (bucket and window 150): the decode-graph test runs
# its scanned side on these, so that it reuses their compiled steps.
SPEC_SIZES = dict(max_batch_size=5, max_seq_len=150)
SPEC_PROMPT_LENGTHS = (105, 111, 129, 107)


def tiny_mtp_args() -> ModelArgs:
    """The tiny checkpoint's config with a vocabulary of VOCAB tokens and one MTP layer."""
    config = json.loads(TINY_CONFIG.read_text())
    return ModelArgs.from_hf_config({**config, "vocab_size": VOCAB, "num_nextn_predict_layers": 1})


def build_tiny_mtp(max_batch_size: int, max_seq_len: int, num_devices: int = 1):
    """A random model of `tiny_mtp_args` with its MTP module (seed 3, float32)."""
    args = tiny_mtp_args().replace(max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    return dsv3_jax.build(args, mtp=True, compute_dtype="float32", seed=3, num_devices=num_devices)


def three_token_distribution(model, prompt, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The main model's exact filtered distributions (temperature 1, float64 from its logits) of what
    it samples after `prompt`: the first two tokens jointly (VOCAB, VOCAB) and the third (VOCAB,).
    One batch of every prompt + [a, b] (VOCAB ** 2 <= max_batch_size rows) through the model's step,
    read at three positions (the causal step's logits there see only the tokens up to them): the
    last prompt token, a and b. Three runs of one compiled step."""
    prompt = list(prompt)
    # host operands: eager jnp conversions would each compile a program of their own
    rows = np.asarray([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)], np.int32)  # VOCAB * a + b
    starts = np.zeros(len(rows), np.int32)

    def probs(index):
        logits, model.cache = model.step(model.state, model.cache, rows, starts, np.full_like(starts, index),
                                         kv_len=cache_window(rows.shape[1], model.args.max_seq_len))
        logits = np.asarray(logits).astype(np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return np.stack([filtered(row / row.sum(), top_k, top_p) for row in p])

    first = probs(len(prompt) - 1)[0]
    second = probs(len(prompt))[::VOCAB]  # [a, b]: of b after a
    third = probs(len(prompt) + 1).reshape(VOCAB, VOCAB, VOCAB)
    joint = first[:, None] * second
    return joint, np.einsum("ab,abc->c", joint, third)
