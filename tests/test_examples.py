"""The notebook example runs top to bottom (its own asserts tie forward, the jitted steps and generate)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_notebook_example_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "notebook.py")], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prefill + decode:" in result.stdout and "->" in result.stdout
