"""The OpenAI-compatible server (`python -m dsv3_jax.serve`, installed as `dsv3-serve`).

    dsv3-serve                                   # the embedded demo model on 127.0.0.1:8000
    dsv3-serve --ckpt-path DIR --max-batch-size 32 --port 8080
    dsv3-serve --random-config configs/config_16B.json --max-batch-size 64   # random weights (benchmarks)

Serves POST /v1/completions and /v1/chat/completions (streamed with "stream": true), GET
/v1/models, /health and /metrics. Requests share the model through continuous batching: each
gets a cache row of its own (--max-batch-size rows, --max-seq-len tokens each), prompts are
prefilled --prefill-chunk tokens at a time between decode steps, and a request waits in a queue
of --max-queue when every row is taken (beyond it: 429). Checkpoints load as in `dsv3-chat`.
--mtp decodes speculatively with the checkpoint's MTP layer. Several processes: start the same
command once per process with --coordinator-address/--num-processes/--process-id (or the JAX_*
variables, as `dsv3-chat`); process 0 serves HTTP and shares each scheduler iteration's plan with
the others, which run the same steps on their part of the mesh and end when process 0 stops.
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import jax

from .chat import ChatError, banner, check_paths_and_devices, checkpoint_path, load_model
from ..api import build
from ..config import ModelArgs
from ..options import add_flags, from_flags
from ..serving.engine import Engine
from ..serving.plan import PlanChannel, follow
from ..serving.random_model import IdTokenizer
from ..serving.speculative import SpeculativeEngine
from .common import ArgumentParser, devices_used, run_cli
from .distributed import Console, check_same_settings, start_distributed

DEFAULT_PORT = 8000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="dsv3-serve", description="Serve a DeepSeek-V3 model over the OpenAI API.")
    parser.add_argument("--ckpt-path", type=Path, default=None,
                        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files); "
                             "default: the embedded demo model (a Python code completer)")
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny model with random layers (tests)")
    parser.add_argument("--config", type=Path, default=None,
                        help="model config (reference or Hugging Face JSON); default: the checkpoint's config.json")
    parser.add_argument("--random-config", type=Path, default=None,
                        help="serve a model with random weights built from this config (benchmarks; token-id "
                             "prompts, its text is the token ids)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the checkpoint directory's or config's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--max-batch-size", type=int, default=8, help="cache rows: requests generating at once")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="tokens of one request (prompt + completion)")
    parser.add_argument("--prefill-rows", type=int, default=1, help="rows prefilled together per iteration")
    parser.add_argument("--decode-buckets", default=None,
                        help="comma list of decode batch sizes to compile (default: powers of two up to "
                             "--max-batch-size)")
    parser.add_argument("--min-window", type=int, default=0,
                        help="smallest attention window of a step; --max-seq-len compiles one window only")
    parser.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a row")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body")
    parser.add_argument("--num-devices", type=int, default=None,
                        help="devices of the mesh (default: all; on one process, the most that the model's "
                             "dimensions divide into)")
    parser.add_argument("--seed", type=int, default=0, help="--random-config: the weights' seed")
    parser.add_argument("--mtp", action="store_true", help="speculative decoding with the checkpoint's "
                        "multi-token-prediction layer (one draft token per row and step; same outputs when greedy, "
                        "the same distribution when sampling)")
    parser.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-process)")
    parser.add_argument("--num-processes", type=int, default=None, help="processes of a multi-process run")
    parser.add_argument("--process-id", type=int, default=None,
                        help="this process's index in [0, --num-processes); process 0 serves HTTP")
    # prompts prefilled 512 tokens a row per scheduler iteration: a long prompt delays the running rows'
    # next token by one short step at a time
    add_flags(parser, defaults={"prefill_chunk": 512})
    parser.set_defaults(top_k=0)  # what chat's loader reads
    args = parser.parse_args(argv)
    for name in ("max_batch_size", "max_seq_len", "prefill_rows", "max_queue", "max_body_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.port < 65536:
        parser.error(f"--port must lie in [1, 65535], got {args.port}")
    if args.num_devices is not None and args.num_devices < 1:
        parser.error(f"--num-devices must be at least 1, got {args.num_devices}")
    if sum(x is not None and x is not False for x in (args.tiny, args.ckpt_path, args.random_config)) > 1:
        parser.error("--tiny, --ckpt-path and --random-config name different models: give one")
    args.decode_buckets = parse_buckets(parser, args.decode_buckets, args.max_batch_size)
    return args


def parse_buckets(parser, text: str | None, rows: int) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        buckets = tuple(sorted({int(b) for b in text.split(",") if b}))
    except ValueError:
        parser.error(f"--decode-buckets must be a comma list of integers, got {text!r}")
    if not buckets or buckets[0] < 1 or buckets[-1] != rows:
        parser.error(f"--decode-buckets must be positive and end at --max-batch-size={rows}, got {text!r}")
    return buckets


def load(args: argparse.Namespace):
    """(model, tokenizer, served name) as the flags ask."""
    if args.random_config is not None:
        if not args.random_config.is_file():
            raise ChatError(f"--random-config {args.random_config} is not a file")
        config = ModelArgs.from_file(args.random_config).replace(max_batch_size=args.max_batch_size,
                                                                max_seq_len=args.max_seq_len)
        model = build(config, options=from_flags(args), seed=args.seed, mtp=args.mtp,
                      num_devices=args.num_devices or "auto")
        return model, IdTokenizer(config.vocab_size), args.served_model_name or random_name(args.random_config)
    check_paths_and_devices(args)
    model, tokenizer = load_model(args, batch=args.max_batch_size)
    return model, tokenizer, args.served_model_name or checkpoint_path(args).name


def random_name(config: Path) -> str:
    """configs/config_16B.json -> "random-config_16B"; tiny/config.json -> "random-tiny"."""
    return "random-" + (config.parent.name if config.stem == "config" else config.stem)


def make_engine(args: argparse.Namespace, model) -> Engine:
    kind = SpeculativeEngine if args.mtp else Engine
    return kind(model, chunk=model.options.prefill_chunk, prefill_rows=args.prefill_rows,
                buckets=args.decode_buckets, min_window=args.min_window)


def serve(argv: list[str] | None = None) -> None:
    # the HTTP stack is the `serve` extra: imported only to serve, so that --help and flag errors need none of it
    import uvicorn

    from ..serving.app import Limits, Service, make_app

    args = parse_args(argv)
    start_distributed(args)
    console = Console()
    check_same_settings(args, console)
    model, tokenizer, name = load(args)
    engine = make_engine(args, model)
    channel = PlanChannel(engine.plan_codec, console.leader) if console.processes > 1 else None
    if not console.leader:  # another process: the same steps on its part of the mesh, no port
        follow(engine, channel)
        return
    service = Service(model, tokenizer, engine, model_name=name, max_queue=args.max_queue,
                      limits=Limits(max_body_bytes=args.max_body_bytes), channel=channel)
    what = f"random weights from {args.random_config}" if args.random_config else banner(args)
    spans = f" of {console.processes} processes" if console.processes > 1 else ""
    devices = devices_used(model, args.num_devices).removeprefix("on ")
    print(f"dsv3-serve: {what}; model name {name!r}; {args.max_batch_size} rows of {args.max_seq_len} tokens on "
          f"{devices}{spans}{'; MTP speculative decoding' if args.mtp else ''}; "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM (the scheduler stops, the other processes with it) and then
    # raises the signal again for the handler it found: a no-op, so that the run ends normally (status 0)
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(make_app(service), host=args.host, port=args.port, log_level="warning", access_log=False)


def main(argv: list[str] | None = None) -> int:
    return run_cli("dsv3-serve", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
