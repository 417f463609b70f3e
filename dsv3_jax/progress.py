"""Progress bars of long reads and writes (loading a checkpoint, the conversion tools).

One rule for all of them: `enabled=None` shows the bar when stderr is a terminal, so that logs,
tests and pipes stay free of bar redraws; only process 0 of a multi-process run draws one.
"""
from __future__ import annotations

import sys

import jax
from tqdm import tqdm


def shows_progress(enabled: bool | None) -> bool:
    """Whether a bar is drawn: `enabled`, or when None, whether stderr is a terminal; never off process 0."""
    if jax.process_index() != 0:
        return False
    if enabled is None:
        return sys.stderr is not None and sys.stderr.isatty()
    return bool(enabled)


def progress_bar(total: int | None, *, desc: str, unit: str = "tensor", enabled: bool | None = None,
                 **kwargs) -> tqdm:
    """A tqdm bar on stderr (a silent one when not shown, so callers update it unconditionally)."""
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr,
                disable=not shows_progress(enabled), **kwargs)
