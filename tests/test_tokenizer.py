"""The tokenizer wrapper against the `tokenizers` library and `transformers`' tokenizer built from the
same files: the same ids (bos/eos included), the same chat rendering, on DeepSeek-V3's real
tokenizer (fixture) and on the embedded demo tokenizer."""
import gzip
import json
from pathlib import Path

import pytest
import tokenizers
transformers = pytest.importorskip("transformers")  # a test-only package

import dsv3_jax
from dsv3_jax.tokenizer import Tokenizer, TokenizerError

TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"
TEXTS = [
    "Hello world!",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "数字 12345678 和中文，还有カタカナ。",
    "def f(x):\n    return x ** 2  # café naïve 🚀",
    "<｜User｜> is a special token written inline",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2 + 2?"},
]


def oracles(directory: Path) -> tuple[tokenizers.Tokenizer, transformers.PreTrainedTokenizerFast, dict]:
    """The raw `tokenizers` object and a `transformers` fast tokenizer over the same tokenizer.json
    (read in place, gzip'd or not) and tokenizer_config.json."""
    packed = directory / "tokenizer.json.gz"
    if packed.exists():
        text = gzip.decompress(packed.read_bytes()).decode()
    else:
        text = (directory / "tokenizer.json").read_text()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in config.items()
               if k in ("bos_token", "eos_token", "pad_token") and v is not None}
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(text), add_bos_token=config["add_bos_token"],
        add_eos_token=config["add_eos_token"], chat_template=config["chat_template"], **special)
    return tokenizers.Tokenizer.from_str(text), hf, config


def hf_chat_ids(hf, messages) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def deepseek(fixtures_dir):
    return fixtures_dir / "deepseek-v3-tokenizer"


def test_deepseek_encoding_equals_tokenizers_and_transformers(deepseek):
    ours = Tokenizer.from_dir(deepseek)
    raw, hf, config = oracles(deepseek)
    assert config["add_bos_token"] and not config["add_eos_token"]
    assert ours.bos_id == raw.token_to_id("<｜begin▁of▁sentence｜>") == 0
    assert ours.eos_id == raw.token_to_id("<｜end▁of▁sentence｜>") == 1
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == [ours.bos_id] + raw.encode(text).ids, text
        assert ids == hf(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert ours.encode("Hello world!")[:3] == [0, 19923, 2058]  # bos, "Hello", " world" in DeepSeek-V3's vocab
    assert ours.decode(ours.encode(TEXTS[3])) == TEXTS[3]


def test_deepseek_chat_template(deepseek):
    ours = Tokenizer.from_dir(deepseek)
    _, hf, _ = oracles(deepseek)
    rendered = ours.render_chat(CHAT)
    assert rendered == ("<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi there<｜Assistant｜>Hello."
                        "<｜end▁of▁sentence｜><｜User｜>What is 2 + 2?<｜Assistant｜>")
    assert ours.apply_chat_template(CHAT) == hf_chat_ids(hf, CHAT)
    ids = ours.apply_chat_template(CHAT[1:2])
    assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1  # the template writes bos; no second one
    assert ours.render_chat(CHAT[1:2], add_generation_prompt=False).endswith("Hi there")


def test_embedded_tokenizer_is_a_real_bpe_with_chat_template():
    ours = Tokenizer.from_dir(TINY)
    raw, hf, config = oracles(TINY)
    model_vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    assert ours.vocab_size == model_vocab == 1024
    assert json.loads(raw.to_str())["model"]["type"] == "BPE"
    for text in TEXTS:
        assert ours.encode(text) == [ours.bos_id] + raw.encode(text).ids == hf(text)["input_ids"], text
        if "<｜" not in text:  # special tokens are skipped by decode
            assert ours.decode(ours.encode(text)) == text
    assert ours.decode(ours.encode(TEXTS[4])) == TEXTS[4].replace("<｜User｜>", "")
    assert len(ours.encode("Tell me about the weather.")) < 12  # merges learned: far fewer ids than bytes
    assert ours.apply_chat_template(CHAT) == hf_chat_ids(hf, CHAT)
    assert ours.decode(ours.apply_chat_template(CHAT), skip_special_tokens=False).startswith(config["bos_token"])


def test_missing_or_broken_files_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((TINY / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(TokenizerError, match="eos_token '<nope>'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT)
