"""Build the demo model end to end on one machine, every output under OUT_DIR:

    PYTHONPATH=. python3 scripts/build_demo.py OUT_DIR [--minutes 6] [--deadline-s 565] [--previous OLD_DEMO_DIR]

Stages, each a separate process whose output goes to OUT_DIR/logs/<stage>.log (and here, with
timestamps); a stage that fails or runs out of time does not remove what earlier stages wrote, and
the later stages that do not need its output still run:
  corpus    scripts/make_demo_data.py      -> OUT_DIR/data (corpus, tokenizer, manifest, licences)
  train     scripts/train_demo.py          -> OUT_DIR/demo (the HF checkpoint, written before any evaluation)
  eval      scripts/eval_demo.py           -> OUT_DIR/benchmarks/demo-eval.{json,md}
  mtp       scripts/bench_mtp.py --demo    -> OUT_DIR/benchmarks/mtp-demo.json
  fidelity  scripts/fidelity_demo.py       -> OUT_DIR/benchmarks/fidelity-demo.{json,md}
Training gets --minutes of steps, or less when the whole would pass --deadline-s: what is left after
the corpus, less --train-overhead-s (start-up, compilation, export) and --reserve-s (the stages after
it). OUT_DIR/build_summary.json records each stage's command, status and seconds. tokens.npz (the
token streams, only for training) is deleted at the end unless --keep-tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--minutes", type=float, default=6.0, help="training steps' time budget, at most")
    p.add_argument("--deadline-s", type=float, default=565.0, help="wall-clock seconds the whole must end within")
    p.add_argument("--train-overhead-s", type=float, default=75.0, help="training's start-up, compilation, evals, export")
    p.add_argument("--reserve-s", type=float, default=170.0, help="seconds kept for the stages after training")
    p.add_argument("--previous", type=Path, default=None, help="the previous demo checkpoint, to compare with")
    p.add_argument("--preset", default="demo")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=0, help="fixed training steps (0: by time)")
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--train-eval-tokens", type=int, default=65536, help="held-out tokens of training's evaluations")
    p.add_argument("--corpus-args", default="", help="extra arguments of make_demo_data.py (one string)")
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--eval-new-tokens", type=int, default=96, help="tokens of each greedy completion")
    p.add_argument("--fidelity-windows", type=int, default=8)
    p.add_argument("--fidelity-seq", type=int, default=0, help="fidelity window length (0: --seq)")
    p.add_argument("--bench-prompts", type=int, default=16)
    p.add_argument("--bench-new-tokens", type=int, default=128)
    p.add_argument("--keep-tokens", action="store_true")
    p.add_argument("--skip", default="", help="comma-separated stages to skip")
    return p.parse_args(argv)


class Driver:
    def __init__(self, opts: argparse.Namespace):
        self.opts, self.started, self.summary = opts, time.time(), {"stages": []}
        (opts.out / "logs").mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.time() - self.started

    def say(self, message: str) -> None:
        print(f"[build_demo {time.strftime('%H:%M:%S')} +{self.elapsed():6.1f}s] {message}", flush=True)

    def stage(self, name: str, command: list[str], needs: list[Path] = ()) -> bool:
        """Run one stage (unless skipped, or what it needs is missing) within the time left; True if it succeeded."""
        entry = dict(stage=name, command=" ".join(command))
        self.summary["stages"].append(entry)
        missing = [str(p) for p in needs if not p.exists()]
        left = self.opts.deadline_s - self.elapsed()
        if name in self.opts.skip.split(",") or missing or left < 10:
            entry["status"] = "skipped" + (f": missing {missing}" if missing else f": {left:.0f} s left" if left < 10 else "")
            self.say(f"{name}: {entry['status']}")
            self.write_summary()
            return False
        self.say(f"{name}: start ({left:.0f} s left): {entry['command']}")
        start = time.time()
        with open(self.opts.out / "logs" / f"{name}.log", "w") as log:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
            watchdog = threading.Timer(max(1.0, left), process.kill)  # the deadline, even if it prints nothing
            watchdog.start()
            for line in process.stdout:
                log.write(line)
                log.flush()
                print(f"  {name} +{self.elapsed():6.1f}s | {line}", end="", flush=True)
            code = process.wait()
            killed = not watchdog.is_alive() and code != 0
            watchdog.cancel()
        entry["status"] = "killed at the deadline" if killed else "ok" if code == 0 else f"failed (exit {code})"
        entry["seconds"] = round(time.time() - start, 1)
        self.say(f"{name}: {entry['status']} in {entry['seconds']} s")
        self.write_summary()
        return entry["status"] == "ok"

    def write_summary(self) -> None:
        self.summary["elapsed_s"] = round(self.elapsed(), 1)
        (self.opts.out / "build_summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")


def training_minutes(driver: Driver) -> float:
    opts = driver.opts
    left = opts.deadline_s - driver.elapsed() - opts.train_overhead_s - opts.reserve_s
    return round(max(0.5, min(opts.minutes, left / 60.0)), 2)


def main(argv=None) -> None:
    opts = parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/dsv3-jax-build-demo-cache")
    driver = Driver(opts)
    py, out = sys.executable, opts.out
    data, ckpt, bench = out / "data", out / "demo", out / "benchmarks"
    driver.say(f"python {sys.version.split()[0]}, output {out}, deadline {opts.deadline_s:.0f} s")
    driver.stage("corpus", [py, str(SCRIPTS / "make_demo_data.py"), "--out", str(data), *opts.corpus_args.split()])
    minutes = training_minutes(driver)
    driver.summary["training_minutes"] = minutes
    driver.stage("train", [py, str(SCRIPTS / "train_demo.py"), "--data", str(data), "--out", str(ckpt),
                           "--preset", opts.preset, "--seq", str(opts.seq), "--batch", str(opts.batch),
                           "--lr", str(opts.lr), "--eval-every", str(opts.eval_every), "--eval-tokens",
                           str(opts.train_eval_tokens), "--eval-batch", str(opts.eval_batch), "--no-reload-check",
                           *(["--steps", str(opts.steps)] if opts.steps else ["--minutes", str(minutes)])],
                 needs=[data / "tokens.npz"])
    weights = ckpt / "config.json"
    previous = ["--previous", str(opts.previous)] if opts.previous else []
    driver.stage("eval", [py, str(SCRIPTS / "eval_demo.py"), "--ckpt", str(ckpt), "--data", str(data), "--out",
                          str(bench / "demo-eval"), "--seq", str(opts.seq), "--batch", str(opts.eval_batch),
                          "--new-tokens", str(opts.eval_new_tokens), *previous],
                 needs=[weights, data / "eval_texts.jsonl.gz"])
    bench.mkdir(parents=True, exist_ok=True)
    driver.stage("mtp", [py, str(SCRIPTS / "bench_mtp.py"), "--demo", str(ckpt), "--skip-shape", "--data", str(data),
                         "--demo-prompts", str(opts.bench_prompts), "--new-tokens", str(opts.bench_new_tokens),
                         "--out", str(bench / "mtp-demo.json")], needs=[weights])
    driver.stage("fidelity", [py, str(SCRIPTS / "fidelity_demo.py"), "--ckpt", str(ckpt), "--data", str(data),
                              "--windows", str(opts.fidelity_windows), "--seq", str(opts.fidelity_seq or opts.seq),
                              "--write", "--out-dir", str(bench)], needs=[weights])
    if not opts.keep_tokens and (data / "tokens.npz").exists():
        (data / "tokens.npz").unlink()
    driver.say("done: " + ", ".join(f"{s['stage']} {s['status']}" for s in driver.summary["stages"]))
    driver.write_summary()


if __name__ == "__main__":
    main()
