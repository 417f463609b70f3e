"""Which kernels of a compiled program use programmatic dependent launch, from XLA's PTX dump.

    XLA_FLAGS=--xla_dump_to=/tmp/dump PYTHONPATH=. python3 scripts/bench_model.py ... --decode-batches 1
    python3 scripts/pdl_report.py /tmp/dump

A kernel launched with PDL may start while its predecessor still runs; it waits for the predecessor's writes at
`griddepcontrol.wait`, and lets its own successor launch early at `griddepcontrol.launch_dependents`. This reads
every `*.ptx` file under the dump folder, splits it into its kernels (`.entry`) and prints, per kernel name (the
numbered copies of one kernel summed), how many copies there are and how many hold each instruction.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)")
COPY_SUFFIX = re.compile(r"(_\d+)+$")  # XLA numbers the copies of one fusion or custom call


def kernels(ptx: str) -> list[tuple[str, str]]:
    """(name, body) of each `.entry` of one PTX module, the body running to the next entry."""
    starts = list(ENTRY.finditer(ptx))
    ends = [m.start() for m in starts[1:]] + [len(ptx)]
    return [(m.group(1), ptx[m.start():end]) for m, end in zip(starts, ends, strict=True)]


def report(folder: Path) -> list[tuple[str, int, int, int]]:
    """(kernel name, copies, copies with griddepcontrol.wait, with launch_dependents), the most copies first."""
    copies, waits, launches = Counter(), Counter(), Counter()
    for path in sorted(folder.rglob("*.ptx")):
        for name, body in kernels(path.read_text(errors="replace")):
            base = COPY_SUFFIX.sub("", name)
            copies[base] += 1
            waits[base] += "griddepcontrol.wait" in body
            launches[base] += "griddepcontrol.launch_dependents" in body
    return [(name, n, waits[name], launches[name]) for name, n in copies.most_common()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump", type=Path, help="the folder XLA_FLAGS=--xla_dump_to wrote")
    o = p.parse_args()
    rows = report(o.dump)
    if not rows:
        sys.exit(f"pdl_report: no kernels in any .ptx file under {o.dump} (was XLA_FLAGS=--xla_dump_to set?)")
    print(f"{'kernel':48s} {'copies':>7s} {'wait':>6s} {'launch':>7s}")
    for name, n, wait, launch in rows:
        print(f"{name[:48]:48s} {n:7d} {wait:6d} {launch:7d}")
    total = sum(r[1] for r in rows)
    print(f"{'all':48s} {total:7d} {sum(r[2] for r in rows):6d} {sum(r[3] for r in rows):7d}")


if __name__ == "__main__":
    main()
