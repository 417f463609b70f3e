"""Make the embedded demo checkpoint `dsv3_jax/assets/tiny/`: a tiny DeepSeek-V3-shaped model and
a small byte-level BPE tokenizer, deterministically, from text written here.

    python scripts/make_tiny_assets.py [--out DIR]

The tokenizer is trained with the `tokenizers` library on a generated corpus of short chats, and
comes with bos/eos tokens and a DeepSeek-style chat template. The model has every DeepSeek-V3
part (MLA with q/kv low-rank, a dense layer, sigmoid-routed MoE layers with groups, a shared
expert, a score-correction bias). Its layers are random; only the embedding, final norm and head
are set, from a rank-`dim` factorisation of the corpus' token-bigram log-probabilities, so that
the demo babbles corpus-like words and usually ends its answer with eos. Files: config.json,
model.safetensors (bf16, Hugging Face names), tokenizer.json, tokenizer_config.json.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import tokenizers

from dsv3_jax.config import ModelArgs
from dsv3_jax.checkpoint.schema import expected_tensors, hf_name
from dsv3_jax.bpe_trainer import ASSISTANT, BOS, EOS, USER, hf_tokenizer_config, train_byte_level_bpe

OUT = Path(__file__).resolve().parents[1] / "dsv3_jax" / "assets" / "tiny"
VOCAB_SIZE = 1024
HF_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": VOCAB_SIZE,
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
    "first_k_dense_replace": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "q_lora_rank": 32,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 163840, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}

# ---------------------------------------------------------------------------------------- corpus
GREETINGS = ["Hello", "Hi", "Hey", "Good morning", "Good evening", "Hello there"]
NAMES = ["Ada", "Alan", "Grace", "Linus", "Barbara", "Edsger", "Katherine", "Claude", "Donald", "Margaret"]
TOPICS = {
    "the weather": ["It is sunny and warm today.", "Rain is expected in the afternoon.",
                    "A cold wind blows from the north.", "The sky is clear and the night will be cool."],
    "cooking": ["Boil the pasta for ten minutes, then add the sauce.", "Bread needs flour, water, salt and time.",
                "A good soup starts with onions and a little butter.", "Bake the cake until a knife comes out clean."],
    "music": ["A major scale has seven notes.", "The piano has eighty-eight keys.",
              "Jazz often swings the eighth notes.", "A string quartet has two violins, a viola and a cello."],
    "space": ["The Moon orbits the Earth in about twenty-seven days.", "Mars has two small moons.",
              "Light from the Sun reaches us in about eight minutes.", "Jupiter is the largest planet."],
    "computers": ["A compiler turns source code into machine code.", "Memory bandwidth limits decoding speed.",
                  "A matrix multiply is the heart of a transformer.", "Caches keep recent data close to the core."],
    "language models": ["A language model predicts the next token.", "Attention lets a token look at earlier tokens.",
                        "A mixture of experts sends each token to a few experts.",
                        "Sampling with a low temperature makes answers more focused."],
    "the sea": ["Tides follow the pull of the Moon.", "Salt water freezes at a lower temperature.",
                "Waves carry energy across the ocean.", "Coral reefs are home to many fish."],
}
QUESTIONS = ["Tell me about {t}.", "What do you know about {t}?", "Can you say something about {t}?",
             "I would like to hear about {t}.", "Give me a fact about {t}."]
COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
THINGS = ["apple", "river", "mountain", "book", "garden", "window", "bridge", "lamp"]
PROSE = (
    "This is a tiny model that ships with dsv3-jax so that the chat works without a download. "
    "It has the shape of DeepSeek-V3: latent attention, a dense layer, routed and shared experts. "
    "Its layers are random, so its answers are mostly noise, but every part of the model runs. "
    "Load a real checkpoint with --ckpt-path to get real answers. "
    "Les modèles de langue sont amusants. Über den Fluss führt eine Brücke. "
)


def chats(seed: int = 0) -> list[tuple[str, str]]:
    """Deterministic (question, answer) pairs."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(400):
        topic = rng.choice(sorted(TOPICS))
        question = rng.choice(QUESTIONS).format(t=topic)
        if rng.random() < 0.5:
            question = f"{rng.choice(GREETINGS)}! {question}"
        answer = " ".join(rng.sample(TOPICS[topic], 2))
        pairs.append((question, answer))
    for _ in range(200):
        a, b = rng.randrange(100), rng.randrange(100)
        pairs.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
        a, b = rng.randrange(2, 13), rng.randrange(2, 13)
        pairs.append((f"What is {a} times {b}?", f"{a} times {b} is {a * b}."))
    for _ in range(200):
        name = rng.choice(NAMES)
        pairs.append((f"{rng.choice(GREETINGS)}, my name is {name}.", f"Nice to meet you, {name}! How can I help?"))
        color, thing = rng.choice(COLORS), rng.choice(THINGS)
        pairs.append((f"Describe a {color} {thing}.", f"The {thing} is {color}, quiet and a little old."))
    for sentence in PROSE.split(". "):
        pairs.append(("Who are you?", sentence.strip().rstrip(".") + "."))
    rng.shuffle(pairs)
    return pairs


# ------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(pairs: list[tuple[str, str]]) -> tokenizers.Tokenizer:
    texts = [text for pair in pairs for text in pair] + [PROSE] * 4
    return train_byte_level_bpe(texts, VOCAB_SIZE, min_frequency=1)


# ----------------------------------------------------------------------------------------- model
def bigram_factors(tokenizer: tokenizers.Tokenizer, pairs, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(E, H) with E @ H.T ~ the centred log-probabilities of next token given token (rank dim)."""
    bos, eos, user, assistant = (tokenizer.token_to_id(t) for t in (BOS, EOS, USER, ASSISTANT))
    counts = np.zeros((VOCAB_SIZE, VOCAB_SIZE))
    for question, answer in pairs:
        ids = ([bos, user] + tokenizer.encode(question, add_special_tokens=False).ids + [assistant]
               + tokenizer.encode(answer, add_special_tokens=False).ids + [eos])
        np.add.at(counts, (ids[:-1], ids[1:]), 1.0)
    unigram = counts.sum(0) + 1.0
    probs = counts + 0.01 * unigram / unigram.sum()
    logp = np.log(probs / probs.sum(1, keepdims=True))
    logp -= logp.mean(1, keepdims=True)
    u, s, vt = np.linalg.svd(logp)
    u, v = canonical_gauge(u[:, :dim], vt[:dim].T, s[:dim], s[dim])
    root = np.sqrt(s[:dim])
    embed, head = u * root, v * root
    # tokens the corpus never uses have constant rows: their factors are rounding noise (~1e-12),
    # different on every host; make them exact zeros (the other entries are > 1e-7)
    for factor in (embed, head):
        factor[np.abs(factor) < 1e-8] = 0.0
    return embed, head


def canonical_gauge(u: np.ndarray, v: np.ndarray, s: np.ndarray, next_s: float,
                    rtol: float = 1e-8) -> tuple[np.ndarray, np.ndarray]:
    """The singular vectors `u`, `v` (columns; singular values `s` descending) in a gauge that does not
    depend on the LAPACK/BLAS that computed them. An SVD fixes each pair of singular vectors only up
    to a common sign, and the vectors of a repeated singular value (this corpus has one, three times)
    only up to a common rotation among themselves; each host kernel picks its own (signs flip
    under another OPENBLAS_CORETYPE). Here each group of equal singular values (relative gap < rtol) is
    rotated onto the orthonormal basis of its span closest to a fixed random matrix `g` (the polar
    factor of u_b^T g, which depends only on the span), and its `v` by the same rotation. Two hosts'
    results then differ by rounding (~1e-13), far below the bf16 the tensors are stored in."""
    if (s[-1] - next_s) <= rtol * s[-1]:
        raise RuntimeError("the kept singular vectors end inside a group of equal singular values")
    g = np.random.default_rng(1234).standard_normal(u.shape)
    u_out, v_out = np.empty_like(u), np.empty_like(v)
    start = 0
    while start < len(s):
        stop = start + 1
        while stop < len(s) and s[stop - 1] - s[stop] <= rtol * s[stop - 1]:
            stop += 1
        x, _, yt = np.linalg.svd(u[:, start:stop].T @ g[:, start:stop])
        rotation = x @ yt
        u_out[:, start:stop] = u[:, start:stop] @ rotation
        v_out[:, start:stop] = v[:, start:stop] @ rotation
        start = stop
    return u_out, v_out


def model_tensors(args: ModelArgs, embed: np.ndarray, head: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor the model needs, Hugging Face names, bf16. Layers random (their outputs scaled
    down so the residual stream keeps the token's embedding); embedding/norm/head from the bigrams."""
    import jax.numpy as jnp
    from flax import nnx

    from dsv3_jax.model.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(args, param_dtype=jnp.float32))
    _, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    # from the stored (bf16) embedding, summed exactly, so hosts whose embeddings round alike agree
    stored = np.asarray(embed, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    rms = math.sqrt(math.fsum((stored**2).ravel().tolist()) / stored.size)
    tensors = {}
    for _, name, shape in expected_tensors(state, args):
        leaf = name.rsplit(".", 2)[-2]
        if name == "embed.weight":
            value = embed
        elif name == "head.weight":
            value = head
        elif name == "norm.weight":
            value = np.full(shape, rms)
        elif "norm" in leaf:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("gate.bias"):
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
            if leaf in ("wo", "w2"):
                value *= 0.3 * rms
        tensors[hf_name(name)] = np.asarray(value, np.float32).astype(ml_dtypes.bfloat16)
    return tensors


def make_assets(out: Path) -> None:
    from dsv3_jax.checkpoint.safetensors import save_file

    pairs = chats()
    tokenizer = train_tokenizer(pairs)
    args = ModelArgs.from_hf_config(HF_CONFIG)
    embed, head = bigram_factors(tokenizer, pairs, args.dim)
    tensors = model_tensors(args, embed, head)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        staging = Path(scratch) / out.name
        staging.mkdir()
        (staging / "config.json").write_text(json.dumps(HF_CONFIG, indent=2) + "\n")
        (staging / "tokenizer_config.json").write_text(
            json.dumps(hf_tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (staging / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output directory (default {OUT})")
    make_assets(parser.parse_args().out)


if __name__ == "__main__":
    main()
