"""Every repository path the README names exists in a clone (no ../shared, nothing downloaded)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("configs", "tests", "scripts", "examples", "benchmarks", "dsv3_jax", "pallas_kernels", "convert", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*)" % "|".join(re.escape(t) for t in TOP))


def test_readme_paths_exist():
    text = (ROOT / "README.md").read_text()
    named = {m.rstrip(".") for m in PATH.findall(text)}
    named = {p for p in named if not re.search(r"[<{*]", text[text.index(p):text.index(p) + len(p) + 1])}
    assert "configs/config_671B.json" in named and "examples/walkthrough.ipynb" in named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
    assert "../shared" not in text


def test_notebook_api_example_runs(capsys):
    """The README's first Notebook API block (the demo model from Python) runs as written."""
    section = (ROOT / "README.md").read_text().split("## Notebook API", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("def fibonacci(n):\n") and len(printed.splitlines()) > 2, printed
