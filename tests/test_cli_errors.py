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
from chat_calls import python_each
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


def prompt_length(text: str) -> int:
    """Tokens of `text` as a user turn through the tiny checkpoint's chat template."""
    return len(Tokenizer.from_dir(TINY).apply_chat_template([{"role": "user", "content": text}]))


# The command lines of the tests below but two, each test's named after it: made in a directory of
# their own, then all run one after another in one process (chat_calls.python_each: a process start
# and a jax import for all, stdout and stderr caught at the file descriptors). A test reads what its
# own came to from the `runs` fixture.
COMMANDS = {}


def commands(make):
    """Register `make(directory) -> [(python argv, stdin), ...]` for the test `test_<its name>`."""
    COMMANDS[make.__name__] = make
    return make


def chat(*flags, stdin: bytes | str = b"") -> tuple[tuple, bytes | str]:
    return ("-m", "dsv3_jax.chat", *flags), stdin


def tool(name: str, *flags) -> tuple[tuple, bytes]:
    return ("-m", f"dsv3_jax.convert.{name}", *flags), b""


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, tuple[list[subprocess.CompletedProcess], Path]]:
    """For each selected test of COMMANDS: what its command lines gave, and the directory they were made in."""
    selected = {item.originalname.removeprefix("test_") for item in request.session.items
                if item.module is request.module}
    made = {name: (directory := tmp_path_factory.mktemp(name), make(directory))
            for name, make in COMMANDS.items() if name in selected}
    results = iter(python_each(*(call for _, calls in made.values() for call in calls)))
    return {name: ([next(results) for _ in calls], directory) for name, (directory, calls) in made.items()}


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


@commands
def chat_rejects_bad_flags_in_one_line(directory):
    return [chat(*flags) for flags, _ in BAD_FLAGS]


def test_chat_rejects_bad_flags_in_one_line(runs):
    results, _ = runs["chat_rejects_bad_flags_in_one_line"]
    for (flags, expected), result in zip(BAD_FLAGS, results, strict=True):
        try:
            one_error_line(result, expected)
        except AssertionError as failure:
            raise AssertionError(f"dsv3-chat {' '.join(flags)}: {failure}") from None


@commands
def chat_names_the_hf_key_of_a_bad_config(directory):
    directory = tiny_copy(directory, "big")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    return [chat("--interactive", "--ckpt-path", directory)]


def test_chat_names_the_hf_key_of_a_bad_config(runs):
    (result,), _ = runs["chat_names_the_hf_key_of_a_bad_config"]
    one_error_line(result, "'hidden_size' must be int", "'big'")


@commands
def chat_asks_for_the_config_flag_of_a_per_rank_checkpoint(directory):
    directory = tiny_copy(directory, "ranks")
    (directory / "model.safetensors").rename(directory / "model0-mp1.safetensors")
    (directory / "config.json").unlink()
    return [chat("--interactive", "--ckpt-path", directory)]


def test_chat_asks_for_the_config_flag_of_a_per_rank_checkpoint(runs):
    (result,), _ = runs["chat_asks_for_the_config_flag_of_a_per_rank_checkpoint"]
    one_error_line(result, "per-rank", "--config")


@commands
def chat_names_the_flags_a_checkpoint_cannot_serve(directory):
    return [chat("--tiny", "--interactive", "--num-devices", "1", "--mtp"),
            chat("--tiny", "--interactive", "--num-devices", "1", "--gemm-impl", "fp8")]


def test_chat_names_the_flags_a_checkpoint_cannot_serve(runs):
    (mtp, fp8), _ = runs["chat_names_the_flags_a_checkpoint_cannot_serve"]
    one_error_line(mtp, "--mtp:", "holds no multi-token-prediction (MTP) layer", "run without --mtp")
    one_error_line(fp8, "--gemm-impl fp8", "holds bf16 weights")


def test_chat_names_the_missing_flag_of_a_multi_process_start():
    """A process of its own, in an environment without jax's settings (JAX_NUM_PROCESSES, ...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    result = run("-m", "dsv3_jax.chat", "--tiny", "--interactive", "--coordinator-address", "127.0.0.1:9",
                 env=env, timeout=60)
    one_error_line(result, "cannot start a multi-process run", "--num-processes (or JAX_NUM_PROCESSES)",
                   "--process-id (or JAX_PROCESS_ID)")


@commands
def batch_prompt_without_room_for_a_completion(directory):
    (directory / "prompts.txt").write_text("Hello there\n")
    return [chat("--tiny", "--input-file", directory / "prompts.txt", "--num-devices", "1",
                 "--max-seq-len", prompt_length("Hello there"))]


def test_batch_prompt_without_room_for_a_completion(runs):
    (result,), _ = runs["batch_prompt_without_room_for_a_completion"]
    length = prompt_length("Hello there")
    one_error_line(result, "prompt 1", f"{length} tokens", f"--max-seq-len={length}")


# ------------------------------------------------------------------ dsv3-chat: feedback
BATCH_PROMPTS = ["Hello there", "Describe a red lamp in a few words, please."]
# room for 3 tokens after the longer prompt: its completion is cut (greedy: the tiny model babbles on)
BATCH_LIMIT = max(map(prompt_length, BATCH_PROMPTS)) + 3


@commands
def batch_notes_cut_completions_and_prints_rates(directory):
    (directory / "prompts.txt").write_text("\n".join(BATCH_PROMPTS) + "\n")
    return [chat("--tiny", "--input-file", directory / "prompts.txt", "--num-devices", "1",
                 "--max-seq-len", BATCH_LIMIT, "--max-new-tokens", 40, "--temperature", 0)]


def test_batch_notes_cut_completions_and_prints_rates(runs):
    (result,), _ = runs["batch_notes_cut_completions_and_prints_rates"]
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert f"dsv3-chat: completion 2 stopped after 3 tokens at --max-seq-len={BATCH_LIMIT}" in lines
    rates = [RATES.fullmatch(line) for line in lines]
    assert sum(bool(r) for r in rates) == 1
    assert int(next(r for r in rates if r).group(1)) == sum(map(prompt_length, BATCH_PROMPTS))


# The interactive session's flags: room for 3 tokens after "Hello there". The not-UTF-8 session
# takes them too (any would do), so that both compile one decode step.
INTERACTIVE = ("--tiny", "--interactive", "--num-devices", "1", "--max-seq-len", prompt_length("Hello there") + 3,
               "--max-new-tokens", 40, "--temperature", 0)


@commands
def interactive_notes_a_cut_answer_and_prints_rates(directory):
    return [chat(*INTERACTIVE, stdin="Hello there\n")]


def test_interactive_notes_a_cut_answer_and_prints_rates(runs):
    (result,), _ = runs["interactive_notes_a_cut_answer_and_prints_rates"]
    limit = prompt_length("Hello there") + 3
    assert result.returncode == 0, result.stderr
    assert f"dsv3-chat: the answer stopped after 3 tokens at --max-seq-len={limit}" in result.stderr
    rates = RATES.search(result.stdout)
    assert rates and int(rates.group(1)) == limit - 3 and int(rates.group(2)) == 2, result.stdout


@commands
def chat_rejects_input_that_is_not_utf8(directory):
    return [chat(*INTERACTIVE, stdin=b"\xff\xfe\x00binary\n"),
            chat("--complete", "--tiny", "--num-devices", "1", stdin=b"def f(x):\n    \xff\xfe\n")]


def test_chat_rejects_input_that_is_not_utf8(runs):
    (interactive, complete), _ = runs["chat_rejects_input_that_is_not_utf8"]
    one_error_line(interactive, "standard input is not UTF-8 text")
    one_error_line(complete, "dsv3-chat: error: standard input is not UTF-8 text")


@commands
def help_shows_defaults_and_explains_each_flag(directory):
    return [chat("--help")]


def test_help_shows_defaults_and_explains_each_flag(runs):
    (result,), _ = runs["help_shows_defaults_and_explains_each_flag"]
    text = result.stdout
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
@commands
def tool_refuses_an_existing_output_without_progress_noise(directory):
    out = directory / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    return [tool("to_orbax", "--hf-ckpt-path", TINY, "--save-path", out)]


def test_tool_refuses_an_existing_output_without_progress_noise(runs):
    (result,), directory = runs["tool_refuses_an_existing_output_without_progress_noise"]
    out = directory / "taken"
    line = one_error_line(result, "dsv3-to-orbax: error:", str(out), "already exists")
    assert "%" not in line and (out / "mine.txt").read_text() == "keep"


@commands
def tool_names_the_users_output_path_not_its_staging_directory(directory):
    return [tool("to_orbax", "--hf-ckpt-path", TINY, "--save-path", "/proc/x")]


def test_tool_names_the_users_output_path_not_its_staging_directory(runs):
    (result,), _ = runs["tool_names_the_users_output_path_not_its_staging_directory"]
    line = one_error_line(result, "cannot create save path /proc/x")
    assert ".partial" not in line


@commands
def cast_without_fp8_tensors_is_an_error_and_writes_nothing(directory):
    return [tool("fp8_cast_bf16", "--input-fp8-hf-path", TINY, "--output-bf16-hf-path", directory / "cast")]


def test_cast_without_fp8_tensors_is_an_error_and_writes_nothing(runs):
    (result,), directory = runs["cast_without_fp8_tensors_is_an_error_and_writes_nothing"]
    one_error_line(result, f"no fp8 tensors in {TINY}: nothing to cast")
    assert list(directory.iterdir()) == []


# `python convert/<tool>.py --help`, then which dsv3_jax it imported, in the same process
WHICH_PACKAGE = "import sys; print(sys.modules['dsv3_jax'].__file__)\n"
# Before each shim: the process as a new one is for the shim (no dsv3_jax imported; the driver
# restores sys.path before every command, so no earlier shim's path entry is left either)
FORGET_PACKAGE = "import sys\nfor name in [m for m in sys.modules if m.split('.')[0] == 'dsv3_jax']: del sys.modules[name]\n"
SHIMS = ["convert", "to_orbax", "fp8_cast_bf16"]


@pytest.fixture(scope="module")
def shim_runs(request, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]]:
    """For each selected shim: what `python convert/<name>.py --help` gave, then which dsv3_jax the process
    had imported; all run from a directory of their own, nothing installed on the path (no PYTHONPATH),
    in one process (one start for all), the checkout's package forgotten before each shim."""
    selected = [name for name in SHIMS if any(item.module is request.module and
                                              item.originalname == "test_convert_scripts_run_from_a_checkout" and
                                              item.callspec.params["name"] == name for item in request.session.items)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    here = tmp_path_factory.mktemp("shims")
    (here / "which.py").write_text(WHICH_PACKAGE)
    (here / "forget.py").write_text(FORGET_PACKAGE)
    calls = [call for name in selected for call in (((here / "forget.py",), b"", here),
                                                    ((ROOT / "convert" / f"{name}.py", "--help"), b"", here),
                                                    ((here / "which.py",), b"", here))]
    results = python_each(*calls, env=env)
    assert all(forget.returncode == 0 for forget in results[::3]), results[::3]
    return {name: (results[3 * i + 1], results[3 * i + 2]) for i, name in enumerate(selected)}


@pytest.mark.parametrize("name", SHIMS)
def test_convert_scripts_run_from_a_checkout(shim_runs, name):
    """`python convert/<tool>.py` (the reference's way) from any directory, nothing installed on the
    path: the shim imports this checkout's package (none imported before it: `shim_runs`)."""
    result, where = shim_runs[name]
    assert result.returncode == 0 and "--help" in result.stdout, result.stderr
    assert where.returncode == 0 and Path(where.stdout.strip()) == ROOT / "dsv3_jax" / "__init__.py", where


@commands
def tool_rejects_unknown_flags_in_one_line(directory):
    return [tool("convert", "--bogus")]


def test_tool_rejects_unknown_flags_in_one_line(runs):
    (result,), _ = runs["tool_rejects_unknown_flags_in_one_line"]
    one_error_line(result, "dsv3-convert: error:", "--bogus")


MEMORY_PLAN = ROOT / "scripts" / "memory_plan.py"


@commands
def memory_plan_reads_hf_configs_and_reports_bad_ones_in_one_line(directory):
    bad = directory / "config.json"
    bad.write_text(json.dumps({**json.loads((TINY / "config.json").read_text()), "hidden_size": "big"}))
    return [((MEMORY_PLAN, "--config", TINY / "config.json", "--devices", 1, "--batch", 1, "--seq-len", 64,
              "--prefill-chunk", 64), b""),
            ((MEMORY_PLAN, "--config", bad), b""), ((MEMORY_PLAN, "--config", directory / "none.json"), b"")]


def test_memory_plan_reads_hf_configs_and_reports_bad_ones_in_one_line(runs):
    (good, bad, missing), directory = runs["memory_plan_reads_hf_configs_and_reports_bad_ones_in_one_line"]
    assert good.returncode == 0, good.stderr
    assert "# Memory plan: config.json" in good.stdout
    one_error_line(bad, "'hidden_size' must be int")
    one_error_line(missing, f"config file not found: {directory / 'none.json'}")


# ------------------------------------------------------------------ how many devices by default
@commands
def demo_runs_on_the_devices_its_heads_divide(directory):
    return [chat("--complete", "--temperature", 0, "--max-new-tokens", 3, stdin="def f(x):")]


def test_demo_runs_on_the_devices_its_heads_divide(runs):
    """Would catch the default of every device failing on a machine whose device count the demo's 6 heads
    do not divide (the tests' 4 host devices, as on a 4- or 8-GPU machine): it completes on 2 of the 4,
    and the start-up line says why."""
    (result,), _ = runs["demo_runs_on_the_devices_its_heads_divide"]
    assert result.returncode == 0, result.stderr
    assert "on 2 of the 4 devices, the most its dimensions divide into: with 4, n_heads=6" in result.stderr
    assert result.stdout.startswith("def f(x):") and len(result.stdout) > len("def f(x):")
