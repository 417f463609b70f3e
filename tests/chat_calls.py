"""dsv3-chat's main() called once per argv in one Python process (one jax import for all): for
checks of what the CLI prints and returns before it loads a model, where a process per case would
cost a start each. The tests that start `python -m dsv3_jax.chat` itself keep the process's own
start-up and exit covered."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each call: argv, and its standard input as latin-1 text of the bytes (JSON carries no bytes).
# Its exit status is the one `sys.exit(main())` gives (an uncaught exception: 1, the traceback on
# its stderr, as Python prints it); one JSON line [argv, status, stdout, stderr] per call.
DRIVER = """
import contextlib, io, json, sys, traceback
from dsv3_jax.chat import main
for argv, stdin in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode("latin-1")), encoding="utf-8")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps([argv, code, out.getvalue(), err.getvalue()]))
"""


def chat_each(*calls: tuple[tuple, bytes | str]) -> list[subprocess.CompletedProcess]:
    """For each (argv, stdin), what `python -m dsv3_jax.chat *argv` gives (status, stdout, stderr)."""
    wanted = [([str(a) for a in argv], stdin.decode("latin-1") if isinstance(stdin, bytes) else
               stdin.encode().decode("latin-1")) for argv, stdin in calls]
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(wanted)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    got = [json.loads(line) for line in result.stdout.splitlines()]
    assert [argv for argv, *_ in got] == [argv for argv, _ in wanted], result.stdout
    return [subprocess.CompletedProcess(argv, code, out, err) for argv, code, out, err in got]
