"""The package's shape, checked from its source: no import cycle, no lazy import of a project module (but
of an optional extra), no import up the layers, no function over 80 lines (`scripts/check_layout.py`)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layout_rules_hold():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_layout.py"), str(ROOT)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
