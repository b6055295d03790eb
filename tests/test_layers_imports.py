"""Imports point down the layers of design.md only, and never go round at module level; the scheduler and block
bookkeeping never import torch; no file outgrows what a reader takes in (scripts/check_layout.py)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvinfer"

LAYERS = {
    0: ["errors", "config", "sampling_params", "utils", "options", "core"],
    1: ["layers", "core.sampler", "core.request", "detokenizer", "kernels", "loaders.dequant", "spec", "structured"],
    2: ["models", "loaders", "kv"],
    3: ["core.scheduler", "engine.model_runner", "parallel", "spec.draft", "spec.speculator"],
    4: ["engine"],
    5: ["server", "cli", "cli_chat", "__main__", "bench", "lab"],
}
TORCH_FREE = ["core.scheduler", "kv.block_pool", "kv.manager", "kv.interface", "core.request", "sampling_params", "errors", "config",
              "spec.ngram", "spec.speculator", "options"]


def layer_of(module: str) -> int:
    best = None
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (layer, len(p))
    assert best is not None, f"module kvinfer.{module} has no layer in this test's table"
    return best[0]


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if parts:
            yield ".".join(parts), path


def imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_imports_point_down():
    bad = []
    for mod, path in modules():
        mine = layer_of(mod)
        for imp in imports(path):
            if imp.startswith("kvinfer.") and imp != "kvinfer":
                theirs = layer_of(imp[len("kvinfer."):])
                if theirs > mine:
                    bad.append(f"kvinfer.{mod} (L{mine}) imports {imp} (L{theirs})")
    assert not bad, "\n".join(bad)


def test_bookkeeping_is_torch_free():
    for mod in TORCH_FREE:
        path = ROOT / (mod.replace(".", "/") + ".py")
        assert not [i for i in imports(path) if i.split(".")[0] in ("torch", "numpy")], mod


def test_tests_import_helpers_not_other_tests():
    """Shared fixtures and helpers live in conftest.py or *_helpers.py: a test module importing another runs the
    other's module-level setup and ties the two files together."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            bad += [f"{path.relative_to(tests)} imports {n}" for n in names
                    if n.split(".")[-1].startswith("test_")]
    assert not bad, "\n".join(bad)


def _check_layout():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_layout", ROOT.parent / "scripts" / "check_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycle_at_module_level():
    layout = _check_layout()
    assert not layout.cycle_findings()
    # the check itself finds a cycle where there is one
    assert layout.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_file_over_its_size():
    """Python files of up to ~600 lines (bench/ and lab/ aside), C files of up to ~800."""
    assert not _check_layout().size_findings()
