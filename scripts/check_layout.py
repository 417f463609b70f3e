"""Check the package's shape: the import graph of dsv3_jax and pallas_kernels has no cycle, no
function-level (lazy) import of a project module and no import up the layers below; and no function
of dsv3_jax, pallas_kernels, convert or scripts is longer than 80 lines.

    python scripts/check_layout.py   # exit 1 and one line per problem, if any
"""
import ast, sys
from pathlib import Path

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
PKGS = ("dsv3_jax", "pallas_kernels")
# lower number = lower layer; a module may import only its own layer or lower ones
LAYERS = [("pallas_kernels", 0), ("dsv3_jax.errors", 1), ("dsv3_jax.config", 1), ("dsv3_jax.progress", 1),
          ("dsv3_jax.tokenizer", 1), ("dsv3_jax.sharding", 2), ("dsv3_jax.options", 3), ("dsv3_jax.model", 4),
          ("dsv3_jax.checkpoint", 5), ("dsv3_jax.decode", 5), ("dsv3_jax.memory", 6), ("dsv3_jax.training", 6),
          ("dsv3_jax.api", 6),
          ("dsv3_jax.serving", 7), ("dsv3_jax.cli", 7), ("dsv3_jax.convert", 8), ("dsv3_jax.chat", 9),
          ("dsv3_jax.serve", 9), ("dsv3_jax", 10)]
# modules that import an optional extra's packages (serve: starlette); the command line imports them only
# when it uses them, so that --help and flag errors work without the extra
OPTIONAL_EXTRAS = {"dsv3_jax.serving.app"}


def layer(mod):
    best = None
    for prefix, n in LAYERS:
        if mod == prefix or mod.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, n)
    return best[1] if best else None

modules = {}
for pkg in PKGS:
    for f in (ROOT / pkg).rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        modules[".".join(parts)] = (f, is_pkg)

def resolve(mod, is_pkg, node):
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module
    targets = []
    for alias in node.names:
        sub = f"{name}.{alias.name}"
        targets.append(sub if sub in modules else name)
    return targets

graph, problems = {}, []
for mod, (f, is_pkg) in modules.items():
    tree = ast.parse(f.read_text())
    deps = set()
    top = set(id(n) for n in tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            targets = resolve(mod, is_pkg, node)
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        targets = [t for t in targets if t.split(".")[0] in PKGS]
        if not targets:
            continue
        if id(node) not in top and not set(targets) <= OPTIONAL_EXTRAS:
            problems.append(f"lazy import in {mod} line {node.lineno}: {targets}")
        for t in targets:
            while t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t != mod:
                deps.add(t)
    graph[mod] = deps
    lm = layer(mod)
    for t in deps:
        lt = layer(t)
        if lm is not None and lt is not None and lt > lm and not (mod.startswith(t + ".") or t.startswith(mod + ".")):
            problems.append(f"upward import: {mod} (layer {lm}) imports {t} (layer {lt})")

# cycles among modules (package __init__ files excluded: importing a submodule runs them, not a cycle of code)
index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)
def strong(v):
    index[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on.add(v)
    for w in graph.get(v, ()):
        if w not in index:
            strong(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1:
            sccs.append(comp)
for v in graph:
    if v not in index:
        strong(v)
for c in sccs:
    problems.append(f"import cycle: {sorted(c)}")

# functions longer than MAX_LINES outside tests
MAX_LINES = 80
for folder in (*PKGS, "convert", "scripts"):
    for f in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_LINES:
                    problems.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} has {length} lines")

print(f"{len(modules)} modules, {sum(map(len, graph.values()))} project imports")
print("\n".join(problems) or f"no cycle, no lazy project import, no upward import, no function over {MAX_LINES} lines")
sys.exit(1 if problems else 0)
