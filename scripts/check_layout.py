"""Measures of kvinfer's layout: import cycles at module level and file sizes (no Python file over 600 lines
outside kvinfer/bench and kvinfer/lab, no C file over 800). The layers imports may point down are
tests/test_layers_imports.py's table.

`python scripts/check_layout.py` prints every finding and exits 1 if there is one; tests/test_layers_imports.py
asserts there is none."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvinfer"

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


def cycle_findings() -> list[str]:
    """Each strongly connected set of modules whose module-level imports go round (lazy imports inside
    functions are not counted: they run after every module involved has loaded)."""
    mods = modules()
    edges = {name: {target for target, _, top in imports(mods, name) if top} for name in mods}
    return ["import cycle at module level: " + " -> ".join(comp) for comp in cycles(edges)]


def size_findings() -> list[str]:
    out = []
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
    found = cycle_findings() + size_findings()
    for line in found:
        print(line)
    print(f"{len(modules())} modules; {len(found)} finding(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
