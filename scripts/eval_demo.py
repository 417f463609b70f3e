"""Evaluate a demo checkpoint on the corpus' evaluation set (eval_texts.jsonl.gz of
scripts/make_demo_data.py): held-out perplexity by domain (stdlib, other packages) and by position,
bits per byte (comparable across tokenizers), beside a unigram baseline and, optionally, a previous
demo model; MTP acceptance (teacher-forced, and in greedy generate(mtp=True)); greedy completions
of fixed prompts. Writes OUT.json and OUT.md.

    PYTHONPATH=. python3 scripts/eval_demo.py --ckpt DIR --data DATA_DIR --out benchmarks/demo-eval \
        [--previous OLD_DIR] [--seq 2048]

Windows: each domain's files, each [bos] + tokens + [eos], concatenated in the set's order and cut
into non-overlapping windows of --seq predicted tokens (the last one padded; padding not scored), each
scored from its position 0: position p of a window sees p tokens of context. Per-token numbers
(perplexity, position buckets) are per model's own tokenizer; bits per byte = total -log2 p over
every token of the domain's stream / its UTF-8 bytes, the same text for every model. The unigram
baseline: the train split's token counts (train_counts.npy), add-one, on the same targets.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import time
from pathlib import Path

import numpy as np

DOMAINS = ("stdlib", "packages")
BUCKETS = ((0, 256), (256, 512), (0, 512), (512, 1024), (1024, 2048))
PROMPTS = ("def fibonacci(n):", "import numpy as np\n\ndef softmax(x):", "class Stack:",
           "import jax\nimport jax.numpy as jnp\n\n\ndef mse_loss(params, x, y):",
           "def read_json(path):\n    \"\"\"Return the parsed contents of the JSON file at path.\"\"\"")


def read_eval_texts(data: Path) -> dict[str, list[str]]:
    texts: dict[str, list[str]] = {d: [] for d in DOMAINS}
    with gzip.open(data / "eval_texts.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            texts[record["domain"]].append(record["text"])
    return texts


def domain_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """The files as one stream: [bos] + tokens + [eos] each, in order."""
    pieces = [np.asarray([tokenizer.bos_id] + tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_id], np.int32)
              for t in texts]
    return np.concatenate(pieces)


def stream_windows(stream: np.ndarray, seq: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows (n, seq + 1), mask (n, seq)): every token after the first is a target exactly once."""
    n = max(1, -(-(len(stream) - 1) // seq))
    padded = np.full(n * seq + 1, pad, np.int32)
    padded[:len(stream)] = stream
    windows = padded[np.arange(n)[:, None] * seq + np.arange(seq + 1)[None]]
    mask = (np.arange(n)[:, None] * seq + np.arange(1, seq + 1)[None]) < len(stream)
    return windows, mask


def bucket_table(nll_sum: np.ndarray, count: np.ndarray, buckets=BUCKETS) -> dict[str, dict]:
    """Per position bucket [lo, hi): mean loss and perplexity from per-position sums and counts."""
    table = {}
    for lo, hi in buckets:
        if lo >= len(count):
            continue
        n = float(count[lo:hi].sum())
        if n:
            loss = float(nll_sum[lo:hi].sum()) / n
            table[f"{lo}-{hi}"] = dict(loss=loss, ppl=math.exp(loss), tokens=int(n))
    return table


def score_windows(model, mtp, windows: np.ndarray, mask: np.ndarray, batch: int) -> dict:
    """Sums over the windows: per-position -log p and counts, and the MTP module's agreement."""
    from dsv3_jax import training

    seq = mask.shape[1]
    nll_sum, count = np.zeros(seq), np.zeros(seq)
    accepted = drafts = correct = 0.0
    for i in range(0, len(windows), batch):
        part, part_mask = windows[i:i + batch], mask[i:i + batch]
        rows = len(part)
        if rows < batch:  # one compiled shape: pad with copies, scored with weight 0
            part = np.concatenate([part, np.repeat(part[:1], batch - rows, 0)])
            part_mask = np.concatenate([part_mask, np.zeros((batch - rows, seq), bool)])
        out = training.sequence_nll(model, part, mtp=mtp)
        nll = np.asarray(out["nll"], np.float64)
        nll_sum += (nll * part_mask).sum(0)
        count += part_mask.sum(0)
        if mtp is not None:
            both = part_mask[:, 1:]  # token i+2 is a real target
            accepted += float((np.asarray(out["mtp_argmax"]) == np.asarray(out["main_argmax"])[:, 1:])[both].sum())
            correct += float((np.asarray(out["mtp_argmax"]) == part[:, 2:])[both].sum())
            drafts += float(both.sum())
    result = dict(nll_sum=nll_sum, count=count)
    if mtp is not None:
        result.update(mtp_acceptance=accepted / max(drafts, 1.0), mtp_accuracy=correct / max(drafts, 1.0))
    return result


def unigram_scores(counts: np.ndarray, windows: np.ndarray, mask: np.ndarray) -> dict:
    logp = np.log((counts + 1.0) / (counts + 1.0).sum())
    nll = -logp[windows[:, 1:]] * mask
    return dict(nll_sum=nll.sum(0), count=mask.sum(0).astype(np.float64))


def summarize(scores: dict, n_bytes: int) -> dict:
    total, n = float(scores["nll_sum"].sum()), float(scores["count"].sum())
    out = dict(loss=total / n, ppl=math.exp(total / n), tokens=int(n), bytes=n_bytes,
               bits_per_byte=total / math.log(2) / n_bytes, buckets=bucket_table(scores["nll_sum"], scores["count"]))
    for key in ("mtp_acceptance", "mtp_accuracy"):
        if key in scores:
            out[key] = scores[key]
    return out


def evaluate_checkpoint(path: Path, texts: dict, seq: int, batch: int, mtp: bool, counts=None,
                        positions_unlimited: bool = False) -> dict:
    """Per domain: the model's summary (and the unigram's, when `counts` are given)."""
    import dsv3_jax
    from dsv3_jax.checkpoint.load import find_config
    from dsv3_jax.checkpoint.mtp import load_mtp
    from dsv3_jax.config import ModelArgs
    from dsv3_jax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(path)
    config = ModelArgs.from_file(find_config(path)) if positions_unlimited else None  # past its trained positions
    model = dsv3_jax.load(path, max_seq_len=seq, max_batch_size=batch, config=config)
    module = load_mtp(path, model.args, param_dtype=model.options.jnp_dtype) if mtp else None
    result = {}
    for domain in DOMAINS:
        if not texts[domain]:
            continue
        stream = domain_stream(tokenizer, texts[domain])
        windows, mask = stream_windows(stream, seq, tokenizer.eos_id)
        n_bytes = sum(len(t.encode("utf-8")) for t in texts[domain])
        result[domain] = summarize(score_windows(model, module, windows, mask, batch), n_bytes)
        if counts is not None:
            result[domain + "/unigram"] = summarize(unigram_scores(counts, windows, mask), n_bytes)
    return result


def generations(path: Path, prompts, new_tokens: int) -> dict:
    """Greedy completions of the prompts, plain and with MTP (which must agree), and MTP's acceptance."""
    import dsv3_jax
    from dsv3_jax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(path)
    model = dsv3_jax.load(path, mtp=True, max_batch_size=1)
    rows, drafts, accepted = [], 0, 0
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        plain = model.generate([ids], new_tokens, tokenizer.eos_id, temperature=0.0)[0]
        stats: dict = {}
        spec = model.generate([ids], new_tokens, tokenizer.eos_id, temperature=0.0, mtp=True, stats=stats)[0]
        drafts += stats["drafts"]
        accepted += stats["accepted"]
        rows.append(dict(prompt=prompt, completion=tokenizer.decode(plain), tokens=len(plain),
                         mtp_same=plain == spec, mtp_acceptance=stats["acceptance"]))
    return dict(max_seq_len=model.args.max_seq_len, new_tokens=new_tokens, prompts=rows,
                mtp_acceptance=accepted / max(drafts, 1), all_mtp_same=all(r["mtp_same"] for r in rows))


def bucket_cells(summary: dict) -> str:
    return " | ".join(f"{summary['buckets'][b]['ppl']:.2f}" if b in summary["buckets"] else "-"
                      for b in ("0-256", "256-512", "0-512", "512-1024", "1024-2048"))


def markdown(result: dict) -> str:
    lines = ["# Demo model evaluation", "", f"Checkpoint `{result['checkpoint']}`, {result['device']}; evaluation set: "
             f"{sum(result['eval_files'].values())} held-out files ({', '.join(f'{k} {v}' for k, v in result['eval_files'].items())}) ({result['seq']}-token windows; see scripts/eval_demo.py). "
             "Perplexity per token of each model's own tokenizer; bits per byte over the same text.", "",
             "| model | domain | tokens | ppl | bits/byte | ppl 0-256 | 256-512 | 0-512 | 512-1024 | 1024-2048 "
             "| MTP accept. |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in result["models"].items():
        for key, s in rows.items():
            domain, _, variant = key.partition("/")
            label = f"{name} ({variant})" if variant else name
            accept = f"{s['mtp_acceptance']:.3f}" if "mtp_acceptance" in s else "-"
            lines.append(f"| {label} | {domain} | {s['tokens']} | {s['ppl']:.2f} | {s['bits_per_byte']:.3f} | "
                         f"{bucket_cells(s)} | {accept} |")
    gen = result.get("generations")
    if gen:
        lines += ["", f"Greedy generate(mtp=True): acceptance {gen['mtp_acceptance']:.3f}, same tokens as plain "
                  f"greedy: {gen['all_mtp_same']} (max_seq_len {gen['max_seq_len']}, {gen['new_tokens']} new tokens).",
                  ""]
        for row in gen["prompts"]:
            lines += [f"Prompt `{row['prompt']!r}` (MTP acceptance {row['mtp_acceptance']:.2f}):", "", "```python",
                      row["prompt"] + row["completion"], "```", ""]
    if result.get("targets"):
        lines += ["", "| target | value | met |", "|---|---:|---|"]
        lines += [f"| {t['name']} | {t['value']:.3f} | {t['met']} |" for t in result["targets"]]
    return "\n".join(lines) + "\n"


def targets(models: dict, gen: dict | None) -> list[dict]:
    """The issue's targets, each with its measured value."""
    new = models["new"]
    out = []
    for domain in DOMAINS:
        buckets = new.get(domain, {}).get("buckets", {})
        if "1024-2048" in buckets and "256-512" in buckets:
            ratio = buckets["1024-2048"]["ppl"] / buckets["256-512"]["ppl"]
            out.append(dict(name=f"{domain}: ppl 1024-2048 / ppl 256-512 (<= 1.10)", value=ratio, met=ratio <= 1.10))
    if "packages" in new and "packages/unigram" in new:
        ratio = new["packages"]["ppl"] / new["packages/unigram"]["ppl"]
        out.append(dict(name="packages: ppl / unigram ppl (<= 0.25)", value=ratio, met=ratio <= 0.25))
    if gen:
        out.append(dict(name="greedy generate(mtp=True) acceptance (>= 0.75)", value=gen["mtp_acceptance"],
                        met=gen["mtp_acceptance"] >= 0.75))
    return out


def main(argv=None) -> None:
    import jax

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="the corpus directory (eval_texts.jsonl.gz, train_counts.npy)")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix (.json and .md are written)")
    p.add_argument("--previous", type=Path, default=None, help="a previous demo checkpoint to compare with")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=96, help="tokens per greedy completion")
    opts = p.parse_args(argv)
    started = time.time()
    texts = read_eval_texts(opts.data)
    counts = np.load(opts.data / "train_counts.npy")
    models = {"new": evaluate_checkpoint(opts.ckpt, texts, opts.seq, opts.batch, mtp=True, counts=counts)}
    print(f"[eval_demo +{time.time() - started:.0f}s] new model scored", flush=True)
    if opts.previous is not None:
        old_seq = json.loads((opts.previous / "config.json").read_text()).get("max_position_embeddings", opts.seq)
        models[f"previous ({old_seq} windows)"] = evaluate_checkpoint(opts.previous, texts, old_seq, opts.batch,
                                                                      mtp=True)
        if old_seq < opts.seq:
            models[f"previous ({opts.seq} windows)"] = evaluate_checkpoint(
                opts.previous, texts, opts.seq, opts.batch, mtp=False, positions_unlimited=True)
        print(f"[eval_demo +{time.time() - started:.0f}s] previous model scored", flush=True)
    result = dict(checkpoint=str(opts.ckpt), device=str(jax.devices()[0].device_kind), seq=opts.seq,
                  eval_files={d: len(texts[d]) for d in DOMAINS}, models=models)
    write(opts.out, result)  # the perplexities first: generation below may fail without losing them
    result["generations"] = generations(opts.ckpt, PROMPTS, opts.new_tokens)
    result["targets"] = targets(models, result["generations"])
    result["seconds"] = round(time.time() - started, 1)
    write(opts.out, result)
    print(markdown(result), flush=True)


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)

    def plain(x):
        return x.tolist() if isinstance(x, np.ndarray) else x

    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=plain) + "\n")
    out.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
