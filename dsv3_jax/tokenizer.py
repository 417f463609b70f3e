"""A checkpoint's tokenizer: `tokenizer.json` run by the `tokenizers` library, with the special
tokens, bos/eos rules and chat template of `tokenizer_config.json` (what `transformers` reads),
without importing `transformers`.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers


class TokenizerError(ValueError):
    """Tokenizer files that are missing or do not describe a usable tokenizer."""


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken object."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"cannot read a special token from {value!r}")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """Encode, decode and render chats as the checkpoint's Hugging Face tokenizer does.

    encode(text) = [bos] (if add_bos_token) + the `tokenizers` encoding + [eos] (if add_eos_token);
    a chat is rendered with the Jinja chat template and encoded without adding bos/eos (the
    template writes them), as `transformers`' `apply_chat_template` does.
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any]):
        self.backend = backend
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        # add_bos_token / add_eos_token as `transformers`' Llama-style tokenizers read them; a config
        # without either leaves special tokens to tokenizer.json's own post-processor
        self.explicit_specials = "add_bos_token" in config or "add_eos_token" in config
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self.special_tokens = {name: _token_text(config.get(name)) for name in
                               ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(name) is not None}
        self.chat_template = config.get("chat_template")
        self.bos_id = self._special_id("bos_token", self.bos_token)
        self.eos_id = self._special_id("eos_token", self.eos_token)
        if self.add_bos_token and self.bos_id is None:
            raise TokenizerError("tokenizer_config.json sets add_bos_token but names no bos_token")
        if self.add_eos_token and self.eos_id is None:
            raise TokenizerError("tokenizer_config.json sets add_eos_token but names no eos_token")
        self._template = None
        if self.chat_template is not None:
            environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            environment.globals["raise_exception"] = _raise_exception
            self._template = environment.from_string(self.chat_template)

    def _special_id(self, field: str, text: str | None) -> int | None:
        if text is None:
            return None
        token_id = self.backend.token_to_id(text)
        if token_id is None:
            raise TokenizerError(f"{field} {text!r} of tokenizer_config.json is not in tokenizer.json")
        return token_id

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """Read `tokenizer.json` (or `tokenizer.json.gz`) and `tokenizer_config.json` from a directory."""
        directory = Path(directory)
        plain, packed = directory / "tokenizer.json", directory / "tokenizer.json.gz"
        if plain.is_file():
            text = plain.read_text(encoding="utf-8")
        elif packed.is_file():
            text = gzip.decompress(packed.read_bytes()).decode("utf-8")
        else:
            raise TokenizerError(f"no tokenizer.json in {directory}")
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as err:  # the Rust library raises a bare Exception
            raise TokenizerError(f"cannot read {directory}/tokenizer.json: {err}") from None
        config_path = directory / "tokenizer_config.json"
        config = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise TokenizerError(f"{config_path} is not valid JSON: {err}") from None
        return cls(backend, config)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.explicit_specials:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            ids = [self.bos_id] * self.add_bos_token + ids + [self.eos_id] * self.add_eos_token
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` ({"role", "content"} dicts)."""
        if self._template is None:
            raise TokenizerError("tokenizer_config.json has no chat_template")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat (the template writes bos itself)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
