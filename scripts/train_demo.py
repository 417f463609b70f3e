"""Train the demo model: a small DeepSeek-V3 (MLA with q_lora, sigmoid group-limited routing with the
correction bias, shared + routed experts, a dense first layer, one MTP module) on permissively
licensed Python source, and write it as a Hugging Face checkpoint.

    PYTHONPATH=. python3 scripts/train_demo.py --data DATA_DIR --out OUT_DIR [--minutes 6 | --steps N] [--seed 0]

Data: the directory scripts/make_demo_data.py writes (tokens.npz: token ids of the train and held-out
files; the tokenizer). Training never reads the held-out split; it is evaluated every --eval-every steps.
Windows of --seq tokens are drawn anywhere in the train stream (files concatenated), and the config's
max_position_embeddings is --seq: the positions the model was trained at.

Model: the project's own modules (dsv3_jax.training: Transformer + MTP, cache-free full-sequence
pass). Loss = next-token cross-entropy + --mtp-weight (0.3, as in the V3 report) x the MTP module's
cross-entropy of the token after next. Routing balance: auxiliary-loss-free, as in the V3 report:
after every step each MoE layer's correction bias moves by gamma * sign(mean load - expert load)
(the bias is not trained by the gradient; gamma = --bias-gamma). No sequence-wise auxiliary loss.

Precision: float32 master weights and Adam state; the forward/backward computes with the weights
rounded to bfloat16 (--dtype bfloat16, default; the gate bias stays float32, as V3 stores it), and
the checkpoint stores exactly those bf16 weights, so the loaded model reproduces the training
evaluation. --dtype float32 computes in float32 with full-precision matmuls.

Optimiser: optax AdamW (b1 0.9, b2 0.95, weight decay on matrices only), global-norm clipping 1.0,
linear warmup then cosine decay to --min-lr-ratio x peak. The learning rate is passed to the
jitted step as a number, so --minutes can pick the step count after timing the first steps (the
warmup does not depend on it); the chosen count is printed, and --steps N reproduces the run
exactly (batches are drawn on the device from the seed and the step number).

Outputs in --out: config.json (num_nextn_predict_layers 1), model.safetensors (bf16, HF names, the
MTP module at layer num_hidden_layers; files of at most 15 MiB, so several files and an index for the
demo; its copies of the embedding and head only with --mtp-copies),
tokenizer.json, tokenizer_config.json, train_log.json (every evaluation and the final report) and
train_log.md (a short table).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

DATA = ROOT / "data" / "pycorpus"

# The demo model: DeepSeek-V3's architecture at small scale: 18.2 M parameters with vocabulary 8,192
# (6.3 M of them embedding + head); bf16 checkpoint 36.4 MB without the MTP layer's copies of embedding
# and head (--mtp-copies adds 12.6 MB). Every input dimension of a projection (hidden, q/kv LoRA ranks, heads x v_head_dim, the MLP and expert widths, the MTP
# block's 2 x hidden) is a multiple of 128, so the fp8 versions of the checkpoint run with gemm_impl
# "fp8" too.
PRESETS = {
    "demo": dict(hidden_size=384, intermediate_size=1024, moe_intermediate_size=128, num_hidden_layers=4,
                 first_k_dense_replace=1, num_attention_heads=6, n_routed_experts=12, n_shared_experts=1,
                 num_experts_per_tok=3, n_group=4, topk_group=2, q_lora_rank=256, kv_lora_rank=128,
                 qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
    # the previous demo model's shape (512 positions, stdlib only)
    "demo-small": dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
                       first_k_dense_replace=1, num_attention_heads=4, n_routed_experts=12, n_shared_experts=1,
                       num_experts_per_tok=3, n_group=4, topk_group=2, q_lora_rank=128, kv_lora_rank=128,
                       qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
    # for CPU tests: the same parts, tiny
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 first_k_dense_replace=1, num_attention_heads=2, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, n_group=4, topk_group=2, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}


def hf_config(preset: str, vocab_size: int, seq_len: int, bos_id: int, eos_id: int) -> dict:
    sizes = PRESETS[preset]
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab_size,
        **sizes, "num_key_value_heads": sizes["num_attention_heads"], "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "hidden_act": "silu",
        # trained at `seq_len` positions without YaRN (as V3's pre-training at 4K; YaRN came later)
        "max_position_embeddings": seq_len, "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "bfloat16",
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--data", type=Path, default=DATA, help=f"corpus directory ({DATA})")
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="training steps (0: as many as --minutes allows)")
    p.add_argument("--minutes", type=float, default=6.0, help="time budget of the training steps when --steps 0")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (the config's max_position_embeddings)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--bias-gamma", type=float, default=1e-3, help="bias-balancing speed (V3 report: 0.001)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-tokens", type=int, default=0, help="held-out tokens per evaluation (0: all)")
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--train-tokens", type=int, default=0, help="use only the first N train tokens (tests)")
    p.add_argument("--mtp-copies", action="store_true",
                   help="also store the MTP layer's copies of the embedding and head (V3 checkpoints do; "
                        "engines use the main ones; 2 x vocab x dim more, over the 40 MB budget of the demo)")
    p.add_argument("--max-mb", type=float, default=40.0, help="refuse a config whose checkpoint exceeds this")
    p.add_argument("--remat", action="store_true", help="recompute layer activations in the backward pass")
    p.add_argument("--ragged-dot", choices=("auto", "xla", "dense"), default="auto",
                   help="routed-expert GEMM lowering: XLA's ragged dot, the dense (masked) decomposition, "
                        "or auto (XLA's, falling back to dense if it does not compile)")
    p.add_argument("--no-reload-check", action="store_true", help="skip reloading the written checkpoint")
    return p.parse_args(argv)


def tokenizer_facts(directory: Path) -> tuple[int, int, int]:
    """(vocab size, bos id, eos id) of the corpus' tokenizer (read with `tokenizers` alone)."""
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    return (backend.get_vocab_size(with_added_tokens=True), backend.token_to_id(config["bos_token"]),
            backend.token_to_id(config["eos_token"]))


def load_data(directory: Path, train_tokens: int = 0):
    with np.load(directory / "tokens.npz") as data:
        train, heldout = data["train"], data["heldout"]
    if train_tokens:
        train = train[:train_tokens]
    return train, heldout


def eval_windows(heldout: np.ndarray, seq: int, max_tokens: int, batch: int) -> np.ndarray:
    """Non-overlapping windows (n, seq + 1) with stride seq (every token predicted once), whole batches."""
    stream = heldout[: max_tokens + 1] if max_tokens else heldout
    n = (len(stream) - 1) // seq
    n = max(batch, n - n % batch) if n >= batch else n
    starts = np.arange(n) * seq
    return stream[starts[:, None] + np.arange(seq + 1)[None]].astype(np.int32)


def unigram_nll(train: np.ndarray, heldout_windows: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout_windows[:, 1:]].mean())


def lr_at(step: int, total: int, opts) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = min(1.0, (step - opts.warmup) / max(1, total - opts.warmup))
    floor = opts.min_lr_ratio
    return opts.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def setup(opts: argparse.Namespace) -> SimpleNamespace:
    """The data, config, initial parameters (float32 masters), their masks and the optimiser."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dsv3_jax import training as T
    from dsv3_jax.config import ModelArgs

    if opts.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    if opts.ragged_dot == "dense":
        jax.config.update("jax_ragged_dot_use_ragged_dot_instruction", False)
    vocab_size, bos_id, eos_id = tokenizer_facts(opts.data)
    train_ids, heldout_ids = load_data(opts.data, opts.train_tokens)
    config = hf_config(opts.preset, vocab_size, opts.seq, bos_id, eos_id)
    args = ModelArgs.from_hf_config(config).replace(max_seq_len=opts.seq)
    compute = jnp.bfloat16 if opts.dtype == "bfloat16" else jnp.float32
    abstract = nnx.eval_shape(lambda: T.TrainModel(args, param_dtype=jnp.float32, rngs=nnx.Rngs(opts.seed)))
    graphdef, _ = nnx.split(abstract)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.split(T.TrainModel(args, param_dtype=jnp.float32,
                                                                        rngs=nnx.Rngs(opts.seed)))[1]))()
    bias_mask = jax.tree_util.tree_map_with_path(lambda path, _: T.is_gate_bias(path), params)
    decay_mask = jax.tree_util.tree_map_with_path(lambda path, x: x.ndim >= 2 and not T.is_gate_bias(path), params)

    def to_compute(p):
        """The weights the forward pass uses (and the checkpoint stores): rounded to the compute dtype,
        the gate bias excepted."""
        return jax.tree.map(lambda x, is_bias: x if is_bias else x.astype(compute), p, bias_mask)

    stored_mb = checkpoint_megabytes(params, bias_mask, args, opts.mtp_copies)
    if stored_mb > opts.max_mb:
        raise SystemExit(f"the checkpoint would take {stored_mb:.1f} MB > --max-mb {opts.max_mb}")
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                     optax.add_decayed_weights(opts.weight_decay, mask=decay_mask))
    return SimpleNamespace(train_ids=train_ids, heldout_ids=heldout_ids, config=config, args=args, compute=compute,
                           graphdef=graphdef, params=params, n_params=T.param_count(params), bias_mask=bias_mask,
                           to_compute=to_compute, stored_mb=stored_mb, tx=tx, opt_state=tx.init(params))


def make_step_fn(run: SimpleNamespace, opts: argparse.Namespace, mesh):
    """step(params, opt_state, step, lr) -> (params, opt_state, metrics): a batch drawn on the device
    from the seed and the step number, AdamW on the weights, bias balancing on the gate biases."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from dsv3_jax import training as T

    def local_grads(p, windows):
        def loss_fn(p):
            model = nnx.merge(run.graphdef, run.to_compute(p))
            out = T.forward_losses(model.model, model.mtp[0] if len(model.mtp) else None, run.args, windows,
                                   remat=opts.remat)
            main = out["nll"].mean()
            mtp = out["mtp_nll"].mean() if "mtp_nll" in out else jnp.zeros(())
            return main + opts.mtp_weight * mtp, (main, mtp, out["loads"])

        (loss, (main, mtp, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
        return loss, main, mtp, loads, grads

    grads_fn = T.shard_over(mesh, local_grads, P(), 1)
    train_device = jnp.asarray(run.train_ids)
    n_train = int(run.train_ids.size)
    base_key = jax.random.key(opts.seed)

    def step_fn(p, opt_state, step, lr):
        key = jax.random.fold_in(base_key, step)
        starts = jax.random.randint(key, (opts.batch,), 0, n_train - opts.seq - 1)
        windows = jnp.take(train_device, starts[:, None] + jnp.arange(opts.seq + 1)[None]).astype(jnp.int32)
        loss, main, mtp, loads, grads = grads_fn(p, windows)
        grads = jax.tree.map(lambda g, b: jnp.zeros_like(g) if b else g, grads, run.bias_mask)
        updates, opt_state = run.tx.update(grads, opt_state, p)
        p = jax.tree.map(lambda x, u, b: x if b else x - lr * u, p, updates, run.bias_mask)
        p = T.update_gate_biases(p, loads, opts.bias_gamma)
        loads = loads.astype(jnp.float32)
        imbalance = (loads.max(-1) / loads.mean(-1)).mean()
        return p, opt_state, dict(loss=loss, main=main, mtp=mtp, imbalance=imbalance,
                                  grad_norm=optax.tree.norm(grads))

    return step_fn


def make_eval(run: SimpleNamespace, opts: argparse.Namespace, mesh):
    """(eval_fn(params, windows) -> sums, the held-out windows, evaluate(params) -> the held-out metrics)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from dsv3_jax import training as T

    def local_eval(p, windows):
        model = nnx.merge(run.graphdef, run.to_compute(p))
        out = T.forward_losses(model.model, model.mtp[0] if len(model.mtp) else None, run.args, windows)
        sums = dict(nll=out["nll"].sum(), count=jnp.asarray(out["nll"].size, jnp.float32))
        if "mtp_nll" in out:
            sums.update(mtp_nll=out["mtp_nll"].sum(), mtp_count=jnp.asarray(out["mtp_nll"].size, jnp.float32),
                        mtp_correct=(out["mtp_argmax"] == windows[:, 2:]).sum().astype(jnp.float32),
                        accepted=(out["mtp_argmax"] == out["main_argmax"][:, 1:]).sum().astype(jnp.float32))
        return sums

    eval_fn = jax.jit(T.shard_over(mesh, local_eval, P(), 1))
    windows = eval_windows(run.heldout_ids, opts.seq, opts.eval_tokens, opts.eval_batch)

    def evaluate(p) -> dict:
        totals: dict[str, float] = {}
        for i in range(0, len(windows), opts.eval_batch):
            for k, v in eval_fn(p, jnp.asarray(windows[i:i + opts.eval_batch])).items():
                totals[k] = totals.get(k, 0.0) + float(v)
        result = dict(heldout_loss=totals["nll"] / totals["count"], heldout_tokens=int(totals["count"]))
        result["heldout_ppl"] = math.exp(result["heldout_loss"])
        if "mtp_nll" in totals:
            result.update(heldout_mtp_loss=totals["mtp_nll"] / totals["mtp_count"],
                          mtp_accuracy=totals["mtp_correct"] / totals["mtp_count"],
                          mtp_acceptance=totals["accepted"] / totals["mtp_count"])
        return result

    return eval_fn, windows, evaluate


def compile_step(step_fn, run: SimpleNamespace, opts: argparse.Namespace):
    """The compiled step (with the ragged-dot fallback) and its compile time in seconds."""
    import jax
    import jax.numpy as jnp

    def compile_once():
        return jax.jit(step_fn, donate_argnums=(0, 1)).lower(run.params, run.opt_state, jnp.int32(0),
                                                              jnp.float32(0.0)).compile()

    compile_start = time.time()
    try:
        step = compile_once()
    except Exception as err:  # XLA could not lower a mode of the ragged dot: use the dense decomposition
        if opts.ragged_dot != "auto":
            raise
        print(f"ragged dot did not compile ({type(err).__name__}: {str(err)[:200]}); using the dense form",
              flush=True)
        jax.config.update("jax_ragged_dot_use_ragged_dot_instruction", False)
        opts.ragged_dot = "dense"
        step = compile_once()
    return step, time.time() - compile_start


def train_loop(step, run: SimpleNamespace, opts: argparse.Namespace, evaluate, log: dict) -> None:
    """Run the steps (--steps, or as many as --minutes allow at the rate of the first ones), evaluating
    every --eval-every steps into log["evals"]; leaves the trained parameters in run.params."""
    import jax
    import jax.numpy as jnp

    params, opt_state = run.params, run.opt_state
    total = opts.steps or 10**9
    budget = opts.minutes * 60.0
    decide_at = max(10, min(opts.warmup, 50))  # within the warmup, whose rates do not depend on the total
    loop_start, eval_time, i, timing_start = time.time(), 0.0, 0, None
    while i < total:
        params, opt_state, metrics = step(params, opt_state, jnp.int32(i), jnp.float32(lr_at(i, total, opts)))
        i += 1
        if i == 5:
            jax.block_until_ready(params)
            timing_start = time.time()
        if not opts.steps and i == decide_at:  # choose the step count from the rate of the first steps
            jax.block_until_ready(params)
            per_step = (time.time() - timing_start) / (i - 5)
            spent = time.time() - loop_start - eval_time
            total = max(i + 1, i + int((budget - spent) / per_step))
            print(f"{per_step * 1e3:.1f} ms/step: training for {total} steps (reproduce with --steps {total})",
                  flush=True)
        if i % opts.eval_every == 0 or i == total:
            last = {k: float(v) for k, v in metrics.items()}
            eval_start = time.time()
            entry = dict(step=i, tokens=i * opts.batch * opts.seq, lr=lr_at(i - 1, total, opts),
                         train_loss=last["main"], train_mtp_loss=last["mtp"], expert_imbalance=last["imbalance"],
                         grad_norm=last["grad_norm"], **evaluate(params))
            eval_time += time.time() - eval_start
            entry["train_s"] = round(eval_start - loop_start - eval_time + (time.time() - eval_start), 1)
            log["evals"].append(entry)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}), flush=True)
    jax.block_until_ready(params)
    run.params, run.opt_state = params, opt_state
    train_time = time.time() - loop_start - eval_time
    n_train = int(run.train_ids.size)
    log.update(steps=total, eval_s=round(eval_time, 1), train_s=round(train_time, 1),
               steps_per_s=round(total / max(train_time, 1e-9), 2),
               tokens_per_s=round(total * opts.batch * opts.seq / max(train_time, 1e-9)),
               epochs=round(total * opts.batch * opts.seq / n_train, 2), ragged_dot=opts.ragged_dot)


def export(run: SimpleNamespace, opts: argparse.Namespace, log: dict) -> Path:
    """Write the trained weights (as the forward pass used them) as a Hugging Face checkpoint."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from flax import nnx

    from dsv3_jax import training as T

    model = nnx.merge(run.graphdef, jax.tree.map(np.asarray, run.to_compute(run.params)))
    tensors = T.checkpoint_tensors(model, run.args, mtp_copies=opts.mtp_copies)
    tensors = {k: (v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 and not k.endswith("e_score_correction_bias")
                   and run.compute == jnp.bfloat16 else v) for k, v in tensors.items()}
    out = T.write_checkpoint(opts.out, run.config, tensors, opts.data)
    log["checkpoint_bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    log["checkpoint_dir_bytes"] = sum(f.stat().st_size for f in out.iterdir())
    return out


def reload_check(out: Path, run: SimpleNamespace, opts: argparse.Namespace, eval_fn, windows) -> dict:
    """The written checkpoint, loaded like any other, gives the same held-out loss as in training."""
    import jax.numpy as jnp

    import dsv3_jax
    from dsv3_jax import training as T
    from dsv3_jax.checkpoint.mtp import load_mtp

    loaded = dsv3_jax.load(out, compute_dtype=opts.dtype, max_seq_len=opts.seq, max_batch_size=opts.eval_batch)
    mtp = load_mtp(out, loaded.args, param_dtype=run.compute)
    batch = windows[: opts.eval_batch]
    outputs = T.sequence_nll(loaded, batch, mtp=mtp)
    trained = eval_fn(run.params, jnp.asarray(batch))
    return dict(trained_loss=float(trained["nll"] / trained["count"]), reloaded_loss=float(outputs["nll"].mean()),
                trained_mtp_loss=float(trained["mtp_nll"] / trained["mtp_count"]),
                reloaded_mtp_loss=float(outputs["mtp_nll"].mean()))


def train(opts: argparse.Namespace) -> dict:
    import jax

    from dsv3_jax.sharding import make_mesh

    started = time.time()
    run = setup(opts)
    mesh = make_mesh(1)
    eval_fn, windows, evaluate = make_eval(run, opts, mesh)
    baseline = unigram_nll(run.train_ids, windows, run.args.vocab_size)
    step, compile_s = compile_step(make_step_fn(run, opts, mesh), run, opts)
    log = dict(config=run.config, options={k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
               params=run.n_params, checkpoint_mb_estimate=round(run.stored_mb, 2), corpus=corpus_info(opts.data),
               device=str(jax.devices()[0]), unigram_heldout_loss=baseline,
               unigram_heldout_ppl=math.exp(baseline), compile_s=round(compile_s, 1), evals=[])
    print(f"{run.n_params / 1e6:.2f} M parameters, checkpoint ~{run.stored_mb:.1f} MB, {len(windows)} held-out "
          f"windows, unigram held-out loss {baseline:.3f}, step compiled in {compile_s:.1f} s", flush=True)
    train_loop(step, run, opts, evaluate, log)
    final = log["evals"][-1]
    out = export(run, opts, log)
    if not opts.no_reload_check:
        log["reload_check"] = reload_check(out, run, opts, eval_fn, windows)
        print("reload check:", json.dumps(log["reload_check"]), flush=True)
    log["total_s"] = round(time.time() - started, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out / "train_log.md").write_text(markdown_log(log))
    print(f"wrote {out} ({log['checkpoint_dir_bytes'] / 1e6:.1f} MB): held-out loss {final['heldout_loss']:.3f} "
          f"(ppl {final['heldout_ppl']:.2f}, unigram {math.exp(baseline):.1f}), MTP acceptance "
          f"{final.get('mtp_acceptance', float('nan')):.3f}, {log['total_s']} s in all", flush=True)
    return log


def checkpoint_megabytes(params, bias_mask, args, mtp_copies: bool) -> float:
    import jax

    sizes = jax.tree.map(lambda x, b: x.size * (4 if b else 2), params, bias_mask)
    total = sum(jax.tree.leaves(sizes))
    if mtp_copies and args.n_mtp_layers:
        total += 2 * 2 * args.vocab_size * args.dim
    return total / 1e6


def corpus_info(directory: Path) -> dict:
    path = directory / "corpus.json"
    if not path.is_file():
        return {}
    info = json.loads(path.read_text())
    return {k: info[k] for k in ("corpus", "licence", "split_rule", "files", "tokens") if k in info}


def markdown_log(log: dict) -> str:
    lines = [f"# Demo model training ({log['device']})", "",
             f"{log['params'] / 1e6:.2f} M parameters; {log['steps']} steps of {log['options']['batch']} x "
             f"{log['options']['seq']} tokens ({log['epochs']} epochs of the train split) in {log['train_s']} s "
             f"({log['tokens_per_s']} tokens/s); compile {log['compile_s']} s; seed {log['options']['seed']}.",
             f"Held-out unigram baseline: loss {log['unigram_heldout_loss']:.3f} "
             f"(ppl {log['unigram_heldout_ppl']:.1f}).", "",
             "| step | tokens | lr | train loss | train MTP loss | held-out loss | held-out ppl | held-out MTP loss "
             "| MTP acc. | MTP accept. | expert max/mean |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in log["evals"]:
        lines.append(f"| {e['step']} | {e['tokens']} | {e['lr']:.2e} | {e['train_loss']:.3f} | "
                     f"{e['train_mtp_loss']:.3f} | {e['heldout_loss']:.3f} | {e['heldout_ppl']:.2f} | "
                     f"{e.get('heldout_mtp_loss', float('nan')):.3f} | {e.get('mtp_accuracy', float('nan')):.3f} | "
                     f"{e.get('mtp_acceptance', float('nan')):.3f} | {e['expert_imbalance']:.2f} |")
    if "reload_check" in log:
        r = log["reload_check"]
        lines += ["", f"Reloaded checkpoint (dsv3_jax.load), first held-out batch: loss {r['reloaded_loss']:.5f} "
                  f"vs {r['trained_loss']:.5f} in training; MTP {r['reloaded_mtp_loss']:.5f} vs "
                  f"{r['trained_mtp_loss']:.5f}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    train(parse_args(argv))


if __name__ == "__main__":
    main()
