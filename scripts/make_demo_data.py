"""Build the demo model's corpus and tokenizer: permissively licensed Python source, the interpreter's
standard library and the pure-Python files of the packages installed beside it.

    python3 scripts/make_demo_data.py --out DIR [--packages numpy,jax] [--package-cap-mb 3] [--workers 16]

Sources. The standard library (`sysconfig`'s stdlib directory, site-/dist-packages, config-* and
__pycache__ left out; Python Software Foundation License) and every installed distribution whose
licence, read from its metadata, falls in ALLOWED_LICENCES (License-Expression if given, else the
"License ::" classifiers, else the License field; every part of an AND, any part of an OR, all
classifiers). Its files are the `*.py` entries of its RECORD, vendored trees (_vendor, vendored,
third_party, ...: other projects, other licences) left out. The manifest (corpus.json) records each
package's name, version, licence and the files it gave; the licence files of its dist-info are
copied to licenses/<name>-<version>/.

Rules, in this order, each file counted under the reason that removed it:
  undecodable   not UTF-8;
  generated     a known generated name (codec maps, protobuf, Unicode/IDNA tables, lexer builtins), a
                generated-file marker in its first lines, a line over MAX_LINE characters, more than
                MAX_FILE_KB, or mostly literal lines (a data table): kept out of training and evaluation;
  duplicate     the same content (sha256) as a file met before (stdlib first, then packages by name);
  over_cap      past the package's byte cap (--package-cap-mb; files taken in content-hash order, so the
                sample spreads over the package) or the stdlib's (--stdlib-cap-mb).
Split: a file is held out iff int(sha256(content)[:8], 16) % 100 < HELDOUT_PERCENT: the content
alone decides, so a file shipped by two packages or two Python versions lands on the same side.

Tokenizer: byte-level BPE of VOCAB_SIZE ids (the shipped tiny model's four special tokens and chat
template), trained on the train files (at most --bpe-sample-mb of them, in content-hash order).

Outputs in --out: tokens.npz (uint16 `train`, `heldout`: each file [bos] + tokens + [eos], train
files in content-hash order, held-out files by domain then hash), train_counts.npy (the train
split's count of each token id, for unigram baselines), eval_texts.jsonl.gz (the evaluation set: held-out files of
each domain, in hash order, up to --eval-mb per domain: domain, package, path, sha256, text),
tokenizer.json, tokenizer_config.json, corpus.json (sources, rules, counts, held-out file list) and
licenses/.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "data" / "pycorpus"
VOCAB_SIZE = 8192
HELDOUT_PERCENT = 5
MAX_LINE = 1000
MAX_FILE_KB = 512
LITERAL_FRACTION = 0.6  # a file whose non-blank lines are mostly literals is a table
STDLIB = "stdlib"
PACKAGES = "packages"

# SPDX identifiers (upper case) of the permissive licences taken, and the classifier/free-text names of each.
ALLOWED_LICENCES = {"MIT", "MIT-0", "BSD-2-CLAUSE", "BSD-3-CLAUSE", "BSD-3-CLAUSE-CLEAR", "0BSD", "APACHE-2.0",
                    "PSF-2.0", "PYTHON-2.0", "ISC", "ZLIB", "CC0-1.0", "UNLICENSE", "HPND"}
CLASSIFIER_LICENCES = {
    "MIT License": "MIT", "MIT No Attribution License (MIT-0)": "MIT-0", "BSD License": "BSD-3-CLAUSE",
    "Apache Software License": "APACHE-2.0", "Python Software Foundation License": "PSF-2.0",
    "ISC License (ISCL)": "ISC", "zlib/libpng License": "ZLIB", "The Unlicense (Unlicense)": "UNLICENSE",
    "Historical Permission Notice and Disclaimer (HPND)": "HPND",
}
# Free-text License fields: (pattern, SPDX id); the first match wins; texts that name none are not taken.
TEXT_LICENCES = [
    (r"\bapache(?: software)?(?: license)?[ ,-]*(?:version |v)?2(?:\.0)?\b", "APACHE-2.0"),
    (r"^\s*apache\b", "APACHE-2.0"),
    (r"\bmit\b(?! no attribution)", "MIT"), (r"permission is hereby granted, free of charge", "MIT"),
    (r"\b(?:new |modified |revised |3-clause )?bsd\b", "BSD-3-CLAUSE"),
    (r"redistribution and use in source and binary forms", "BSD-3-CLAUSE"),
    (r"\bpsf\b|python software foundation", "PSF-2.0"), (r"^\s*isc\b", "ISC"),
]
VENDORED_DIRS = {"_vendor", "vendor", "vendored", "_vendored", "third_party", "thirdparty", "_third_party",
                 "extern", "_extern", "externals"}
GENERATED_NAMES = re.compile(
    r"(^|/)(encodings/(cp\d+|mac_\w+|iso8859_\d+|koi8_\w|hp_roman8|ptcp154|tis_620|palmos|kz1048|mbcs)\.py"
    r"|\w+_pb2(_grpc)?\.py|uts46data\.py|idnadata\.py|_\w+_builtins\.py|unicodedata\w*\.py|_unicodedata\w*\.py"
    r"|_casefold\w*\.py|ucd\w*\.py|_?tables?\.py)$")
GENERATED_MARKERS = re.compile(r"do not edit|@generated|^\s*#.*\b(?:auto(?:matically)?[- ]?)?generated\b|"
                               r"\b(?:file|module|code) (?:is|was|has been) (?:auto(?:matically)?[- ]?)?generated",
                               re.IGNORECASE | re.MULTILINE)
LITERAL_TOKEN = re.compile(r"""[-+]?(?:0[xob][0-9a-fA-F_]+|\d[\d_]*(?:\.\d*)?(?:[eE][-+]?\d+)?j?)|[rbuRBU]{0,2}'[^'\n]*'"""
                           r"""|[rbuRBU]{0,2}"[^"\n]*"|\b(?:True|False|None)\b""")
LITERAL_PUNCTUATION = re.compile(r"[\[\](){},:\s]*")
LICENCE_FILE = re.compile(r"^(licen[cs]e|copying|notice|authors|copyright)", re.IGNORECASE)


# ------------------------------------------------------------------------ licences
def spdx_allowed(expression: str) -> bool:
    """An SPDX expression is taken iff every AND-part has an allowed alternative among its OR-parts."""
    text = expression.upper().replace("(", " ").replace(")", " ")
    for conjunct in re.split(r"\s+AND\s+", text.strip()):
        options = [part.strip().split(" WITH ")[0].strip() for part in re.split(r"\s+OR\s+", conjunct)]
        if not any(option in ALLOWED_LICENCES for option in options):
            return False
    return bool(text.strip())


def licence_of(meta) -> tuple[str, bool]:
    """(the licence as the metadata states it, whether it is in the allow-list) of a distribution."""
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return expression, spdx_allowed(expression)
    classifiers = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or [])
                   if c.startswith("License ::") and c.strip() != "License :: OSI Approved"]
    if classifiers:
        ids = [CLASSIFIER_LICENCES.get(c) for c in classifiers]
        return " / ".join(classifiers), all(i in ALLOWED_LICENCES for i in ids)
    text = (meta.get("License") or "").strip()
    if not text or text.upper() in ("UNKNOWN", "NONE"):
        return "unknown", False
    lowered = text.lower()
    if re.search(r"\b(?:a|l)?gpl\b|general public|mozilla|\bmpl\b|proprietary|commercial|eula", lowered):
        return text[:200], False
    for pattern, spdx in TEXT_LICENCES:
        if re.search(pattern, lowered, re.MULTILINE):
            return (text if len(text) <= 200 else f"{spdx} (licence text in the metadata)"), True
    return text[:200], False


# ------------------------------------------------------------------------ file rules
def is_vendored(relative: str) -> bool:
    return any(part.lower() in VENDORED_DIRS for part in relative.split("/")[:-1])


def is_literal_line(line: str) -> bool:
    """A line of literals (numbers, strings, True/False/None) and brackets, commas, colons only."""
    rest, found = LITERAL_TOKEN.subn("", line)
    return found > 0 and LITERAL_PUNCTUATION.fullmatch(rest) is not None


def generated_reason(relative: str, text: str) -> str | None:
    """Why a file is a generated table rather than code someone wrote, or None."""
    if GENERATED_NAMES.search(relative):
        return "generated name"
    if len(text.encode("utf-8")) > MAX_FILE_KB * 1024:
        return f"over {MAX_FILE_KB} KB"
    lines = text.splitlines()
    if any(len(line) > MAX_LINE for line in lines):
        return f"a line over {MAX_LINE} characters"
    if GENERATED_MARKERS.search("\n".join(lines[:15])):
        return "generated-file marker"
    code = [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]
    if len(code) >= 50 and sum(map(is_literal_line, code)) > LITERAL_FRACTION * len(code):
        return "mostly literal lines"
    return None


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_heldout(sha256_hex: str) -> bool:
    return int(sha256_hex[:8], 16) % 100 < HELDOUT_PERCENT


@dataclass
class SourceFile:
    domain: str
    package: str
    path: str  # relative to the stdlib directory or site-packages
    sha256: str = ""
    text: str | None = None
    reason: str | None = None  # why it was left out; None: kept
    nbytes: int = 0

    @property
    def size(self) -> int:
        return self.nbytes if self.text is not None else 0


def read_one(job: tuple[str, str, str, str]) -> SourceFile:
    """Read, hash and classify one file (in a worker process)."""
    domain, package, relative, absolute = job
    item = SourceFile(domain, package, relative)
    try:
        data = Path(absolute).read_bytes()
    except OSError as err:
        item.reason = f"unreadable ({type(err).__name__})"
        return item
    item.sha256, item.nbytes = content_hash(data), len(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        item.reason = "undecodable"
        return item
    item.reason = generated_reason(relative, text)
    if item.reason is None:
        item.text = text
    else:
        item.reason = "generated: " + item.reason
    return item


# ------------------------------------------------------------------------ sources
@dataclass
class Package:
    name: str
    version: str
    licence: str
    allowed: bool
    root: Path
    files: list[str] = field(default_factory=list)  # relative to root
    licence_files: list[str] = field(default_factory=list)


def stdlib_files(stdlib: Path) -> list[str]:
    skip = ("site-packages/", "dist-packages/", "config-")
    return sorted(p.relative_to(stdlib).as_posix() for p in stdlib.rglob("*.py")
                  if not p.relative_to(stdlib).as_posix().startswith(skip) and "__pycache__" not in p.parts)


def installed_packages(only: set[str] | None) -> list[Package]:
    """The installed distributions (first of each name on sys.path), sorted by name, with their .py files."""
    seen, packages = set(), []
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").strip()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if not name or key in seen or (only is not None and key not in only):
            continue
        seen.add(key)
        licence, allowed = licence_of(dist.metadata)
        root = Path(dist.locate_file(""))
        package = Package(name, dist.version, licence, allowed, root)
        for entry in dist.files or []:
            relative = entry.as_posix()
            if relative.endswith(".py") and not relative.startswith("..") and not is_vendored(relative):
                package.files.append(relative)
            elif ".dist-info/" in relative and LICENCE_FILE.match(Path(relative).name):
                package.licence_files.append(relative)
        package.files.sort()
        packages.append(package)
    return sorted(packages, key=lambda p: p.name.lower())


def select(items: list[SourceFile], cap_bytes: int) -> None:
    """Mark duplicates (content met before) and, per package, the files past its byte cap (hash order)."""
    seen: set[str] = set()
    for item in items:
        if item.reason is None:
            if item.sha256 in seen:
                item.reason, item.text = "duplicate", None
            seen.add(item.sha256)
    by_package: dict[tuple[str, str], list[SourceFile]] = {}
    for item in items:
        if item.reason is None:
            by_package.setdefault((item.domain, item.package), []).append(item)
    for group in by_package.values():
        total = 0
        for item in sorted(group, key=lambda i: i.sha256):
            total += item.size
            if cap_bytes and total > cap_bytes:
                item.reason, item.text = "over_cap", None


# ------------------------------------------------------------------------ tokens
def encode_documents(tokenizer, texts: list[str]) -> np.ndarray:
    from dsv3_jax.bpe_trainer import BOS, EOS

    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    pieces = [np.asarray([bos] + e.ids + [eos], np.uint16) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.uint16)


def eval_set(heldout: list[SourceFile], eval_bytes: int) -> list[SourceFile]:
    """Per domain, the held-out files in hash order up to eval_bytes (at least one)."""
    chosen = []
    for domain in (STDLIB, PACKAGES):
        total = 0
        for item in sorted((i for i in heldout if i.domain == domain), key=lambda i: i.sha256):
            if total and total + item.size > eval_bytes:
                break
            chosen.append(item)
            total += item.size
    return chosen


def log(message: str, started: float) -> None:
    print(f"[make_demo_data +{time.time() - started:5.1f}s] {message}", flush=True)


def gather(opts, started: float) -> tuple[list[SourceFile], list[Package], Path]:
    stdlib = Path(opts.stdlib or sysconfig.get_paths()["stdlib"])
    only = {re.sub(r"[-_.]+", "-", n).lower() for n in opts.packages.split(",")} if opts.packages else None
    packages = installed_packages(only) if opts.packages != "" else []
    jobs = [(STDLIB, "stdlib", rel, str(stdlib / rel)) for rel in stdlib_files(stdlib)]
    for package in packages:
        if package.allowed:
            jobs += [(PACKAGES, package.name, rel, str(package.root / rel)) for rel in package.files]
    log(f"{len(jobs)} files to read: stdlib {stdlib}, {sum(p.allowed for p in packages)} of {len(packages)} "
        "packages by licence", started)
    if opts.workers > 1:
        with ProcessPoolExecutor(opts.workers) as pool:
            items = list(pool.map(read_one, jobs, chunksize=64))
    else:
        items = [read_one(job) for job in jobs]
    stdlib_items = [i for i in items if i.domain == STDLIB]
    select(stdlib_items, int(opts.stdlib_cap_mb * 1e6))
    select(items, 0)  # duplicates across the two domains (the stdlib's copy kept)
    select([i for i in items if i.domain == PACKAGES], int(opts.package_cap_mb * 1e6))
    return items, packages, stdlib


def make_data(opts) -> dict:
    import tokenizers  # noqa: F401  (fail here, before the work, when it is missing)

    from dsv3_jax.bpe_trainer import hf_tokenizer_config, train_byte_level_bpe

    started = time.time()
    items, packages, stdlib = gather(opts, started)
    kept = [i for i in items if i.reason is None]
    train = sorted((i for i in kept if not is_heldout(i.sha256)), key=lambda i: i.sha256)
    heldout = sorted((i for i in kept if is_heldout(i.sha256)), key=lambda i: (i.domain != STDLIB, i.sha256))
    log(f"{len(train)} train files ({sum(i.size for i in train) / 1e6:.1f} MB), {len(heldout)} held out", started)
    sample, total = [], 0
    for item in train:
        if total > opts.bpe_sample_mb * 1e6:
            break
        sample.append(item.text)
        total += item.size
    tokenizer = train_byte_level_bpe(sample, opts.vocab_size, min_frequency=2)
    log(f"tokenizer trained on {total / 1e6:.1f} MB", started)
    train_ids = encode_documents(tokenizer, [i.text for i in train])
    heldout_ids = encode_documents(tokenizer, [i.text for i in heldout])
    log(f"tokenized: {train_ids.size} train, {heldout_ids.size} held-out tokens", started)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "tokens.npz", train=train_ids, heldout=heldout_ids)
    np.save(out / "train_counts.npy", np.bincount(train_ids, minlength=opts.vocab_size).astype(np.int64))
    evaluation = eval_set(heldout, int(opts.eval_mb * 1e6))
    with gzip.open(out / "eval_texts.jsonl.gz", "wt", encoding="utf-8") as f:
        for item in evaluation:
            f.write(json.dumps(dict(domain=item.domain, package=item.package, path=item.path, sha256=item.sha256,
                                    text=item.text), ensure_ascii=False) + "\n")
    (out / "tokenizer.json").write_text(tokenizer.to_str() + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(chat=False), indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    info = manifest(opts, items, packages, stdlib, train, heldout, evaluation, train_ids, heldout_ids)
    (out / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"wrote {out}", started)
    return info


def copy_licences(out: Path, packages: list[Package], stdlib: Path) -> dict[str, list[str]]:
    """The licence files of the stdlib and of each package taken, copied to out/licenses/<name>-<version>/."""
    copied: dict[str, list[str]] = {}
    shutil.rmtree(out / "licenses", ignore_errors=True)
    sources = [("stdlib", [stdlib / "LICENSE.txt"])] + [
        (f"{p.name}-{p.version}", [p.root / f for f in p.licence_files]) for p in packages if p.allowed]
    for name, paths in sources:
        for path in paths:
            if path.is_file():
                inside = path.as_posix().split(".dist-info/", 1)[-1] if ".dist-info/" in path.as_posix() else path.name
                target = out / "licenses" / name / inside
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
                copied.setdefault(name, []).append(f"licenses/{name}/{inside}")
    return copied


def manifest(opts, items, packages, stdlib, train, heldout, evaluation, train_ids, heldout_ids) -> dict:
    import platform

    licences = copy_licences(opts.out, packages, stdlib)
    reasons: dict[str, int] = {}
    for item in items:
        if item.reason is not None:
            key = item.reason.split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
    per_package = {}
    for item in items:
        entry = per_package.setdefault(item.package, dict(files=0, bytes=0, heldout_files=0))
        if item.reason is None:
            entry["files"] += 1
            entry["bytes"] += item.size
            entry["heldout_files"] += is_heldout(item.sha256)
    stdlib_entry = dict(name="stdlib", version=platform.python_version(), licence="PSF-2.0", path=str(stdlib),
                        licence_files=licences.get("stdlib", []), **per_package.get("stdlib", {}))
    package_entries = [dict(name=p.name, version=p.version, licence=p.licence, allowed=p.allowed,
                            licence_files=licences.get(f"{p.name}-{p.version}", []),
                            **per_package.get(p.name, dict(files=0, bytes=0, heldout_files=0))) for p in packages]
    return {
        "corpus": "Python source: the standard library and the pure-Python files of permissively licensed "
                  "installed packages", "python": platform.python_version(),
        "allowed_licences": sorted(ALLOWED_LICENCES),
        "rules": {"split": f"held out iff int(sha256(content)[:8], 16) % 100 < {HELDOUT_PERCENT}",
                  "duplicates": "exact content (sha256): the first kept (stdlib, then packages by name)",
                  "generated": f"known generated names, generated-file markers, lines over {MAX_LINE} characters, "
                               f"files over {MAX_FILE_KB} KB, > {LITERAL_FRACTION:.0%} literal lines",
                  "vendored": sorted(VENDORED_DIRS), "package_cap_mb": opts.package_cap_mb,
                  "stdlib_cap_mb": opts.stdlib_cap_mb},
        "document_format": "[bos] + tokens + [eos] per file",
        "tokenizer": f"byte-level BPE, vocab {opts.vocab_size} (4 special tokens), trained on at most "
                     f"{opts.bpe_sample_mb} MB of the train files",
        "files": {"train": len(train), "heldout": len(heldout), "eval": len(evaluation), "left_out": reasons},
        "bytes": {"train": sum(i.size for i in train), "heldout": sum(i.size for i in heldout),
                  "eval": {d: sum(i.size for i in evaluation if i.domain == d) for d in (STDLIB, PACKAGES)}},
        "tokens": {"train": int(train_ids.size), "heldout": int(heldout_ids.size)},
        "sources": [stdlib_entry] + package_entries,
        "heldout_files": [dict(domain=i.domain, package=i.package, path=i.path, sha256=i.sha256) for i in heldout],
        "left_out_files": [dict(package=i.package, path=i.path, reason=i.reason) for i in items
                           if i.reason is not None and i.reason != "over_cap"],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help=f"output directory ({OUT})")
    p.add_argument("--stdlib", type=Path, default=None, help="standard library directory (this interpreter's)")
    p.add_argument("--packages", default=None, help="comma-separated distribution names to consider (default: all "
                   "installed; '' for none)")
    p.add_argument("--package-cap-mb", type=float, default=3.0, help="most source bytes taken from one package")
    p.add_argument("--stdlib-cap-mb", type=float, default=0.0, help="most stdlib source bytes (0: no cap)")
    p.add_argument("--bpe-sample-mb", type=float, default=24.0, help="train text the tokenizer learns from")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    p.add_argument("--eval-mb", type=float, default=0.6, help="held-out source bytes per domain in the eval set")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    return p.parse_args(argv)


def main(argv=None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    info = make_data(parse_args(argv))
    print(json.dumps({k: info[k] for k in ("files", "bytes", "tokens")}, indent=1))


if __name__ == "__main__":
    main()
