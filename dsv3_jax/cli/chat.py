"""The chat CLI (`python -m dsv3_jax.chat`, installed as `dsv3-chat`).

    echo 'class Stack:' | dsv3-chat --complete   # the embedded demo model (a Python code completer)
    dsv3-chat --tiny --interactive               # the embedded tiny random model (tests; babbles)
    dsv3-chat --ckpt-path DIR --interactive      # a Hugging Face checkpoint directory with its tokenizer
    dsv3-chat --ckpt-path DIR --input-file prompts.txt

Completion (--complete, or any mode when the tokenizer has no chat template, as the demo model's
has not): the prompt is encoded as raw text after the BOS token and its continuation is printed
after it; no history is kept.

Interactive: `>>> ` reads a turn; `/exit` ends, `/clear` empties the history; the history goes
through the checkpoint's chat template, the answer is streamed as it is generated, then its
prefill and decode rates (compilation excluded). Batch: one prompt per line of --input-file, each a
single user turn, printed as "Prompt:" / "Completion:" pairs, the rates on stderr. Bad flags, paths,
configs or input end the run with one line on stderr (exit 1; 2 for flags argparse rejects).
Multi-process: start the same command once per process with
--coordinator-address/--num-processes/--process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID); the mesh spans every process's devices, only process 0 reads input and prints,
and it shares each input with the others.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import jax

from ..api import load
from ..config import PositionLimitWarning
from ..decode.generate import MaxSeqLenWarning, Plan, Timing, generate, warm_up
from ..errors import NoMTPLayerError
from ..options import add_flags, from_flags
from ..tokenizer import Tokenizer
from .common import ArgumentParser, UsageError, devices_used, run_cli
from .distributed import Console, check_same_settings, start_distributed

ASSETS = Path(__file__).resolve().parent.parent / "assets"  # dsv3_jax/assets
DEFAULT_CHECKPOINT = ASSETS / "demo"  # see assets/demo/MODEL_CARD.md
TINY_CHECKPOINT = ASSETS / "tiny"
BANNERS = {
    DEFAULT_CHECKPOINT: "the embedded demo model: DeepSeek-V3 architecture (MLA, MoE, MTP), 18.2M parameters, "
                        "2,048 positions, trained for 5 minutes on one H200 on permissively licensed Python "
                        "(the standard library and 172 packages; held-out perplexity 7.5 on code beyond the "
                        "standard library); a Python code completer, not a chat model",
    TINY_CHECKPOINT: "the embedded tiny model (random layers: expect babble)",
}
MAX_BATCH_PROMPTS = 8


class ChatError(UsageError):
    """A problem the user can fix (bad flags, files, prompts); reported in one line."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="dsv3-chat", description="Chat with a DeepSeek-V3 model in JAX.")
    parser.add_argument("--ckpt-path", type=Path, default=None,
                        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files); "
                             "default: the embedded demo model (a Python code completer)")
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny model with random layers "
                        "(fast; for tests) instead of the demo model")
    parser.add_argument("--config", type=Path, default=None,
                        help="model config (reference or Hugging Face JSON); default: the checkpoint's config.json")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--input-file", type=Path, help=f"batch mode: one prompt per line (at most {MAX_BATCH_PROMPTS}), "
                      "each a single user turn (or raw text to complete, when the tokenizer has no chat template)")
    mode.add_argument("--interactive", action="store_true", help="interactive chat (/clear, /exit), or line-by-line "
                      "completion when the tokenizer has no chat template")
    mode.add_argument("--complete", action="store_true", help="complete the text read from standard input "
                      "(or --prompt) as raw text, no chat template, and print prompt and continuation")
    parser.add_argument("--prompt", default=None, help="--complete: the text to complete (default: stdin, "
                        "its trailing newlines removed)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="longest answer, in tokens")
    parser.add_argument("--temperature", type=float, default=0.2, help="sampling temperature; 0 means greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the first turn (turn i uses seed + i)")
    parser.add_argument("--num-devices", type=int, default=None, help="devices of the mesh (default: all, over all "
                        "processes; on one process, the most that the model's dimensions divide into)")
    add_flags(parser)
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="tokens of a conversation (prompt + answer) the cache holds, at most the positions "
                             "the checkpoint was trained at (its max_position_embeddings without rope scaling): "
                             "a larger value is cut to those (default: 4096)")
    parser.add_argument("--mtp", action="store_true", help="speculative decoding with the checkpoint's "
                        "multi-token-prediction layer (one draft token per step; same outputs when greedy)")
    parser.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-process)")
    parser.add_argument("--num-processes", type=int, default=None, help="processes of a multi-process run")
    parser.add_argument("--process-id", type=int, default=None, help="this process's index in [0, --num-processes)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        parser.error(f"--temperature must be a number >= 0 (0: greedy), got {args.temperature}")
    if args.top_k < 0:
        parser.error(f"--top-k must not be negative (0: off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must lie in (0, 1] (1: off), got {args.top_p}")
    if not 0 <= args.seed < 2**31:
        parser.error(f"--seed must lie in [0, 2**31), got {args.seed}")
    if args.num_devices is not None and args.num_devices < 1:
        parser.error(f"--num-devices must be at least 1, got {args.num_devices}")
    if args.max_seq_len is not None and args.max_seq_len < 1:
        parser.error(f"--max-seq-len must be at least 1, got {args.max_seq_len}")
    if args.tiny and args.ckpt_path is not None:
        parser.error("--tiny and --ckpt-path name two checkpoints: give one")
    if args.prompt is not None and not args.complete:
        parser.error("--prompt goes with --complete")
    return args


def check_paths_and_devices(args: argparse.Namespace) -> None:
    """What the flags name must exist (and the devices must be there) before anything is loaded."""
    if args.ckpt_path is not None and not args.ckpt_path.is_dir():
        what = "is not a directory" if args.ckpt_path.exists() else "does not exist"
        raise ChatError(f"--ckpt-path {args.ckpt_path} {what}")
    if args.config is not None and not args.config.is_file():
        what = "is not a file" if args.config.exists() else "does not exist"
        raise ChatError(f"--config {args.config} {what}")
    if args.num_devices is not None and args.num_devices > jax.device_count():
        raise ChatError(f"--num-devices {args.num_devices} exceeds the {jax.device_count()} devices available")


def checkpoint_path(args: argparse.Namespace) -> Path:
    return args.ckpt_path or (TINY_CHECKPOINT if args.tiny else DEFAULT_CHECKPOINT)


def banner(args: argparse.Namespace) -> str:
    path = checkpoint_path(args)
    return BANNERS.get(path, str(path))


def note_cut(console: Console, args: argparse.Namespace, what: str, prompt: list[int], completion: list[int]) -> None:
    """Say so when a completion ended at --max-seq-len rather than at eos or --max-new-tokens."""
    room = args.max_seq_len - len(prompt)
    if len(completion) == room < args.max_new_tokens:
        console.note(f"dsv3-chat: {what} stopped after {len(completion)} tokens at --max-seq-len={args.max_seq_len}")


class StreamPrinter:
    """Prints a completion as it grows: decodes the tokens so far and writes the new text (holding
    back a trailing incomplete UTF-8 character)."""

    def __init__(self, tokenizer, console: Console):
        self.tokenizer, self.console, self.shown = tokenizer, console, ""

    def __call__(self, completions: list[list[int]]) -> None:
        text = self.tokenizer.decode(completions[0])
        if not text.endswith("\ufffd"):
            self._show(text)

    def finish(self, tokens: list[int]) -> str:
        text = self.tokenizer.decode(tokens)
        self._show(text)
        self.console.write("\n")
        return text

    def _show(self, text: str) -> None:
        if text.startswith(self.shown):
            self.console.write(text[len(self.shown):])
            self.shown = text


def load_model(args: argparse.Namespace, batch: int):


    path = checkpoint_path(args)
    tokenizer = Tokenizer.from_dir(path)
    if tokenizer.eos_id is None:
        raise ChatError(f"the tokenizer in {path} names no eos_token")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PositionLimitWarning)
            model = load(path, options=from_flags(args), num_devices=args.num_devices or "auto",
                         max_batch_size=batch, max_seq_len=args.max_seq_len, config=args.config, mtp=args.mtp)
    except NoMTPLayerError:
        raise ChatError(f"--mtp: {path} holds no multi-token-prediction (MTP) layer; run without --mtp") from None
    for warning in caught:
        if issubclass(warning.category, PositionLimitWarning):
            print(f"dsv3-chat: --max-seq-len: {warning.message}", file=sys.stderr, flush=True)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    args.max_seq_len = model.args.max_seq_len  # the window load chose (--max-seq-len, cut to the trained positions)
    if args.top_k > model.args.vocab_size:
        raise ChatError(f"--top-k {args.top_k} exceeds the model's vocabulary of {model.args.vocab_size} tokens")
    return model, tokenizer


def run_interactive(args: argparse.Namespace, console: Console) -> None:

    model, tokenizer = load_model(args, batch=1)
    chat = tokenizer.chat_template is not None
    if console.leader:
        how = "/clear empties the history" if chat else "no chat template: each line is completed as raw text"
        print(f"dsv3-chat: {banner(args)}; {devices_used(model, args.num_devices)}; {how}, /exit quits",
              file=sys.stderr, flush=True)
    # one attention window for the whole session: every turn reuses one compiled decode step
    options = dict(top_k=args.top_k, top_p=args.top_p, window=args.max_seq_len)
    compiled_buckets = set()

    def compile_for(prompt: list[int]) -> None:
        """Compile the prefill of a new prompt-length bucket before the turn is timed."""
        bucket = Plan.make([len(prompt)], args.max_new_tokens, args.max_seq_len, window=args.max_seq_len).bucket
        if bucket not in compiled_buckets:
            warm_up(model, [len(prompt)], args.max_new_tokens, mtp=args.mtp, **options)
            compiled_buckets.add(bucket)

    compile_for(prompt_ids(tokenizer, "Hello!"))
    messages: list[dict[str, str]] = []
    turn = 0
    while True:
        line = console.read_line(">>> ")
        if line is None or line.strip() == "/exit":
            return
        if line.strip() == "/clear":
            messages.clear()
            continue
        if not line.strip():
            continue
        if not chat:
            messages.clear()  # completion: every line stands alone
        messages.append({"role": "user", "content": line})
        prompt = (tokenizer.apply_chat_template(messages, add_generation_prompt=True) if chat
                  else tokenizer.encode(line))
        if len(prompt) >= args.max_seq_len:
            messages.pop()
            console.write(f"the conversation has {len(prompt)} tokens and leaves no room for an answer within "
                          f"--max-seq-len={args.max_seq_len}: /clear it\n")
            continue
        compile_for(prompt)
        printer, timing = StreamPrinter(tokenizer, console), Timing()
        completion = generate(model, [prompt], args.max_new_tokens, tokenizer.eos_id, args.temperature,
                              args.seed + turn, on_tokens=printer if console.leader else None,
                              timing=timing, mtp=args.mtp, **options)[0]
        answer = printer.finish(completion)
        console.write(f"{timing}\n")
        note_cut(console, args, "the answer", prompt, completion)
        messages.append({"role": "assistant", "content": answer})
        turn += 1


def read_prompts(path: Path, console: Console) -> list[str]:
    text, problem = None, "process 0 could not read it"
    if console.leader:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            problem = err.strerror or str(err)
        except UnicodeDecodeError:
            problem = "not UTF-8 text"
    text = console.share(text)
    if text is None:
        raise ChatError(f"cannot read --input-file {path}: {problem}")
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ChatError(f"--input-file {path} holds no prompts")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise ChatError(f"--input-file {path} holds {len(prompts)} prompts, at most {MAX_BATCH_PROMPTS} are allowed")
    return prompts


def run_batch(args: argparse.Namespace, console: Console) -> None:

    prompts = read_prompts(args.input_file, console)
    model, tokenizer = load_model(args, batch=len(prompts))
    tokens = [prompt_ids(tokenizer, p) for p in prompts]
    for number, (prompt, ids) in enumerate(zip(prompts, tokens), 1):
        if len(ids) >= args.max_seq_len:
            raise ChatError(f"prompt {number} ({prompt[:40]!r}) has {len(ids)} tokens and leaves no room for a "
                            f"completion within --max-seq-len={args.max_seq_len}")
    warm_up(model, [len(t) for t in tokens], args.max_new_tokens, top_k=args.top_k, top_p=args.top_p, mtp=args.mtp)
    timing = Timing()
    completions = generate(model, tokens, args.max_new_tokens, tokenizer.eos_id, args.temperature,
                           args.seed, top_k=args.top_k, top_p=args.top_p, timing=timing, mtp=args.mtp)
    for number, (prompt, ids, completion) in enumerate(zip(prompts, tokens, completions), 1):
        console.write(f"Prompt: {prompt}\nCompletion: {tokenizer.decode(completion)}\n\n")
        note_cut(console, args, f"completion {number}", ids, completion)
    console.note(str(timing))


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """One user turn through the chat template, or the raw text (after BOS) when there is none."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(text)
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def run_complete(args: argparse.Namespace, console: Console) -> None:
    """Print the prompt, then stream its continuation (raw text, no chat template), then the timing."""
    text = console.read_all() if args.prompt is None else args.prompt
    text = text.rstrip("\n")
    if not text.strip():
        raise ChatError("--complete: the prompt is empty")
    model, tokenizer = load_model(args, batch=1)
    if console.leader:
        print(f"dsv3-chat: {banner(args)}; {devices_used(model, args.num_devices)}", file=sys.stderr, flush=True)
    ids = tokenizer.encode(text)
    if len(ids) >= args.max_seq_len:
        raise ChatError(f"the prompt has {len(ids)} tokens and leaves no room for a completion within "
                        f"--max-seq-len={args.max_seq_len}")
    warm_up(model, [len(ids)], args.max_new_tokens, top_k=args.top_k, top_p=args.top_p, mtp=args.mtp)
    console.write(text)
    printer = StreamPrinter(tokenizer, console)
    timing = Timing()
    completion = generate(model, [ids], args.max_new_tokens, tokenizer.eos_id, args.temperature,
                          args.seed, top_k=args.top_k, top_p=args.top_p,
                          on_tokens=printer if console.leader else None, timing=timing, mtp=args.mtp)[0]
    printer.finish(completion)
    note_cut(console, args, "the completion", ids, completion)
    console.note(str(timing))


def chat(argv: list[str] | None = None) -> None:
    warnings.simplefilter("ignore", MaxSeqLenWarning)  # note_cut says it in the flags' words
    args = parse_args(argv)
    start_distributed(args)
    check_paths_and_devices(args)
    console = Console()
    check_same_settings(args, console)
    if args.interactive:
        run_interactive(args, console)
    elif args.complete:
        run_complete(args, console)
    else:
        run_batch(args, console)


def main(argv: list[str] | None = None) -> int:
    return run_cli("dsv3-chat", chat, argv)
