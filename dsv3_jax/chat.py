"""The chat CLI (`python -m dsv3_jax.chat`, installed as `dsv3-chat`), after the reference's generate.py.

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
import hashlib
import io
import os
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from .api import NoMTPLayerError, load
from .cli import ArgumentParser, one_line, run_cli
from .generate import MaxSeqLenWarning, Plan, Timing, generate, warm_up
from .options import add_flags, from_flags
from .speculative import generate_mtp, warm_up_mtp
from .tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_CHECKPOINT = ASSETS / "demo"  # see assets/demo/MODEL_CARD.md
TINY_CHECKPOINT = ASSETS / "tiny"
BANNERS = {
    DEFAULT_CHECKPOINT: "the embedded demo model: DeepSeek-V3 architecture (MLA, MoE, MTP), 11.3M parameters, "
                        "trained for 3 minutes on one H200 on the Python 3.12 standard library (held-out "
                        "perplexity 11.1); a Python code completer, not a chat model",
    TINY_CHECKPOINT: "the embedded tiny model (random layers: expect babble)",
}
MAX_BATCH_PROMPTS = 8


class ChatError(ValueError):
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
    parser.add_argument("--num-devices", type=int, default=None, help="devices of the mesh (default: all, "
                        "over all processes)")
    add_flags(parser)
    parser.add_argument("--max-seq-len", type=int, default=4096,
                        help="tokens of a conversation (prompt + answer) the cache holds")
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
    if args.max_seq_len < 1:
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
    keep_native_output_off_stdout()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(address, processes, process_id)
    except ValueError as err:  # what neither the flags nor a cluster manager jax knows supplied
        missing = [f"{flag} (or {variable})" for flag, variable, value in (
            ("--coordinator-address", "JAX_COORDINATOR_ADDRESS", address),
            ("--num-processes", "JAX_NUM_PROCESSES", processes), ("--process-id", "JAX_PROCESS_ID", process_id))
            if value is None]
        hint = f": give {' and '.join(missing)}" if missing else ""
        raise ChatError(f"cannot start a multi-process run ({one_line(err)}){hint}") from None


def keep_native_output_off_stdout() -> None:
    """Point file descriptor 1 at stderr and keep `sys.stdout` on the real standard output: native
    libraries write there (gloo reports every connection), which would land inside the answers."""
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(io.FileIO(stdout, "w"), encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                                  line_buffering=True)


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
        line, undecodable = None, False
        if self.leader:
            try:
                line = input(prompt)
            except EOFError:
                print(flush=True)
            except UnicodeDecodeError:
                undecodable = True
                print(flush=True)
            else:
                # a terminal's surrogate-escaped bytes are no text either, and the tokenizer rejects them
                undecodable = not _is_text(line)
                line = None if undecodable else line
        line = self.share(line)  # the others end their input too rather than wait for a turn
        if undecodable:
            raise ChatError("standard input is not UTF-8 text")
        return line

    def read_all(self) -> str:
        """All of standard input (process 0's, shared), which must be UTF-8 text."""
        text, undecodable = None, False
        if self.leader:
            try:
                text = sys.stdin.read()
            except UnicodeDecodeError:
                undecodable = True
            else:  # surrogate-escaped bytes (a C locale's stdin) are no text either
                undecodable = not _is_text(text)
            text = None if undecodable else text
        text = self.share(text)
        if text is None:
            raise ChatError("standard input is not UTF-8 text")
        return text

    def write(self, text: str) -> None:
        if self.leader:
            sys.stdout.write(text)
            sys.stdout.flush()

    def note(self, text: str) -> None:
        """One line on stderr, beside the conversation or the completions."""
        if self.leader:
            print(text, file=sys.stderr, flush=True)


def _is_text(line: str) -> bool:
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
        model = load(path, options=from_flags(args), num_devices=args.num_devices or jax.device_count(),
                     max_batch_size=batch, max_seq_len=args.max_seq_len, config=args.config, mtp=args.mtp)
    except NoMTPLayerError:
        raise ChatError(f"--mtp: {path} holds no multi-token-prediction (MTP) layer; run without --mtp") from None
    if args.top_k > model.args.vocab_size:
        raise ChatError(f"--top-k {args.top_k} exceeds the model's vocabulary of {model.args.vocab_size} tokens")
    return model, tokenizer


def run_interactive(args: argparse.Namespace, console: Console) -> None:

    model, tokenizer = load_model(args, batch=1)
    chat = tokenizer.chat_template is not None
    if console.leader:
        how = "/clear empties the history" if chat else "no chat template: each line is completed as raw text"
        print(f"dsv3-chat: {banner(args)}; on {model.mesh.devices.size} device(s); {how}, /exit quits",
              file=sys.stderr, flush=True)
    # one attention window for the whole session: every turn reuses one compiled decode step
    options = dict(top_k=args.top_k, top_p=args.top_p, window=args.max_seq_len)
    compiled_buckets = set()

    def compile_for(prompt: list[int]) -> None:
        """Compile the prefill of a new prompt-length bucket before the turn is timed."""
        bucket = Plan.make([len(prompt)], args.max_new_tokens, args.max_seq_len, window=args.max_seq_len).bucket
        if bucket not in compiled_buckets:
            warm_up_for(args)(model, [len(prompt)], args.max_new_tokens, **options)
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
        completion = generate_for(args)(model, [prompt], args.max_new_tokens, tokenizer.eos_id, args.temperature,
                                        args.seed + turn, on_tokens=printer if console.leader else None,
                                        timing=timing, **options)[0]
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
    warm_up_for(args)(model, [len(t) for t in tokens], args.max_new_tokens, top_k=args.top_k, top_p=args.top_p)
    timing = Timing()
    completions = generate_for(args)(model, tokens, args.max_new_tokens, tokenizer.eos_id, args.temperature,
                                     args.seed, top_k=args.top_k, top_p=args.top_p, timing=timing)
    for number, (prompt, ids, completion) in enumerate(zip(prompts, tokens, completions), 1):
        console.write(f"Prompt: {prompt}\nCompletion: {tokenizer.decode(completion)}\n\n")
        note_cut(console, args, f"completion {number}", ids, completion)
    console.note(str(timing))


def generate_for(args: argparse.Namespace):
    """The generation loop the flags ask for: speculative with --mtp, plain otherwise."""
    return generate_mtp if args.mtp else generate


def warm_up_for(args: argparse.Namespace):
    """The compile-ahead that goes with `generate_for(args)`."""
    return warm_up_mtp if args.mtp else warm_up


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
        print(f"dsv3-chat: {banner(args)}; on {model.mesh.devices.size} device(s)", file=sys.stderr, flush=True)
    ids = tokenizer.encode(text)
    if len(ids) >= args.max_seq_len:
        raise ChatError(f"the prompt has {len(ids)} tokens and leaves no room for a completion within "
                        f"--max-seq-len={args.max_seq_len}")
    warm_up_for(args)(model, [len(ids)], args.max_new_tokens, top_k=args.top_k, top_p=args.top_p)
    console.write(text)
    printer = StreamPrinter(tokenizer, console)
    timing = Timing()
    completion = generate_for(args)(model, [ids], args.max_new_tokens, tokenizer.eos_id, args.temperature,
                                    args.seed, top_k=args.top_k, top_p=args.top_p,
                                    on_tokens=printer if console.leader else None, timing=timing)[0]
    printer.finish(completion)
    note_cut(console, args, "the completion", ids, completion)
    console.note(str(timing))


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


if __name__ == "__main__":
    sys.exit(main())
