"""Bad input to the command-line tools: each ends with one line on stderr naming the flag, key or
path the user gave, a non-zero exit, no traceback and nothing written; and the feedback a user
expects (rates, notes, defaults in --help)."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dsv3_jax
from chat_calls import chat_each
from dsv3_jax.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"
RATES = re.compile(r"\[prefill (\d+) tokens [\d.]+ tok/s · decode (\d+) tokens [\d.-]+ tok/s\]")


def run(*argv, stdin: bytes | str = b"", timeout: float = 180, cwd: Path = ROOT,
        env: dict | None = None) -> subprocess.CompletedProcess:
    stdin = stdin.encode() if isinstance(stdin, str) else stdin
    result = subprocess.run([sys.executable, *map(str, argv)], input=stdin, capture_output=True, timeout=timeout,
                            cwd=cwd, env=dict(os.environ) if env is None else env)
    result.stdout, result.stderr = (out.decode("utf-8", "replace") for out in (result.stdout, result.stderr))
    return result


def chat(*flags, stdin: bytes | str = b"") -> subprocess.CompletedProcess:
    return run("-m", "dsv3_jax.chat", *flags, stdin=stdin)


def one_error_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    """The run failed with exactly one line on stderr (beside the chat's start-up line), containing `expected`."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and "on 1 device(s)" not in line]
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def tiny_copy(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(TINY, tmp_path / name))


# ------------------------------------------------------------------ dsv3-chat: flags, before anything loads
BAD_FLAGS = [
    (("--bogus",), "unrecognized arguments: --bogus"),
    (("--interactive", "--num-devices", "0"), "--num-devices must be at least 1"),
    (("--interactive", "--num-devices", "999"), "--num-devices 999 exceeds"),
    (("--interactive", "--top-p", "2"), "--top-p must lie in (0, 1]"),
    (("--interactive", "--temperature", "nan"), "--temperature must be a number >= 0 (0: greedy), got nan"),
    (("--interactive", "--temperature", "-1"), "--temperature must be a number >= 0 (0: greedy), got -1.0"),
    (("--interactive", "--top-k", "-5"), "--top-k must not be negative"),
    (("--interactive", "--seed", "-1"), "--seed"),
    (("--interactive", "--ckpt-path", "/nonexistent"), "--ckpt-path /nonexistent does not exist"),
    (("--interactive", "--config", "/nonexistent.json"), "--config /nonexistent.json does not exist"),
    (("--input-file", "/nonexistent.txt"), "cannot read --input-file /nonexistent.txt: No such file"),
    (("--input-file", "/"), "cannot read --input-file /: Is a directory"),
]


def test_chat_rejects_bad_flags_in_one_line():
    """Each of BAD_FLAGS, a main() call of its own in one process (the other tests here start the
    CLI itself, `python -m dsv3_jax.chat`, once per case)."""
    results = chat_each(*((flags, b"") for flags, _ in BAD_FLAGS))
    for (flags, expected), result in zip(BAD_FLAGS, results, strict=True):
        try:
            one_error_line(result, expected)
        except AssertionError as failure:
            raise AssertionError(f"dsv3-chat {' '.join(flags)}: {failure}") from None


def test_chat_names_the_hf_key_of_a_bad_config(tmp_path):
    directory = tiny_copy(tmp_path, "big")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    one_error_line(chat("--interactive", "--ckpt-path", directory), "'hidden_size' must be int", "'big'")


def test_chat_asks_for_the_config_flag_of_a_per_rank_checkpoint(tmp_path):
    directory = tiny_copy(tmp_path, "ranks")
    (directory / "model.safetensors").rename(directory / "model0-mp1.safetensors")
    (directory / "config.json").unlink()
    one_error_line(chat("--interactive", "--ckpt-path", directory), "per-rank", "--config")


def test_chat_rejects_input_that_is_not_utf8():
    one_error_line(chat("--tiny", "--interactive", "--num-devices", "1", stdin=b"\xff\xfe\x00binary\n"),
                   "standard input is not UTF-8 text")
    one_error_line(chat("--complete", "--tiny", "--num-devices", "1", stdin=b"def f(x):\n    \xff\xfe\n"),
                   "dsv3-chat: error: standard input is not UTF-8 text")


def test_chat_names_the_flags_a_checkpoint_cannot_serve():
    one_error_line(chat("--tiny", "--interactive", "--num-devices", "1", "--mtp"),
                   "--mtp:", "holds no multi-token-prediction (MTP) layer", "run without --mtp")
    one_error_line(chat("--tiny", "--interactive", "--num-devices", "1", "--gemm-impl", "fp8"),
                   "--gemm-impl fp8", "holds bf16 weights")


def test_chat_names_the_missing_flag_of_a_multi_process_start():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    result = run("-m", "dsv3_jax.chat", "--tiny", "--interactive", "--coordinator-address", "127.0.0.1:9",
                 env=env, timeout=60)
    one_error_line(result, "cannot start a multi-process run", "--num-processes (or JAX_NUM_PROCESSES)",
                   "--process-id (or JAX_PROCESS_ID)")


def test_batch_prompt_without_room_for_a_completion(tmp_path):
    tokenizer = Tokenizer.from_dir(TINY)
    length = len(tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}]))
    (tmp_path / "prompts.txt").write_text("Hello there\n")
    one_error_line(chat("--tiny", "--input-file", tmp_path / "prompts.txt", "--num-devices", "1", "--max-seq-len", length),
                   "prompt 1", f"{length} tokens", f"--max-seq-len={length}")


# ------------------------------------------------------------------ dsv3-chat: feedback
def test_batch_notes_cut_completions_and_prints_rates(tmp_path):
    tokenizer = Tokenizer.from_dir(TINY)
    prompts = ["Hello there", "Describe a red lamp in a few words, please."]
    lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    # room for 3 tokens after the longer prompt: its completion is cut (greedy: the tiny model babbles on)
    limit = max(lengths) + 3
    result = chat("--tiny", "--input-file", tmp_path / "prompts.txt", "--num-devices", "1", "--max-seq-len", limit,
                  "--max-new-tokens", 40, "--temperature", 0)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert f"dsv3-chat: completion 2 stopped after 3 tokens at --max-seq-len={limit}" in lines
    rates = [RATES.fullmatch(line) for line in lines]
    assert sum(bool(r) for r in rates) == 1
    assert int(next(r for r in rates if r).group(1)) == sum(lengths)


def test_help_shows_defaults_and_explains_each_flag():
    text = chat("--help").stdout
    for flag, default in (("--max-new-tokens", "200"), ("--temperature", "0.2"), ("--top-k", "0"),
                          ("--top-p", "1.0"), ("--max-seq-len", "4096"), ("--compute-dtype", "bfloat16")):
        block = text.split(f"  {flag} ")[1].split("\n  --")[0]
        assert f"(default: {default})" in " ".join(block.split()), (flag, block)
    flags = re.findall(r"^  (--[\w-]+)", text, re.M)
    assert len(flags) > 15
    for flag in flags:
        block = text.split(f"  {flag}")[1].split("\n  --")[0]
        assert len(block.split()) > 2, flag  # some words of help beside the metavar


# ------------------------------------------------------------------ the checkpoint tools and scripts
def test_tool_refuses_an_existing_output_without_progress_noise(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    line = one_error_line(run("-m", "dsv3_jax.convert.to_orbax", "--hf-ckpt-path", TINY, "--save-path", out),
                          "dsv3-to-orbax: error:", str(out), "already exists")
    assert "%" not in line and (out / "mine.txt").read_text() == "keep"


def test_tool_names_the_users_output_path_not_its_staging_directory():
    line = one_error_line(run("-m", "dsv3_jax.convert.to_orbax", "--hf-ckpt-path", TINY, "--save-path", "/proc/x"),
                          "cannot create save path /proc/x")
    assert ".partial" not in line


def test_cast_without_fp8_tensors_is_an_error_and_writes_nothing(tmp_path):
    out = tmp_path / "cast"
    one_error_line(run("-m", "dsv3_jax.convert.fp8_cast_bf16", "--input-fp8-hf-path", TINY,
                       "--output-bf16-hf-path", out), f"no fp8 tensors in {TINY}: nothing to cast")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["convert", "to_orbax", "fp8_cast_bf16"])
def test_convert_scripts_run_from_a_checkout(tmp_path, name):
    """`python convert/<tool>.py` (the reference's way) from any directory, nothing installed on the
    path: the shim imports this checkout's package."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    shim = ROOT / "convert" / f"{name}.py"
    result = run(shim, "--help", cwd=tmp_path, env=env)
    assert result.returncode == 0 and "--help" in result.stdout, result.stderr
    where = run("-c", "import runpy, sys; runpy.run_path(sys.argv[1]); print(sys.modules['dsv3_jax'].__file__)",
                shim, cwd=tmp_path, env=env)
    assert where.returncode == 0 and Path(where.stdout.strip()) == ROOT / "dsv3_jax" / "__init__.py", where


def test_tool_rejects_unknown_flags_in_one_line():
    one_error_line(run("-m", "dsv3_jax.convert.convert", "--bogus"), "dsv3-convert: error:", "--bogus")


def test_memory_plan_reads_hf_configs_and_reports_bad_ones_in_one_line(tmp_path):
    result = run(ROOT / "scripts" / "memory_plan.py", "--config", TINY / "config.json", "--devices", 1, "--batch", 1,
                 "--seq-len", 64, "--prefill-chunk", 64)
    assert result.returncode == 0, result.stderr
    assert "# Memory plan: config.json" in result.stdout
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**json.loads((TINY / "config.json").read_text()), "hidden_size": "big"}))
    one_error_line(run(ROOT / "scripts" / "memory_plan.py", "--config", bad), "'hidden_size' must be int")
    one_error_line(run(ROOT / "scripts" / "memory_plan.py", "--config", tmp_path / "none.json"),
                   f"config file not found: {tmp_path / 'none.json'}")


def test_interactive_notes_a_cut_answer_and_prints_rates():
    tokenizer = Tokenizer.from_dir(TINY)
    limit = len(tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}])) + 3
    result = chat("--tiny", "--interactive", "--num-devices", "1", "--max-seq-len", limit, "--max-new-tokens", 40,
                  "--temperature", 0, stdin="Hello there\n")
    assert result.returncode == 0, result.stderr
    assert f"dsv3-chat: the answer stopped after 3 tokens at --max-seq-len={limit}" in result.stderr
    rates = RATES.search(result.stdout)
    assert rates and int(rates.group(1)) == limit - 3 and int(rates.group(2)) == 2, result.stdout
