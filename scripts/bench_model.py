"""Benchmark prefill and decode of a DeepSeek model with random weights made on the device(s).

For every decode figure it prints the memory floor beside it: the bytes a step must read (active
weights plus the cache actually attended) over the H200's measured HBM copy rate (4.3 TB/s), and
over the rate of a jitted `a + 1` copy measured in the same run (noisy). Writes
benchmarks/model-<gpu>-<config>.json and .md.

    python scripts/bench_model.py --config configs/config_16B.json
    python scripts/bench_model.py --config config_671B.json --layers 4 --gemm-impl fp8

Several devices: --num-devices N, and --layouts (a comma list of dsv3_jax.sharding.PRESETS) to
time each way of splitting the model in one run (the weights are resharded between layouts):

    python scripts/bench_model.py --config configs/config_16B.json --num-devices 2 --layouts tp,dp-attn,ep-only

Several processes (one per GPU): start it once per process with --coordinator-address,
--num-processes and --process-id (or the JAX_* variables); the mesh spans every process's devices
and process 0 prints and writes the results.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

import dsv3_jax
from dsv3_jax.cli.common import leave_distributed_run
from dsv3_jax.cli.distributed import start_distributed
from dsv3_jax.config import ModelArgs
from dsv3_jax.options import add_flags, choices, from_flags
from dsv3_jax.checkpoint.schema import abstract_state
from dsv3_jax.sharding import Layout, parameter_bytes_per_device


def option_list(name: str):
    """An argparse type: a comma list of RunOptions field `name`'s allowed values."""
    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        bad = [v for v in values if v not in choices(name)]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{name}: {bad or text!r} not among {choices(name)}")
        return values
    return parse


HBM_BYTES_PER_S = 4.3e12  # an H200's device-to-device copy rate, read + write counted (measured)


def copy_bandwidth(device) -> float:
    """Device-to-device copy rate in bytes/s (read + write counted), 2 GiB buffers."""
    x = jax.device_put(jnp.ones((1 << 29,), jnp.float32), device)
    copy = jax.jit(lambda a: a + 1)
    copy(x).block_until_ready()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / float(np.median(times))


def weights_read(args: ModelArgs, roles: dict[str, float], tokens: int) -> float:
    """Bytes of the weights `roles` (`parameter_bytes_per_device`) a step of `tokens` tokens must read: every
    weight but the embedding once, and of the routed experts the distinct ones the tokens choose (expected
    under uniform routing)."""
    k, experts = args.n_activated_experts, args.n_routed_experts
    chosen = 1 - (1 - k / experts) ** tokens if experts else 0.0
    return (sum(v for role, v in roles.items() if role not in ("embedding", "routed experts"))
            + roles.get("routed experts", 0.0) * chosen)


def cache_bytes(args: ModelArgs, batch: int, context: int, dtype_bytes: int) -> float:
    """Bytes of one layer's latent cache rows that `batch` rows of `context` positions attend to."""
    return batch * context * (args.kv_lora_rank + args.qk_rope_head_dim) * dtype_bytes


def decode_bytes(args: ModelArgs, batch: int, context: int, dtype_bytes: int, tokens_per_row: int = 1) -> float:
    """Fewest bytes one decode step of `tokens_per_row` tokens a row must read: its weights (`weights_read`)
    and the cache rows attended."""
    w = parameter_bytes_per_device(abstract_state(args, jnp.bfloat16), Layout())
    return (weights_read(args, w, batch * tokens_per_row)
            + args.n_layers * cache_bytes(args, batch, context, dtype_bytes))


def prefill_flops(args: ModelArgs, batch: int, length: int) -> float:
    """Matmul FLOPs of a prefill (2 per multiply-add), attention scores included (causal half)."""
    w = parameter_bytes_per_device(abstract_state(args.replace(dtype="bf16"), jnp.bfloat16), Layout())
    per_token = sum(w.get(role, 0.0) for role in ("attention", "dense MLP", "shared experts", "gate", "head"))
    per_token += w.get("routed experts", 0.0) * args.n_activated_experts / args.n_routed_experts
    per_token /= 2  # bf16 bytes -> elements
    attn = args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * length / 2
    return 2 * batch * length * (per_token + attn)


def timed(fn, repeats: int) -> float:
    """Median wall time of fn() (already compiled) over `repeats` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_prefill(model, batch: int, length: int, repeats: int) -> dict:
    # host inputs are numpy (the same on every process), which jit places on a mesh spanning processes
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.args.vocab_size, (batch, length)).astype(np.int32)
    start = np.zeros((batch,), np.int32)
    last = np.full((batch,), length - 1, np.int32)
    window = dsv3_jax.cache_window(length, model.args.max_seq_len)

    def run():
        logits, model.cache = model.step(model.state, model.cache, tokens, start, last, kv_len=window)
        return logits

    t0 = time.perf_counter()
    jax.block_until_ready(run())
    first = time.perf_counter() - t0
    seconds = timed(run, repeats)
    return {"batch": batch, "length": length, "seconds": seconds, "tok_per_s": batch * length / seconds,
            "compile_s": max(0.0, first - seconds)}


def bench_decode(model, batch: int, context: int, steps: int) -> dict:
    """`steps` decode steps after a prefill of `context` tokens, greedy tokens kept on the device.
    The prefill runs as `Model.forward` does, in steps of at most `--prefill-chunk` tokens a row: a large
    batch's prompt in one step would need the working set of batch x context tokens at once."""
    rng = np.random.default_rng(1)
    args = model.args
    prompt = rng.integers(0, args.vocab_size, (batch, context)).astype(np.int32)
    window = dsv3_jax.cache_window(context + 2 * steps + 1, args.max_seq_len)
    zeros = jnp.zeros((batch,), jnp.int32)  # on the device, as generate() keeps them: no host argument a step
    greedy = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None])
    logits = model.forward(prompt)

    def decode(n, logits, position):
        for _ in range(n):
            token = greedy(logits)
            logits, model.cache = model.step(model.state, model.cache, token, position, zeros, kv_len=window)
            position = position + 1
        return logits, position

    position = zeros + context
    t0 = time.perf_counter()
    logits, position = decode(1, logits, position)
    jax.block_until_ready(logits)
    first = time.perf_counter() - t0
    logits, position = decode(4, logits, position)  # warm-up
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    logits, position = decode(steps, logits, position)
    jax.block_until_ready(logits)
    per_step = (time.perf_counter() - t0) / steps
    return {"batch": batch, "context": context, "steps": steps, "ms_per_step": per_step * 1e3,
            "tok_per_s": batch / per_step, "compile_s": max(0.0, first - per_step)}


def bench_generate(model, batch: int, context: int, steps: int, pairs: int = 3) -> dict:
    """Per-token time of `Model.generate` (greedy, sampling and the host loop included): the
    difference of two timed calls of 8 and 8 + `steps` new tokens, so the prefill cancels; the median
    of `pairs` such differences, so that one slow call (the host's, not the GPU's) does not set it."""
    rng = np.random.default_rng(2)
    prompts = rng.integers(0, model.args.vocab_size, (batch, context)).tolist()

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(prompts, new_tokens, -1, 0.0)
        return time.perf_counter() - start

    run(8 + steps)  # compiles the prefill and the decode step of this window
    per_token = float(np.median([run(8 + steps) - run(8) for _ in range(pairs)])) / steps
    return {"generate_ms_per_token": per_token * 1e3, "generate_tok_per_s": batch / per_token}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a reference JSON config")
    parser.add_argument("--layers", type=int, help="cut the model to this many layers (dense first)")
    parser.add_argument("--dense-layers", type=int, help="with --layers: how many of them are dense")
    parser.add_argument("--weights", choices=("bf16", "fp8"), help="weight storage (default: the config's dtype)")
    add_flags(parser, skip=("moe_impl", "decode_attn", "layout"))
    parser.add_argument("--num-devices", type=int, default=1)
    parser.add_argument("--layouts", default="tp", type=option_list("layout"),
                        help=f"layouts to time, a comma list of {','.join(choices('layout'))}")
    parser.add_argument("--moe-impls", default="auto", type=option_list("moe_impl"),
                        help=f"routed-expert paths to time, a comma list of {','.join(choices('moe_impl'))}")
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--prefill-batches", default="1,8")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache before decoding")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                        help="time Model.generate beside each decode step (each of its timed calls prefills every "
                             "row again)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-attns", default="auto", type=option_list("decode_attn"),
                        help=f"decode attention paths to time, a comma list of {','.join(choices('decode_attn'))}")
    parser.add_argument("--tag", default="", help="suffix for the output file names")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-process)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    opts = parser.parse_args(argv)
    opts.decode_batches = [int(b) for b in opts.decode_batches.split(",") if b]
    opts.prefill_batches = [int(b) for b in opts.prefill_batches.split(",") if b]
    return opts


def model_args(opts: argparse.Namespace) -> ModelArgs:
    """The config, cut to --layers and sized for the batches and lengths timed."""
    args = ModelArgs.from_reference_json(opts.config)
    changes = dict(max_batch_size=max(opts.decode_batches + opts.prefill_batches),
                   max_seq_len=max(opts.prefill_len, opts.context + 2 * opts.steps + 8))
    if opts.layers:
        changes.update(n_layers=opts.layers, n_dense_layers=min(args.n_dense_layers if opts.dense_layers is None
                                                                 else opts.dense_layers, opts.layers))
    if opts.weights:
        changes["dtype"] = opts.weights
    return args.replace(**changes)


def generate_cell(row: dict) -> str:
    """A decode row's `generate()` column: ms a token and its ratio to the step, or "-" where not timed."""
    if "generate_ms_per_token" not in row:
        return "-"
    return f"{row['generate_ms_per_token']:.3f} ({row['generate_over_step']:.2f}x)"


def save(bench: SimpleNamespace, final: bool = False) -> None:
    """Write the rows so far (after every row: a run cut short keeps what it measured); at the
    end also print the table."""
    if not bench.leader:
        return
    args, options, device, model, bandwidth = bench.args, bench.options, bench.device, bench.model, bench.bandwidth
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use", 0)
    record = {
        "gpu": device.device_kind, "devices": model.mesh.devices.size, "config": Path(bench.opts.config).name,
        "layers": args.n_layers, "dense_layers": args.n_dense_layers, "weights": args.dtype,
        "gemm_impl": options.gemm_impl, "attn_impl": options.attn_impl, "jax": jax.__version__,
        "python": platform.python_version(), "date": datetime.date.today().isoformat(),
        "copy_bandwidth_tb_s": bandwidth / 1e12, "build_s": bench.build_s, "peak_device_bytes": peak,
        "rows": bench.rows, "processes": jax.process_count(), "complete": final,
    }
    bench.out.mkdir(parents=True, exist_ok=True)
    (bench.out / f"{bench.stem}.json").write_text(json.dumps(record, indent=2))
    lines = [f"# {bench.name}: {args.n_layers} layers, {args.dtype} weights, gemm_impl {options.gemm_impl}",
             "", f"{device.device_kind} x{model.mesh.devices.size} ({jax.process_count()} process(es)), jax {jax.__version__}, {record['date']}; "
             f"in-run copy bandwidth {bandwidth / 1e12:.2f} TB/s; peak device memory {peak / 2**30:.1f} GiB", "",
             f"| run | tok/s | ms/step | bytes/step | floor at {HBM_BYTES_PER_S / 1e12:.1f} TB/s | GB/s | % of floor | "
             "generate() ms/token | compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in bench.rows:
        if r["kind"] == "prefill":
            lines.append(f"| prefill {r['batch']}x{r['length']} ({r['moe_impl']}, {r['decode_attn']}, {r['layout']}) | {r['tok_per_s']:,.0f} | {r['seconds'] * 1e3:.2f} | "
                         f"- | - | - | {r['tflops']:.0f} TFLOP/s | - | {r['compile_s']:.1f} |")
        else:
            lines.append(f"| decode b={r['batch']} ({r['moe_impl']}, {r['decode_attn']}, {r['layout']}) | {r['tok_per_s']:,.1f} | {r['ms_per_step']:.3f} | "
                         f"{r['bytes_per_step'] / 1e9:.2f} GB | {r['floor_ms']:.3f} ms | {r['achieved_gb_s']:,.0f} | "
                         f"{r['pct_roofline']:.0f}% | {generate_cell(r)} | {r['compile_s']:.1f} |")
    (bench.out / f"{bench.stem}.md").write_text("\n".join(lines) + "\n")
    if final:
        print("\n".join(lines))


def bench_variant(bench: SimpleNamespace, runner, tag: str, **variant) -> None:
    """Time prefill and decode (and generate) at every batch for one (layout, moe_impl, decode_attn)."""
    opts, args, say = bench.opts, bench.args, bench.say
    devices = bench.model.mesh.devices.size
    for batch in opts.prefill_batches:
        result = bench_prefill(runner, batch, opts.prefill_len, opts.repeats)
        flops = prefill_flops(args, batch, opts.prefill_len)
        result.update(kind="prefill", **variant, devices=devices, tflops=flops / result["seconds"] / 1e12)
        bench.rows.append(result)
        save(bench)
        say(f"prefill b={batch} x {opts.prefill_len} {tag}: {result['tok_per_s']:,.0f} tok/s "
            f"({result['seconds'] * 1e3:.2f} ms, {result['tflops']:.0f} TFLOP/s, "
            f"compile {result['compile_s']:.1f} s)", flush=True)
    for batch in opts.decode_batches:
        result = bench_decode(runner, batch, opts.context, opts.steps)
        context = opts.context + opts.steps // 2
        bytes_read = decode_bytes(args, batch, context, 2) / opts.num_devices
        floor_ms = bytes_read / HBM_BYTES_PER_S * 1e3
        in_run_floor_ms = bytes_read / bench.bandwidth * 1e3
        result.update(kind="decode", **variant, devices=devices, bytes_per_step=bytes_read, floor_ms=floor_ms,
                      floor_ms_in_run_copy=in_run_floor_ms,
                      achieved_gb_s=bytes_read / (result["ms_per_step"] / 1e3) / 1e9,
                      pct_roofline=100 * floor_ms / result["ms_per_step"])
        # saved and printed before generate() is timed, so that a run cut short by a time limit keeps the step
        bench.rows.append(result)
        save(bench)
        say(f"decode b={batch} {tag}: {result['tok_per_s']:,.1f} tok/s, {result['ms_per_step']:.3f} "
            f"ms/step (floor {floor_ms:.3f} ms = {bytes_read / 1e9:.2f} GB at {HBM_BYTES_PER_S / 1e12:.1f} TB/s, "
            f"{result['pct_roofline']:.0f}% of it; {in_run_floor_ms:.3f} ms at the in-run copy rate "
            f"{bench.bandwidth / 1e12:.2f} TB/s; compile {result['compile_s']:.1f} s)", flush=True)
        if not opts.generate:
            continue
        result.update(bench_generate(runner, batch, opts.context, opts.steps))
        result["generate_over_step"] = result["generate_ms_per_token"] / result["ms_per_step"]
        save(bench)
        say(f"generate b={batch} {tag}: {result['generate_tok_per_s']:,.1f} tok/s, "
            f"{result['generate_ms_per_token']:.3f} ms/token ({result['generate_over_step']:.2f}x the step)",
            flush=True)


def main() -> None:
    opts = parse_args()
    options = from_flags(opts)
    start_distributed(opts)
    leader = jax.process_index() == 0
    say = print if leader else (lambda *a, **k: None)
    args = model_args(opts)
    device = jax.local_devices()[0]
    bandwidth = copy_bandwidth(device)
    say(f"device {device.device_kind}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")

    t0 = time.perf_counter()
    model = dsv3_jax.build(args, seed=0, options=dsv3_jax.RunOptions.make(options, layout=opts.layouts[0]),
                           num_devices=opts.num_devices)
    jax.block_until_ready(model.state)
    build_s = time.perf_counter() - t0
    params = sum(x.size for x in jax.tree.leaves(model.state))
    say(f"built {args.n_layers} layers ({params / 1e9:.2f} G parameters, {args.dtype} weights) in {build_s:.1f} s")
    name = Path(opts.config).stem.replace("config_", "")
    gpu = device.device_kind.lower().replace("nvidia ", "").replace(" ", "-")
    bench = SimpleNamespace(opts=opts, args=args, options=options, device=device, bandwidth=bandwidth, model=model,
                            build_s=build_s, leader=leader, say=say, rows=[], name=name, out=Path(opts.out_dir),
                            stem=f"model-{gpu}-{name}{'-' + opts.tag if opts.tag else ''}")
    variants = [(lay, m, a) for lay in opts.layouts for m in opts.moe_impls for a in opts.decode_attns]
    for layout, moe_impl, decode_attn in variants:
        model.cache = None  # one cache at a time on the device
        runner = dsv3_jax.Model(args, model.graphdef, model.state, model.mesh,
                                dsv3_jax.RunOptions.make(options, moe_impl=moe_impl, decode_attn=decode_attn,
                                                         layout=layout))
        model.state = runner.state  # the weights as this layout splits them (the previous split freed)
        bench_variant(bench, runner, f"moe={moe_impl} attn={decode_attn} layout={layout}",
                      moe_impl=moe_impl, decode_attn=decode_attn, layout=layout)
        runner.cache = None
    save(bench, final=True)


if __name__ == "__main__":
    main()
    if jax.distributed.is_initialized():
        leave_distributed_run(0)
