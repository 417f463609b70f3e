"""Build the demo model's corpus and tokenizer: the Python 3.12 standard library's source.

    python scripts/make_demo_data.py [--stdlib DIR] [--out data/pystdlib]

Corpus: every `*.py` file under the standard library directory of CPython 3.12.1 (the pyenv
install, `~/.pyenv/versions/3.12.1/lib/python3.12`; `site-packages/` and `config-3.12-*/`
excluded), in sorted order of its path relative to that directory, read as UTF-8 (files that are
not valid UTF-8 are skipped and counted). Licence: the Python Software Foundation License
(the PSF licence text is copied beside the data).

Split, by file: a file is held out iff int(sha256(relative path)[:8], 16) % 100 < HELDOUT_PERCENT.
The rule depends on the path alone, so it is stable across machines and Python versions.

Tokenizer: byte-level BPE (`tokenizers`), VOCAB_SIZE ids including the four special tokens of the
shipped tiny model (bos, eos, user, assistant) and its chat template, trained on the TRAIN files only.

Data: each file becomes [bos] + tokens + [eos]; the files of each split are concatenated in order
and stored as uint16 arrays `train` and `heldout` in `tokens.npz` (compressed), with `corpus.json`
(corpus name, file and token counts, split rule) beside them. The GPU machine reads these files;
it never needs this interpreter's library.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import tokenizers

from dsv3_jax.bpe_trainer import BOS, EOS, hf_tokenizer_config, train_byte_level_bpe

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_STDLIB = Path.home() / ".pyenv" / "versions" / "3.12.1" / "lib" / "python3.12"
OUT = ROOT / "data" / "pystdlib"
VOCAB_SIZE = 8192
HELDOUT_PERCENT = 5


def is_heldout(relative_path: str) -> bool:
    return int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def corpus_files(stdlib: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every library source file, sorted by path; undecodable files skipped."""
    files, skipped = [], []
    for path in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        rel = path.relative_to(stdlib).as_posix()
        if rel.startswith("site-packages/") or rel.startswith("config-") or "__pycache__" in rel:
            continue
        try:
            files.append((rel, path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            skipped.append(rel)
    return files, skipped


def encode_split(tokenizer: tokenizers.Tokenizer, texts: list[str]) -> np.ndarray:
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    pieces = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.asarray([bos] + encoding.ids + [eos], np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.uint16)


def make_data(stdlib: Path, out: Path) -> dict:
    files, skipped = corpus_files(stdlib)
    train = [(rel, text) for rel, text in files if not is_heldout(rel)]
    heldout = [(rel, text) for rel, text in files if is_heldout(rel)]
    tokenizer = train_byte_level_bpe([text for _, text in train], VOCAB_SIZE, min_frequency=2)
    train_ids = encode_split(tokenizer, [t for _, t in train])
    heldout_ids = encode_split(tokenizer, [t for _, t in heldout])
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "tokens.npz", train=train_ids, heldout=heldout_ids)
    (out / "tokenizer.json").write_text(tokenizer.to_str() + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    licence = stdlib / "LICENSE.txt"
    if licence.is_file():
        shutil.copyfile(licence, out / "LICENSE-PSF.txt")
    info = {
        "corpus": "CPython 3.12.1 standard library source (*.py under lib/python3.12, site-packages and "
                  "config-3.12-* excluded), sorted by relative path",
        "licence": "Python Software Foundation License Version 2 (LICENSE-PSF.txt)",
        "split_rule": f"held out iff int(sha256(relative path)[:8], 16) % 100 < {HELDOUT_PERCENT}",
        "document_format": "[bos] + tokens + [eos] per file, files concatenated in path order",
        "tokenizer": f"byte-level BPE, vocab {VOCAB_SIZE} (4 special tokens), trained on the train files only",
        "files": {"train": len(train), "heldout": len(heldout), "skipped_not_utf8": len(skipped)},
        "bytes": {"train": sum(len(t.encode()) for _, t in train), "heldout": sum(len(t.encode()) for _, t in heldout)},
        "tokens": {"train": int(train_ids.size), "heldout": int(heldout_ids.size)},
        "heldout_files": [rel for rel, _ in heldout],
        "skipped_files": skipped,
    }
    (out / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stdlib", type=Path, default=DEFAULT_STDLIB, help=f"library directory ({DEFAULT_STDLIB})")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output directory ({OUT})")
    args = parser.parse_args()
    info = make_data(args.stdlib, args.out)
    print(json.dumps({k: v for k, v in info.items() if k not in ("heldout_files", "skipped_files")}, indent=1))


if __name__ == "__main__":
    main()
