"""Per-kernel GPU time of decode steps, from a jax.profiler trace (Perfetto JSON; no extra tools).

    PYTHONPATH=. python3 scripts/profile_step.py --config configs/config_16B.json --batch 1 --out benchmarks/x.json

Prints wall time and GPU-busy time per step, kernels per step, the top kernels by time, and the
time by named scope (the paper nouns the model marks with `jax.named_scope`, when the trace's
event arguments carry them). Writes the same as JSON with --out.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv3_jax
from dsv3_jax.config import ModelArgs
from dsv3_jax.decode.step import decode_step_parts, make_step

SCOPES = ("attn_norm", "ffn_norm", "attention", "gate", "routed_experts", "shared_experts", "mlp", "embed", "head",
          "norm")


def scope_of(label: str) -> str:
    """The innermost paper-noun scope named in an op's metadata path (or 'other')."""
    parts = re.split(r"[/:]", label)
    for part in reversed(parts):
        if part in SCOPES:
            return part
    return "other"


def scopes_of_instructions(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> paper-noun scope, from the `op_name` metadata of the compiled module (the
    trace names a kernel after its fusion or custom call; a fusion is credited to its instructions' scope)."""
    scopes: dict[str, str] = {}
    computation_scope: dict[str, str] = {}
    current = None
    for line in hlo_text.splitlines():
        header = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->.*\{\s*$", line)
        if header:
            current = header.group(1)
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if not m:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        scope = scope_of(op_name.group(1)) if op_name else "other"
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        if scope == "other" and calls:
            scope = computation_scope.get(calls.group(1), "other")
        scopes[m.group(1).replace(".", "_")] = scope  # the trace writes "fusion.7" as "fusion_7"
        # a Pallas kernel appears in the trace under its own name (a custom call's backend_config)
        kernel = re.search(r'\bname\s*=\s*"([\w.\-]+)"|"name"\s*:\s*"([\w.\-]+)"', line) if "custom-call" in line else None
        if kernel and scope != "other":
            scopes.setdefault(kernel.group(1) or kernel.group(2), scope)
        if current and scope != "other":
            computation_scope.setdefault(current, scope)
    return scopes


def gpu_events(run) -> list[dict]:
    """The GPU kernel events (Perfetto "X" events of a GPU process) of a jax.profiler trace around run()."""
    out = tempfile.mkdtemp()
    with jax.profiler.trace(out, create_perfetto_trace=True):
        run()
    trace = json.load(gzip.open(glob.glob(f"{out}/**/*.trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X" and "gpu" in names.get(e.get("pid"), "").lower()]


def launch_us(name: str | None, per_layer, layers: int, repeats: int, operands=None) -> float:
    """Mean GPU time (µs) of the kernels whose names start with `name` while a jit of per_layer(layer, operands) for
    each of `layers` layers runs `repeats` times; each layer's launch reads its own layer of the stacks (cold in L2).
    operands: the arrays per_layer reads, passed to the jit as arguments (arrays a closure holds are compiled into
    the program as constants, and a program over 2 GB does not compile). name None: every kernel of a layer's work
    together (several launches), a layer's mean."""
    many = jax.jit(lambda ops: [per_layer(jnp.int32(layer), ops) for layer in range(layers)])
    jax.block_until_ready(many(operands))
    jax.block_until_ready(many(operands))
    events = [e for e in gpu_events(lambda: [jax.block_until_ready(many(operands)) for _ in range(repeats)])
              if name is None or e["name"].startswith(name)]
    if name is not None and len(events) != layers * repeats:
        raise RuntimeError(f"{len(events)} '{name}' kernels traced, expected {layers * repeats}")
    return sum(e["dur"] for e in events) / (layers * repeats)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--layers", type=int, help="cut the model to this many layers (dense first)")
    p.add_argument("--dense-layers", type=int, help="with --layers: how many of them are dense")
    p.add_argument("--weights", choices=("bf16", "fp8"), help="weight storage (default: the config's dtype)")
    p.add_argument("--build-kwargs", default="{}", help="JSON of extra dsv3_jax.build keyword arguments")
    p.add_argument("--step", choices=("scanned", "unrolled"), default="scanned",
                   help="the step profiled: the model's own (layer scans as the build's options say), or the one "
                        "generate() decodes with (`decode_step_parts`: layer scans unrolled under decode graphs, on "
                        "by default on a GPU; without the command buffers, so each kernel is timed); the prompt is "
                        "prefilled through the model's own either way, as generate() prefills")
    p.add_argument("--hlo-out", default=None, help="write the step's compiled HLO here (gzipped)")
    p.add_argument("--pdl", choices=("on", "off"), default="on",
                   help="XLA's programmatic dependent launch; under it a kernel launched early counts its wait for "
                        "the launch before in its own duration, so per-kernel times want it off")
    p.add_argument("--out", default=None, help="write the profile as JSON here")
    return p.parse_args()


def model_args(o: argparse.Namespace) -> ModelArgs:
    """The config, sized for the run and cut to --layers, in --weights."""
    args = ModelArgs.from_reference_json(o.config).replace(max_batch_size=max(o.batch, 1),
                                                           max_seq_len=o.context + 64 + o.steps)
    if o.layers:
        dense = args.n_dense_layers if o.dense_layers is None else o.dense_layers
        args = args.replace(n_layers=o.layers, n_dense_layers=min(dense, o.layers))
    return args.replace(dtype=o.weights) if o.weights else args


def main() -> None:
    o = parse_args()
    if o.pdl == "off":  # read when the backend starts, at the first jax call below
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_enable_pdl=false".strip()
    args = model_args(o)
    model = dsv3_jax.build(args, seed=0, **json.loads(o.build_kwargs))
    prompt = np.random.default_rng(0).integers(0, args.vocab_size, (o.batch, o.context)).astype(np.int32)
    zeros = np.zeros((o.batch,), np.int32)
    window = dsv3_jax.cache_window(o.context + 16 + o.steps, args.max_seq_len)
    logits = model.forward(prompt)  # in steps of the build's prefill_chunk, as generate() prefills
    step = model.step if o.step == "scanned" else make_step(decode_step_parts(model.parts)[0])
    greedy = jax.jit(lambda l: jnp.argmax(l, -1).astype(jnp.int32)[:, None])
    state = {"logits": logits, "pos": zeros + o.context}

    def run(n):
        for _ in range(n):
            state["logits"], model.cache = step(model.state, model.cache, greedy(state["logits"]), state["pos"], zeros,
                                                kv_len=window)
            state["pos"] = state["pos"] + 1
        jax.block_until_ready(state["logits"])

    run(5)  # compile and warm up
    hlo = step.lower(model.state, model.cache, greedy(state["logits"]), state["pos"], zeros,
                     kv_len=window).compile().as_text()
    instruction_scope = scopes_of_instructions(hlo)
    if o.hlo_out:
        with gzip.open(o.hlo_out, "wt") as f:
            f.write(hlo)
    t0 = time.perf_counter()
    run(o.steps)
    wall = (time.perf_counter() - t0) / o.steps  # timed outside the profiler
    kernels = collections.defaultdict(lambda: {"count": 0, "us": 0.0, "scope": ""})
    scopes = collections.defaultdict(lambda: {"count": 0, "us": 0.0})
    for e in gpu_events(lambda: run(o.steps)):
        a = e.get("args", {})
        label = " ".join(str(a.get(k, "")) for k in ("tf_op", "long_name", "hlo_op", "name"))
        scope = scope_of(label)
        if scope == "other":
            key = lambda name: str(name).replace(".", "_")  # noqa: E731
            scope = instruction_scope.get(key(e["name"]), instruction_scope.get(key(a.get("hlo_op", "")), "other"))
        row = kernels[e["name"]]
        row["count"] += 1
        row["us"] += e.get("dur", 0.0)
        row["scope"] = row["scope"] or scope
        scopes[scope]["count"] += 1
        scopes[scope]["us"] += e.get("dur", 0.0)
    n = o.steps
    busy = sum(r["us"] for r in kernels.values())
    result = {"config": o.config, "batch": o.batch, "context": o.context, "build_kwargs": json.loads(o.build_kwargs),
              "step": o.step, "pdl": o.pdl,
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "wall_ms_per_step": wall * 1e3,
              "gpu_busy_ms_per_step": busy / n / 1e3, "kernels_per_step": sum(r["count"] for r in kernels.values()) / n,
              "by_scope": {k: {"count_per_step": v["count"] / n, "us_per_step": v["us"] / n, "share": v["us"] / busy}
                           for k, v in sorted(scopes.items(), key=lambda kv: -kv[1]["us"])},
              "top_kernels": [{"name": k, "scope": v["scope"], "count_per_step": v["count"] / n,
                               "us_per_step": v["us"] / n, "share": v["us"] / busy}
                              for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:o.top]]}
    print(f"batch {o.batch}: wall {result['wall_ms_per_step']:.3f} ms/step, GPU busy "
          f"{result['gpu_busy_ms_per_step']:.3f} ms/step, {result['kernels_per_step']:.0f} kernels/step, PDL {o.pdl}")
    if result["gpu_busy_ms_per_step"] > result["wall_ms_per_step"]:
        print("  kernels overlap (busy > wall): their durations include waits for the launch before; --pdl off "
              "separates them")
    for k, v in result["by_scope"].items():
        print(f"  scope {k:16s} {v['us_per_step']:9.1f} us/step {v['count_per_step']:6.1f}x {100 * v['share']:5.1f}%")
    for r in result["top_kernels"]:
        print(f"  {r['us_per_step']:9.1f} us/step {r['count_per_step']:6.1f}x {100 * r['share']:5.1f}%  "
              f"{r['name'][:60]:60s} {r['scope']}")
    if o.out:
        with open(o.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
