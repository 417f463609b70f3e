"""Benchmark MTP speculative decoding.

Part 1 (always): the V3 shape cut to --layers layers plus its MTP layer, fp8, random weights made
on the device(s). At b=1 and b=8 it times, after a prefill to --context tokens:
  plain   one decode step of 1 token per row (`Model.step`, S=1)
  verify  one main-model step of 2 tokens per row (`Model.step`, S=2)
  spec    the fused speculative step (verify 2 tokens + accept + MTP draft), what generate(mtp=True) runs
and prints spec / plain (target: <= 1.2 at b=1).

Part 2 (with --demo DIR): a trained checkpoint with an MTP layer (dsv3_jax/assets/demo), greedy
tokens/s with and without MTP on held-out prompts, and the acceptance rate. The prompts are
--demo-prompts windows of --prompt-tokens tokens spread over the corpus' evaluation set
(--data: data/pycorpus/eval_texts.jsonl.gz, files the demo model never saw), or the lines of --prompts FILE.

    python scripts/bench_mtp.py --config configs/config_671B.json --layers 4 --gemm-impl fp8 --out mtp.json
    python scripts/bench_mtp.py --demo dsv3_jax/assets/demo --skip-shape
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dsv3_jax
from dsv3_jax.model.cache import cache_window
from dsv3_jax.checkpoint.schema import abstract_state
from dsv3_jax.config import ModelArgs
from dsv3_jax.decode.generate import prefill
from dsv3_jax.options import add_flags, from_flags
from dsv3_jax.sharding import Layout, parameter_bytes_per_device
from bench_model import HBM_BYTES_PER_S, cache_bytes, decode_bytes, weights_read

DATA = Path(__file__).resolve().parent.parent / "data" / "pycorpus"


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() (which returns something to block on), after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def floor_bytes(args: ModelArgs, rows: int, context: int) -> dict[str, float]:
    """Fewest bytes the plain step (1 token a row), the verification (2 tokens a row) and the speculative step
    (verification, then the MTP module on 2 tokens a row and its draft through the head again) must read on one
    device (`bench_model.decode_bytes`, and the MTP module's weights and cache rows)."""
    main = parameter_bytes_per_device(abstract_state(args, jnp.bfloat16), Layout())
    with_mtp = parameter_bytes_per_device(abstract_state(args, jnp.bfloat16, mtp=True), Layout())
    module = {role: with_mtp[role] - main.get(role, 0.0) for role in with_mtp}
    verify = decode_bytes(args, rows, context, 2, tokens_per_row=2)
    return {"plain": decode_bytes(args, rows, context, 2), "verify2": verify,
            "spec": verify + weights_read(args, module, 2 * rows) + cache_bytes(args, rows, context, 2) + main["head"]}


def bench_shape(cli, results: list) -> None:
    args = ModelArgs.from_file(cli.config)
    dense = cli.layers if not args.n_routed_experts else min(
        args.n_dense_layers if cli.dense_layers is None else cli.dense_layers, cli.layers - 1)
    args = args.replace(n_layers=cli.layers, n_dense_layers=dense, n_mtp_layers=1, max_batch_size=max(cli.batches),
                        max_seq_len=cli.max_seq_len or 4096)
    if cli.gemm_impl == "fp8" or cli.fp8:
        args = args.replace(dtype="fp8")
    model = dsv3_jax.build(args, mtp=True, options=from_flags(cli), num_devices=cli.num_devices or jax.device_count())
    print(f"{cli.config} cut to {cli.layers} layers ({dense} dense) + MTP, dtype {args.dtype}, "
          f"{model.mesh.devices.size} device(s), context {cli.context}")
    for batch in cli.batches:
        kv_len = cache_window(cli.context + 4, args.max_seq_len)
        prompts = [[1] * cli.context] * batch
        state, plan = prefill(model, prompts, 8, temperature=0.0, window=kv_len, mtp=True)
        _, spec_step = model.mtp_steps
        start = jnp.full((batch,), cli.context, jnp.int32)
        one, two = jnp.ones((batch, 1), jnp.int32), jnp.ones((batch, 2), jnp.int32)

        def plain():
            logits, model.cache = model.step(model.state, model.cache, one, start, jnp.zeros((batch,), jnp.int32),
                                             kv_len=plan.kv_len)
            return logits

        def verify():
            logits, model.cache = model.step(model.state, model.cache, two, start, jnp.ones((batch,), jnp.int32),
                                             kv_len=plan.kv_len)
            return logits

        spec_state = {"now": state}

        def spec():
            # the state is donated: each step continues from the last (1-2 positions on, within the window)
            spec_state["now"], model.cache = spec_step(model.state, model.cache, spec_state["now"],
                                                       kv_len=plan.kv_len, top_k=0, top_p=1.0)
            return spec_state["now"].out

        t_plain, t_verify, t_spec = (timed(f, cli.repeats) for f in (plain, verify, spec))
        floor_ms = {name: b / HBM_BYTES_PER_S * 1e3 for name, b in floor_bytes(args, batch, cli.context).items()}
        results.append({"part": "shape", "config": str(cli.config), "layers": cli.layers, "dense_layers": dense,
                        "dtype": args.dtype, "gemm_impl": cli.gemm_impl, "batch": batch, "context": cli.context,
                        "plain_ms": t_plain * 1e3, "verify2_ms": t_verify * 1e3, "spec_ms": t_spec * 1e3,
                        "spec_over_plain": t_spec / t_plain,
                        **{f"{name}_floor_ms": ms for name, ms in floor_ms.items()}})
        print(f"b={batch}: plain {t_plain * 1e3:.3f} ms (floor {floor_ms['plain']:.3f}), verify(2) "
              f"{t_verify * 1e3:.3f} ms ({t_verify / t_plain:.2f}x; floor {floor_ms['verify2']:.3f}), verify+draft "
              f"{t_spec * 1e3:.3f} ms ({t_spec / t_plain:.2f}x; floor {floor_ms['spec']:.3f} ms, "
              f"{floor_ms['spec'] / floor_ms['plain']:.2f}x the plain floor; target <= 1.2x at b=1)")


def bench_demo(cli, results: list) -> None:
    from dsv3_jax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(cli.demo)
    if cli.prompts is not None:
        prompts = [line for line in Path(cli.prompts).read_text().splitlines() if line.strip()]
        ids = [tokenizer.encode(p)[-(cli.max_seq_len or 4096) // 2:] for p in prompts]
    else:
        from fidelity_demo import sibling_script

        eval_demo = sibling_script("eval_demo")
        texts = eval_demo.read_eval_texts(cli.data)
        heldout = np.concatenate([eval_demo.domain_stream(tokenizer, texts[d]) for d in eval_demo.DOMAINS if texts[d]])
        starts = np.linspace(0, len(heldout) - cli.prompt_tokens, cli.demo_prompts).astype(int)
        ids = [heldout[s:s + cli.prompt_tokens].astype(int).tolist() for s in starts]
    batch = min(len(ids), cli.demo_batch)
    model = dsv3_jax.load(cli.demo, mtp=True, max_batch_size=batch, max_seq_len=cli.max_seq_len,
                          options=from_flags(cli), num_devices=cli.num_devices or jax.device_count())
    for mtp in (False, True):
        tokens = seconds = drafts = accepted = 0
        model.generate(ids[:batch], cli.new_tokens, -1, 0.0, mtp=mtp)  # compile
        for first in range(0, len(ids), batch):
            group = ids[first:first + batch]
            stats = {}
            start = time.perf_counter()
            out = model.generate(group, cli.new_tokens, -1, 0.0, mtp=mtp, stats=stats)
            seconds += time.perf_counter() - start
            tokens += sum(len(o) for o in out)
            drafts += stats.get("drafts", 0)
            accepted += stats.get("accepted", 0)
        results.append({"part": "demo", "checkpoint": str(cli.demo), "batch": batch, "prompts": len(ids),
                        "new_tokens": cli.new_tokens, "mtp": mtp, "tokens_per_s": tokens / seconds,
                        "acceptance": accepted / max(drafts, 1) if mtp else None})
        extra = f", acceptance {accepted / max(drafts, 1):.3f}" if mtp else ""
        print(f"demo b<={batch} {'MTP ' if mtp else 'plain'}: {tokens / seconds:.1f} tokens/s{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/config_671B.json"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dense-layers", type=int, default=None,
                        help="dense layers of the cut (default: the config's, at most --layers - 1)")
    parser.add_argument("--fp8", action="store_true", help="fp8 weights even with --gemm-impl bf16")
    parser.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="cache positions (default: 4096, or the checkpoint's trained positions if fewer)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--num-devices", type=int, default=None)
    parser.add_argument("--skip-shape", action="store_true")
    parser.add_argument("--demo", type=Path, default=None)
    parser.add_argument("--prompts", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=DATA, help=f"corpus directory of the held-out prompts ({DATA})")
    parser.add_argument("--demo-batch", type=int, default=1)
    parser.add_argument("--demo-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("--new-tokens", type=int, default=128)
    add_flags(parser)
    cli = parser.parse_args()
    results: list = []
    if not cli.skip_shape:
        bench_shape(cli, results)
    if cli.demo is not None:
        bench_demo(cli, results)
    if cli.out is not None:
        cli.out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                       "results": results}, indent=1))


if __name__ == "__main__":
    main()
