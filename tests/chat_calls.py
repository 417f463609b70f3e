"""Several command lines (`python -m <module> ...` or `python <script> ...`) run one after another in
one Python process: one start and one jax import for all, where a process per case would cost a
start each. For the checks of what a command prints and returns; the tests that start a command as
a process of its own keep the process's own start-up and exit covered.

Each command runs as Python runs it: its module (runpy.run_module) or script (runpy.run_path) as
`__main__`, with its own sys.argv, sys.path[0] (the script's directory; for -m, the working
directory) and standard input, and its exit status as the interpreter gives it (SystemExit: its
code, None 0, any other value printed on stderr and 1; an uncaught exception: 1 and the traceback
on stderr). Its stdout and stderr are caught at the file descriptors, so what C++ code (XLA's
logs) writes is caught too. The warning filters it sets are undone after it, and each command sees
a warning again that an earlier one saw (as a fresh process would)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each call: argv after `python`, its standard input as latin-1 text of the bytes (JSON carries no
# bytes) and its working directory; one JSON line [status, stdout, stderr] per call, on a copy of
# the driver's own stdout.
DRIVER = """
import json, os, runpy, sys, tempfile, traceback, warnings, io
results = os.fdopen(os.dup(1), "w")
home = list(sys.path)

def run(argv):
    if argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")

def status(argv):
    try:
        run(argv)
        return 0
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    return 1

for argv, stdin, cwd in json.loads(sys.argv[1]):
    os.chdir(cwd)
    sys.path[:] = home
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode("latin-1")), encoding="utf-8")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, warnings.catch_warnings():
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            code = status(argv)
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        texts = []
        for file in (out, err):
            file.seek(0)
            texts.append(file.read().decode("utf-8", "replace"))
    print(json.dumps([code, *texts]), file=results, flush=True)
"""


def python_each(*calls: tuple[tuple, bytes | str] | tuple[tuple, bytes | str, Path], env: dict | None = None,
                timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """For each (argv, stdin[, cwd]), what `python *argv` gives (status, stdout, stderr), all in one
    process started in `env` (default: this process's environment); cwd defaults to the checkout's root."""
    wanted = []
    for argv, stdin, *cwd in calls:
        stdin = stdin.decode("latin-1") if isinstance(stdin, bytes) else stdin.encode().decode("latin-1")
        wanted.append(([str(a) for a in argv], stdin, str(cwd[0] if cwd else ROOT)))
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(wanted)], capture_output=True, text=True,
                            timeout=timeout, cwd=ROOT, env=dict(os.environ) if env is None else env)
    assert result.returncode == 0, result.stderr
    got = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(got) == len(wanted), result.stdout + result.stderr
    return [subprocess.CompletedProcess(argv, code, out, err) for (argv, *_), (code, out, err) in zip(wanted, got)]


def chat_each(*calls: tuple[tuple, bytes | str]) -> list[subprocess.CompletedProcess]:
    """For each (argv, stdin), what `python -m dsv3_jax.chat *argv` gives (status, stdout, stderr)."""
    results = python_each(*((("-m", "dsv3_jax.chat", *argv), stdin) for argv, stdin in calls))
    return [subprocess.CompletedProcess(r.args[2:], r.returncode, r.stdout, r.stderr) for r in results]
