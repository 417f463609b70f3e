"""The project's own small tokenizers (the tiny test model's, the demo model's): a byte-level BPE
trained on a corpus, with DeepSeek-V3's special tokens and chat template so that they load (with
`dsv3_jax.tokenizer.Tokenizer`) and chat like the real one. Used by scripts/make_tiny_assets.py
and scripts/make_demo_data.py.
"""
from __future__ import annotations

import tokenizers

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def hf_tokenizer_config(chat: bool = True) -> dict:
    """tokenizer_config.json for a tokenizer with those special tokens, and that chat template if `chat`
    (a completion model, such as the demo, has none: its CLI then completes raw text)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
              "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False}
    return config | ({"chat_template": CHAT_TEMPLATE} if chat else {})


def train_byte_level_bpe(texts, vocab_size: int, min_frequency: int) -> tokenizers.Tokenizer:
    """A byte-level BPE with those special tokens, trained on `texts` to exactly `vocab_size` entries."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                             special_tokens=[BOS, EOS, USER, ASSISTANT],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the corpus gave {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    return tokenizer
