"""Measures of kvinfer's layout (issue 47): import cycles, imports that run up the layers, file sizes.

`python scripts/check_layout.py` prints every finding and exits 1 if there is one; tests/test_layout.py runs the
same checks. The layer table below is the design: a module may import its own layer and the layers below it, at
module level or inside a function alike."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvinfer"

# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("kvinfer.errors", "kvinfer.utils", "kvinfer.options", "kvinfer.config", "kvinfer.sampling_params",
              "kvinfer.request")),
    ("kernels", ("kvinfer.kernels", "kvinfer.loaders.dequant")),
    ("layers", ("kvinfer.layers",)),
    ("kv", ("kvinfer.kv",)),
    ("models", ("kvinfer.models",)),
    ("loaders", ("kvinfer.loaders",)),
    ("step", ("kvinfer.structured", "kvinfer.sampler", "kvinfer.scheduler", "kvinfer.detokenizer",
              "kvinfer.engine.model_runner", "kvinfer.engine.outputs")),
    ("runtimes", ("kvinfer.parallel", "kvinfer.spec")),
    ("engine", ("kvinfer.engine",)),
    ("front", ("kvinfer", "kvinfer.server", "kvinfer.cli", "kvinfer.bench", "kvinfer.lab", "kvinfer.perplexity")),
]
MAX_PY_LINES = 600   # outside kvinfer/bench and kvinfer/lab
MAX_C_LINES = 800


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def layer_of(name: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def imports(mods: dict[str, Path], name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every kvinfer import in module `name`."""
    path = mods[name]

    def resolve(target: str) -> str:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target

    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never runs
            if isinstance(child, ast.Import):
                found.extend((resolve(a.name), child.lineno, top) for a in child.names if a.name.startswith("kvinfer"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = base[:len(base) - child.level + 1]
                    src = ".".join(base + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                if src.startswith("kvinfer"):
                    for a in child.names:
                        full = f"{src}.{a.name}"
                        found.append((full if full in mods else resolve(src), child.lineno, top))
            else:
                inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return [(t, line, top) for t, line, top in found if t and t != name]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter; counter += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter; counter += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def findings() -> list[str]:
    mods = modules()
    out = []
    top_edges: dict[str, set[str]] = {}
    for name in mods:
        rank = layer_of(name)
        if rank < 0:
            out.append(f"{name}: in no layer of scripts/check_layout.py's table")
        top_edges[name] = set()
        for target, line, top in imports(mods, name):
            if top:
                top_edges[name].add(target)
            if layer_of(target) > rank:
                out.append(f"{mods[name].relative_to(ROOT)}:{line}: {name} ({LAYERS[rank][0]}) imports {target} "
                           f"({LAYERS[layer_of(target)][0]}), a higher layer")
    for comp in cycles(top_edges):
        out.append("import cycle at module level: " + " -> ".join(comp))
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE)
        n = len(f.read_text().splitlines())
        if rel.parts[0] not in ("bench", "lab") and n > MAX_PY_LINES:
            out.append(f"kvinfer/{rel}: {n} lines (over {MAX_PY_LINES})")
    for f in sorted(list(PACKAGE.rglob("*.c")) + list(PACKAGE.rglob("*.h"))):
        n = len(f.read_text().splitlines())
        if n > MAX_C_LINES:
            out.append(f"kvinfer/{f.relative_to(PACKAGE)}: {n} lines (over {MAX_C_LINES})")
    return out


def main() -> int:
    found = findings()
    for line in found:
        print(line)
    print(f"{len(modules())} modules; {len(found)} finding(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
