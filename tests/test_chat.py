"""The chat CLI, driven through stdin in a subprocess, against the same turns computed here through
the Python API (chat template -> generate -> decode); and the embedded demo checkpoint."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsv3_jax
from chat_calls import python_each
from dsv3_jax.decode.generate import generate
from dsv3_jax.checkpoint.safetensors import TensorIndex
from dsv3_jax.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(dsv3_jax.__file__).parent / "assets" / "tiny"
DEMO = Path(dsv3_jax.__file__).parent / "assets" / "demo"
ANSWER = re.compile(r"(?:>>> )+(.*?)\n\[prefill (\d+) tokens [\d.]+ tok/s · decode \d+ tokens [\d.-]+ tok/s\]\n", re.S)


def expected_turns(model, tokenizer, turns: list[str], *, temperature: float, max_new_tokens: int = 200,
                   seed: int = 0) -> list[str]:
    """The interactive chat's answers, replayed through the API: history through the chat template,
    turn i sampled with seed + i over the session's fixed window (max_seq_len)."""
    history, answers = [], []
    for turn in turns:
        if turn == "/clear":
            history = []
            continue
        history.append({"role": "user", "content": turn})
        ids = tokenizer.apply_chat_template(history)
        completion = generate(model, [ids], max_new_tokens, tokenizer.eos_id, temperature, seed + len(answers),
                              window=model.args.max_seq_len)[0]
        answers.append(tokenizer.decode(completion))
        history.append({"role": "assistant", "content": answers[-1]})
    return answers


INTERACTIVE_TURNS = ["Hello! Tell me about the weather.", "What is 3 plus 4?", "/clear", "Who are you?"]
BATCH_PROMPTS = ["What is 3 plus 4?", "Describe a red lamp.", "Hello, my name is Ada."]
COMPLETE_PROMPT = "def fibonacci(n):"


def cli_calls(root: Path) -> dict[str, tuple[tuple, str]]:
    """The tests' chat command lines (argv after `python`, stdin), made in `root`. The batch runs share
    their prompts, lengths and window, so that their steps compile once."""
    (root / "prompts.txt").write_text("\n".join(BATCH_PROMPTS) + "\n\n")
    (root / "empty.txt").write_text("\n")
    checkpoint = tiny_with_mtp(root / "tiny_mtp")
    greedy = ("--ckpt-path", str(checkpoint), "--input-file", str(root / "prompts.txt"), "--num-devices", "1",
              "--max-new-tokens", "32", "--temperature", "0")
    calls = {
        "usage": (("--max-new-tokens", "5"), ""),
        "nowhere": (("--interactive", "--ckpt-path", str(root / "nowhere")), ""),
        "empty": (("--tiny", "--input-file", str(root / "empty.txt")), ""),
        "two": (("--tiny", "--complete", "--ckpt-path", str(TINY)), ""),
        "blank": (("--tiny", "--complete"), "\n"),
        "interactive": (("--tiny", "--interactive", "--num-devices", "1"), "\n".join(INTERACTIVE_TURNS) + "\n"),
        "exit": (("--tiny", "--interactive", "--num-devices", "1", "--max-new-tokens", "8"),
                 "Hi\n/exit\nThis is never answered\n"),
        "batch": (("--tiny", "--input-file", str(root / "prompts.txt"), "--num-devices", "1", "--max-new-tokens", "32"),
                  ""),
        "complete": (("--complete", "--num-devices", "1", "--temperature", "0", "--max-new-tokens", "24"),
                     COMPLETE_PROMPT + "\n"),
        "plain": (greedy, ""),
        "mtp": ((*greedy, "--mtp"), ""),
    }
    return {name: (("-m", "dsv3_jax.chat", *argv), stdin) for name, (argv, stdin) in calls.items()}


def entry_point_calls() -> dict[str, tuple[tuple, str]]:
    """`<script> --help` of each installed console script, run as Python runs the script (its file as
    `__main__`)."""
    scripts = {name: Path(sys.executable).parent / name for name in ENTRY_POINTS}
    return {name: ((script, "--help"), "") for name, script in scripts.items() if script.exists()}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, dict[str, subprocess.CompletedProcess]]:
    """What the command lines of the `cli` and `entry_point_helps` fixtures give, for those the selected
    tests use, all run in one process (`python_each`: one start and one jax import for all;
    test_distributed starts the CLI as processes of their own)."""
    used = {name for item in request.session.items if item.module is request.module for name in item.fixturenames}
    groups = {}
    if "cli" in used:
        groups["cli"] = cli_calls(tmp_path_factory.mktemp("chat"))
    if "entry_point_helps" in used:
        groups["entry_point_helps"] = entry_point_calls()
    results = iter(python_each(*(call for calls in groups.values() for call in calls.values())))
    return {group: {name: next(results) for name in calls} for group, calls in groups.items()}


@pytest.fixture(scope="module")
def cli(runs) -> dict[str, subprocess.CompletedProcess]:
    """What each of the tests' chat command lines gives (`cli_calls`)."""
    return runs["cli"]


@pytest.fixture(scope="module")
def demo():
    """The embedded model as the CLI loads it by default (bf16, 4096 positions), on one device."""
    return dsv3_jax.load(TINY, max_batch_size=1, max_seq_len=4096), Tokenizer.from_dir(TINY)


def test_interactive_demo_streams_answers_with_history_and_clear(cli, demo):
    turns, result = INTERACTIVE_TURNS, cli["interactive"]
    assert result.returncode == 0, result.stderr  # end of input exits cleanly
    answers = ANSWER.findall(result.stdout)
    model, tokenizer = demo
    expected = expected_turns(model, tokenizer, turns, temperature=0.2)
    assert [a for a, _ in answers] == expected
    assert all(int(n) > 0 for _, n in answers)
    assert result.stdout.endswith(">>> \n")
    assert result.stdout.count(">>> ") == len(turns) + 1


def test_exit_command_ends_the_session(cli):
    result = cli["exit"]
    assert result.returncode == 0, result.stderr
    assert len(ANSWER.findall(result.stdout)) == 1


def test_batch_mode_prints_prompt_completion_pairs(cli):
    prompts, result = BATCH_PROMPTS, cli["batch"]
    assert result.returncode == 0, result.stderr
    model = dsv3_jax.load(TINY, max_batch_size=3, max_seq_len=4096)
    tokenizer = Tokenizer.from_dir(TINY)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    completions = model.generate(ids, 32, tokenizer.eos_id, temperature=0.2, seed=0)
    expected = "".join(f"Prompt: {p}\nCompletion: {tokenizer.decode(c)}\n\n" for p, c in zip(prompts, completions))
    assert result.stdout == expected


def test_bad_invocations_fail_in_one_line(cli):
    usage, nowhere, empty, two, blank = (cli[name] for name in ("usage", "nowhere", "empty", "two", "blank"))
    assert usage.returncode == 2 and "one of the arguments --input-file --interactive --complete is required" in usage.stderr
    assert nowhere.returncode == 1
    assert nowhere.stderr.strip().count("\n") == 0 and "dsv3-chat: error:" in nowhere.stderr
    assert empty.returncode == 1 and "holds no prompts" in empty.stderr
    assert two.returncode == 2 and "--tiny and --ckpt-path" in two.stderr
    assert blank.returncode == 1 and "the prompt is empty" in blank.stderr


def test_complete_with_the_demo_model_by_default(cli):
    """The default model is the trained demo; --complete continues raw text (BOS + prompt, no chat
    template), greedy here, exactly as the API does, and the continuation is Python."""
    prompt, result = COMPLETE_PROMPT, cli["complete"]
    assert result.returncode == 0, result.stderr
    assert "demo model" in result.stderr and "2,048 positions" in result.stderr
    tokenizer = Tokenizer.from_dir(DEMO)
    assert tokenizer.chat_template is None
    model = dsv3_jax.load(DEMO, max_batch_size=1)  # the window of its trained positions
    ids = tokenizer.encode(prompt)
    assert ids[0] == tokenizer.bos_id and len(ids) > 1
    completion = model.generate([ids], 24, tokenizer.eos_id, temperature=0.0)[0]
    assert result.stdout == prompt + tokenizer.decode(completion) + "\n"
    assert result.stdout.startswith(prompt + "\n    ")  # the function body is indented


def test_demo_assets_fit_and_are_documented():
    size = sum(f.stat().st_size for f in DEMO.iterdir())
    assert size <= 40 * 10**6
    names = sorted(p.name for p in DEMO.iterdir())
    assert names == ["MODEL_CARD.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((DEMO / "config.json").read_text())["num_nextn_predict_layers"] == 1


ENTRY_POINTS = {
    "dsv3-chat": ("--ckpt-path", "--tiny", "--config", "--input-file", "--interactive", "--complete", "--max-new-tokens",
                  "--temperature", "--num-devices", "--compute-dtype", "--gemm-impl", "--attn-impl", "--moe-impl",
                  "--decode-attn", "--unroll", "--max-seq-len", "--mtp", "--coordinator-address"),
    "dsv3-convert": ("--hf-ckpt-path", "--save-path", "--n-experts", "--model-parallel", "--keep-mtp"),
    "dsv3-to-orbax": ("--hf-ckpt-path", "--save-path"),
    "dsv3-fp8-cast-bf16": ("--input-fp8-hf-path", "--output-bf16-hf-path"),
}


@pytest.fixture(scope="module")
def entry_point_helps(runs) -> dict[str, subprocess.CompletedProcess]:
    """`<script> --help` of each installed console script (`entry_point_calls`)."""
    return runs["entry_point_helps"]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_installed_entry_points(name, entry_point_helps):
    """The console scripts (conftest puts this checkout's package first on their path)."""
    if name not in entry_point_helps:
        pytest.skip(f"{name} is not installed in this environment")
    result = entry_point_helps[name]
    assert result.returncode == 0, result.stderr
    for flag in ENTRY_POINTS[name]:
        assert flag in result.stdout, flag


# Host kernels that compute the regeneration's SVD differently (OpenBLAS picks one per CPU; forcing
# one whose instructions the CPU lacks kills the process with SIGILL). The regeneration fixes the
# SVD's gauge, so any two must agree with each other and with the shipped files: the text files
# exactly, every tensor value within one bf16 ulp. Most capable first, with the /proc/cpuinfo flags
# each needs. Not Haswell (nor Zen, which runs Haswell's kernels): numpy's bundled OpenBLAS (0.3.34) dies
# with SIGSEGV in the regeneration's SVD with those kernels on one thread, on this project's CI machines.
BLAS_CORETYPES_BY_FLAGS = (
    ("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    ("Sandybridge", {"avx"}),
    ("Nehalem", {"sse4_2"}),
)
BF16_ULP = 2.0**-7  # relative spacing of bf16 values (8 significant bits)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")),
                set())


def blas_coretypes() -> tuple[str, ...]:
    """The two most capable OpenBLAS core types this CPU executes (one where it has only one; an
    empty tuple, OpenBLAS's own choice alone, where /proc/cpuinfo says nothing)."""
    flags = cpu_flags()
    return tuple(name for name, needs in BLAS_CORETYPES_BY_FLAGS if needs <= flags)[:2]


def assert_same_assets(shipped: Path, fresh: Path) -> None:
    assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in shipped.iterdir())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (fresh / name).read_bytes() == (shipped / name).read_bytes(), name
    a_index, b_index = TensorIndex(shipped), TensorIndex(fresh)
    assert sorted(a_index.names()) == sorted(b_index.names())
    for name in a_index.names():
        a, b = (np.asarray(i.tensor(name), np.float32) for i in (a_index, b_index))
        assert a.shape == b.shape, name
        bound = BF16_ULP * np.maximum(np.abs(a), np.abs(b))
        bad = np.abs(a - b) > bound
        assert not bad.any(), f"{name}: {bad.sum()} values differ by over one bf16 ulp: {a[bad][:3]} vs {b[bad][:3]}"


def test_embedded_assets_are_small_and_regenerate_deterministically(tmp_path):
    size = sum(f.stat().st_size for f in TINY.iterdir())
    assert size < 3 * 2**20
    coretypes = blas_coretypes() or ("",)  # "": OpenBLAS's own choice
    outs = {coretype: tmp_path / (coretype or "default") for coretype in coretypes}
    runs = {}
    for coretype, out in outs.items():  # in parallel: a few seconds each
        # one BLAS thread: the result cannot depend on how OpenBLAS splits the work among threads (which
        # it decides by the load: a Haswell-kernel run died only now and then on two threads)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **({"OPENBLAS_CORETYPE": coretype} if coretype else {})}
        runs[coretype] = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "make_tiny_assets.py"), "--out", str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for coretype, process in runs.items():
        output, _ = process.communicate(timeout=180)
        assert process.returncode == 0, f"OPENBLAS_CORETYPE={coretype}: {output[-2000:]}"
    first, *others = outs.values()
    for other in others:
        assert_same_assets(first, other)
    assert_same_assets(TINY, first)
    config = json.loads((TINY / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["n_routed_experts"] > 1 and config["q_lora_rank"] > 0


def tiny_with_mtp(directory: Path) -> Path:
    """The embedded model plus a random MTP layer (layer num_hidden_layers, float32 tensors)."""
    import shutil

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import save_file

    from dsv3_jax.config import ModelArgs
    from dsv3_jax.checkpoint.mtp import mtp_hf_tensors
    from dsv3_jax.model.mtp import MTP
    from dsv3_jax.checkpoint.schema import hf_name, with_gate_bias

    shutil.copytree(TINY, directory)
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    index = TensorIndex(TINY)
    args = with_gate_bias(ModelArgs.from_file(directory / "config.json"), lambda name: hf_name(name) in index)
    # initialised in one compiled program (eagerly, every parameter's draw would compile one of its own)
    state = jax.jit(lambda: nnx.split(MTP(args, param_dtype=jnp.float32, rngs=nnx.Rngs(4)))[1])()
    tensors = mtp_hf_tensors(state, args)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(directory / "mtp.safetensors"))
    return directory


def test_batch_mode_with_mtp_gives_the_greedy_completions(cli):
    plain, fast = cli["plain"], cli["mtp"]
    assert plain.returncode == 0, plain.stderr
    assert fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout and plain.stdout.count("Completion: ") == 3
