"""What a model with random weights is served with: a tokenizer whose text is token ids.

Benchmarks send prompts as token-id arrays; a text prompt is encoded as its UTF-8 bytes (ids
0-255). Completion text is each token id followed by a space, so that a streamed chunk's text is
its tokens. There is no eos: every request runs to its max_tokens.
"""
from __future__ import annotations


class IdTokenizer:
    eos_id = None
    bos_id = None
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"{i} " for i in ids)
