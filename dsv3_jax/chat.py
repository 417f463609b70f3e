"""The chat CLI (`python -m dsv3_jax.chat`, installed as `dsv3-chat`), after the reference's generate.py.

    dsv3-chat --interactive                      # the embedded tiny demo model, no download
    dsv3-chat --ckpt-path DIR --interactive      # a Hugging Face checkpoint directory with its tokenizer
    dsv3-chat --ckpt-path DIR --input-file prompts.txt

Interactive: `>>> ` reads a turn; `/exit` ends, `/clear` empties the history; the history goes
through the checkpoint's chat template, the answer is streamed as it is generated, then its
tokens/s. Batch: one prompt per line of --input-file, each a single user turn, printed as
"Prompt:" / "Completion:" pairs. Multi-process: start the same command once per process with
--coordinator-address/--num-processes/--process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID); the mesh spans every process's devices, only process 0 reads input and prints,
and it shares each input with the others.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from .api import load
from .config import ConfigError
from .generate import generate, warm_up
from .options import add_flags, from_flags
from .safetensors_io import CheckpointError
from .speculative import generate_mtp, warm_up_mtp
from .tokenizer import Tokenizer, TokenizerError

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "assets" / "tiny"
MAX_BATCH_PROMPTS = 8


class ChatError(Exception):
    """A problem the user can fix (bad flags, files, prompts); reported in one line."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsv3-chat", description="Chat with a DeepSeek-V3 model in JAX.")
    parser.add_argument("--ckpt-path", type=Path, default=None,
                        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files); "
                             "default: the embedded tiny demo model")
    parser.add_argument("--config", type=Path, default=None,
                        help="model config (reference or Hugging Face JSON); default: the checkpoint's config.json")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--input-file", type=Path, help="batch mode: one prompt per line")
    mode.add_argument("--interactive", action="store_true", help="interactive chat")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.2, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the first turn (turn i uses seed + i)")
    parser.add_argument("--num-devices", type=int, default=None, help="devices of the mesh (default: all, "
                        "over all processes)")
    add_flags(parser)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--mtp", action="store_true", help="speculative decoding with the checkpoint's "
                        "multi-token-prediction layer (one draft token per step; same outputs when greedy)")
    parser.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-process)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.temperature < 0:
        parser.error("--temperature must not be negative")
    if args.max_seq_len < 1:
        parser.error("--max-seq-len must be at least 1")
    return args


def start_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize when flags or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID ask for it (unset values are left to jax's cluster detection, e.g. SLURM)."""

    def setting(flag, variable):
        if flag is not None:
            return flag
        value = os.environ.get(variable)
        if value is None or variable == "JAX_COORDINATOR_ADDRESS":
            return value
        try:
            return int(value)
        except ValueError:
            raise ChatError(f"{variable}={value!r} is not an integer") from None

    address = setting(args.coordinator_address, "JAX_COORDINATOR_ADDRESS")
    processes = setting(args.num_processes, "JAX_NUM_PROCESSES")
    process_id = setting(args.process_id, "JAX_PROCESS_ID")
    if address is None and processes is None and process_id is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, processes, process_id)


class Console:
    """Terminal I/O of a run that may span processes: process 0 reads and prints, and every text
    it reads is broadcast so that all processes take the same turn."""

    def __init__(self):

        self.processes = jax.process_count()
        self.leader = jax.process_index() == 0

    def share(self, text: str | None) -> str | None:
        """Process 0's `text` (None for end of input) on every process."""
        if self.processes == 1:
            return text

        data = np.frombuffer(text.encode("utf-8"), np.uint8) if self.leader and text is not None else None
        size = np.array([-1 if data is None else data.size], np.int32) if self.leader else np.zeros(1, np.int32)
        size = int(np.asarray(multihost_utils.broadcast_one_to_all(size))[0])
        if size < 0:
            return None
        # padded to a power of two: the broadcast compiles once per size class, not once per turn
        buffer = np.zeros(max(64, 1 << (size - 1).bit_length()), np.uint8)
        if self.leader:
            buffer[:size] = data
        shared = np.asarray(multihost_utils.broadcast_one_to_all(buffer)).astype(np.uint8)
        return bytes(shared[:size]).decode("utf-8")

    def read_line(self, prompt: str) -> str | None:
        line = None
        if self.leader:
            try:
                line = input(prompt)
            except EOFError:
                print(flush=True)
        return self.share(line)

    def write(self, text: str) -> None:
        if self.leader:
            sys.stdout.write(text)
            sys.stdout.flush()


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


    path = args.ckpt_path or DEFAULT_CHECKPOINT
    tokenizer = Tokenizer.from_dir(path)
    if tokenizer.eos_id is None:
        raise ChatError(f"the tokenizer in {path} names no eos_token")
    model = load(path, options=from_flags(args), num_devices=args.num_devices or jax.device_count(),
                          max_batch_size=batch, max_seq_len=args.max_seq_len, config=args.config,
                          mtp=getattr(args, "mtp", False))
    return model, tokenizer


def run_interactive(args: argparse.Namespace, console: Console) -> None:

    model, tokenizer = load_model(args, batch=1)
    if console.leader:
        source = "the embedded tiny demo model (random layers: expect babble)" if args.ckpt_path is None \
            else str(args.ckpt_path)
        print(f"dsv3-chat: {source} on {model.mesh.devices.size} device(s); /clear empties the history, "
              "/exit quits", file=sys.stderr, flush=True)
    # one attention window for the whole session: every turn reuses one compiled decode step
    options = dict(top_k=args.top_k, top_p=args.top_p, window=args.max_seq_len)
    greeting = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}])
    if args.mtp:
        warm_up_mtp(model, [len(greeting)], args.max_new_tokens, **options)
    else:
        warm_up(model, [len(greeting)], args.max_new_tokens, **options)
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
        messages.append({"role": "user", "content": line})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if len(prompt) >= args.max_seq_len:
            messages.pop()
            console.write(f"the conversation has {len(prompt)} tokens and leaves no room for an answer within "
                          f"--max-seq-len={args.max_seq_len}: /clear it\n")
            continue
        printer = StreamPrinter(tokenizer, console)
        start = time.perf_counter()
        stats: dict = {}
        run = functools.partial(generate_mtp, stats=stats) if args.mtp else generate
        completion = run(model, [prompt], args.max_new_tokens, tokenizer.eos_id, args.temperature,
                         args.seed + turn, on_tokens=printer if console.leader else None, **options)[0]
        seconds = time.perf_counter() - start
        answer = printer.finish(completion)
        accepted = f", MTP acceptance {stats['acceptance']:.0%}" if args.mtp else ""
        console.write(f"[{len(completion)} tokens in {seconds:.2f} s, {len(completion) / seconds:.1f} tokens/s"
                      f"{accepted}]\n")
        messages.append({"role": "assistant", "content": answer})
        turn += 1


def read_prompts(path: Path, console: Console) -> list[str]:
    text = None
    if console.leader:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            console.write(f"dsv3-chat: error: cannot read --input-file {path}: {err}\n")
    text = console.share(text)
    if text is None:
        raise ChatError(f"cannot read --input-file {path}")
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ChatError(f"--input-file {path} holds no prompts")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise ChatError(f"--input-file {path} holds {len(prompts)} prompts, at most {MAX_BATCH_PROMPTS} are allowed")
    return prompts


def run_batch(args: argparse.Namespace, console: Console) -> None:

    prompts = read_prompts(args.input_file, console)
    model, tokenizer = load_model(args, batch=len(prompts))
    tokens = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for prompt, ids in zip(prompts, tokens):
        if len(ids) > args.max_seq_len:
            raise ChatError(f"prompt {prompt[:40]!r} has {len(ids)} tokens, more than --max-seq-len={args.max_seq_len}")
    (warm_up_mtp if args.mtp else warm_up)(model, [len(t) for t in tokens], args.max_new_tokens, top_k=args.top_k,
                                           top_p=args.top_p)
    completions = model.generate(tokens, args.max_new_tokens, tokenizer.eos_id, args.temperature, args.seed,
                                 top_k=args.top_k, top_p=args.top_p, mtp=args.mtp)
    for prompt, completion in zip(prompts, completions):
        console.write(f"Prompt: {prompt}\nCompletion: {tokenizer.decode(completion)}\n\n")


def check_same_settings(args: argparse.Namespace, console: Console) -> None:
    """Every process must run the same generation (they take each step together): compare a digest
    of the flags across processes, so that a mismatch is one clear error on every process rather
    than a hang at the first step that differs."""
    if console.processes == 1:
        return


    ignored = {"coordinator_address", "num_processes", "process_id"}
    settings = repr(sorted((k, str(v)) for k, v in vars(args).items() if k not in ignored))
    digest = np.frombuffer(hashlib.sha256(settings.encode()).digest()[:8], np.int32).copy()
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(console.processes, -1)
    differing = [i for i in range(console.processes) if not np.array_equal(every[i], every[0])]
    if differing:
        raise ChatError(f"processes {differing} were started with other flags than process 0; "
                        "every process needs the same command line")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    try:
        start_distributed(args)
        console = Console()
        check_same_settings(args, console)
        if args.interactive:
            run_interactive(args, console)
        else:
            run_batch(args, console)
    except (ChatError, ConfigError, CheckpointError, TokenizerError, ValueError, FileNotFoundError) as err:
        print(f"dsv3-chat: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
