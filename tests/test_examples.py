"""The example notebook runs top to bottom on a CPU (executed with nbclient): every cell without error,
its own asserts tying forward, the jitted step, prefill/decode and generate together, and the expert-load
heat map drawn."""
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # test-only packages
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "walkthrough.ipynb"


def test_notebook_runs_top_to_bottom():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "commit the notebook without outputs"
    # one host device, as a user's CPU has (the test session forces four)
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=env)  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    for expected in ("routed experts", "greedy by forward:", "cache donated: True", "prefill + decode:", " -> ",
                     "tokens per expert"):
        assert expected in text, expected
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1 and len(images[0].data["image/png"]) > 1000  # the heat map
