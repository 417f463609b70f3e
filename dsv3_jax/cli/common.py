"""What every command-line tool of the package shares: an argument parser whose errors and help
follow one style, and the wrapper that turns a user's mistake into one line on stderr (and ends each
process of a multi-process run).

A mistake the user can fix (a bad flag, path, config or checkpoint) is a `ValueError` (ConfigError,
CheckpointError, TokenizerError, the tools' own errors) or an `OSError`; it ends the command with
`<prog>: error: <one line>` and exit code 1, never a traceback. Anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Sequence

import jax

from ..api import auto_num_devices

USER_ERRORS = (ValueError, OSError)


class UsageError(ValueError):
    """A problem the user can fix (bad flags, files, prompts, settings); reported in one line."""


def one_line(err: BaseException) -> str:
    """The error's message with its whitespace (newlines included) collapsed."""
    return " ".join(str(err).split()) or type(err).__name__


def devices_used(model, asked: int | None) -> str:
    """How many devices `model` runs on, for a tool's start-up line; when `--num-devices` was not given
    (`asked` None: the most that the model's dimensions divide into) and that is fewer than all, why."""
    used, available = model.mesh.devices.size, jax.device_count()
    if asked is not None or used >= available:
        return f"on {used} device(s)"
    reason = auto_num_devices(model.args, model.options, available)[1]
    return f"on {used} of the {available} devices, the most its dimensions divide into: with {available}, {reason}"


def run_cli(prog: str, main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> int:
    """Run a command's `main`: 0 when it returns, 1 with one line for a user error, 130 on Ctrl-C.
    A process of a multi-process run ends here, with that code (`leave_distributed_run`)."""
    code = _exit_code(prog, main, argv)
    if jax.distributed.is_initialized():
        leave_distributed_run(code)
    return code


def _exit_code(prog: str, main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None) -> int:
    try:
        main(argv)
    except USER_ERRORS as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


def leave_distributed_run(code: int) -> NoReturn:
    """End this process of a jax.distributed run: wait at jax's shutdown barrier for the others
    (process 0 serves the coordination they still use), then exit without the interpreter's
    teardown, in which jaxlib's CPU client can hang for good joining an idle worker thread."""
    sys.stdout.flush()
    sys.stderr.flush()
    jax.distributed.shutdown()
    os._exit(code)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless there is none to show (None, an off switch) or the help
    text already explains it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in --help and one-line errors (`<prog>: error: ...`, exit 2): the
    usage block argparse prints above an error would bury the line that matters."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        # An unknown flag is reported first: argparse would complain about the required arguments
        # it displaced (or a typo of one of them) instead.
        switches = [*self._actions, *self._mutually_exclusive_groups]
        required = [item for item in switches if item.required]
        for item in required:
            item.required = False
        try:
            _, unknown = self.parse_known_args(args, None)
        finally:
            for item in required:
                item.required = True
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")
