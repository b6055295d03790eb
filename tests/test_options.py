"""kvinfer.options: every KVINFER_* switch read once into a frozen object, bad values named in one line, the ways
tests change them, and the only place that reads them from the environment."""
from __future__ import annotations

import ast
import dataclasses
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from kvinfer import options
from kvinfer.options import OptionError, Options

ROOT = Path(__file__).resolve().parent.parent / "kvinfer"
FLAGS = {"KVINFER_KERNELS": "kernels", "KVINFER_AMX": "amx", "KVINFER_AMX_KEEP": "amx_keep",
         "KVINFER_PROMPT_BF16": "prompt_bf16", "KVINFER_BATCH_INVARIANT": "batch_invariant",
         "KVINFER_DROP_SOURCE": "drop_source", "KVINFER_TP_EXACT": "tp_exact"}


@pytest.fixture(autouse=True)
def _switches_follow_env():
    yield
    options.reload()  # the environment is restored by now: no test's setting outlives it


def test_defaults_from_an_empty_environment():
    o = Options.from_env({})
    assert o == Options(env=tuple((n, "") for n in options.NAMES))
    assert o.isa == "" and o.kernels and o.amx and o.batch_invariant and o.cache is None
    assert (o.tp_start_timeout, o.tp_step_timeout, o.measure_reps) == (300.0, 120.0, 30)


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_boolean_switches(name):
    field = FLAGS[name]
    for text, want in (("0", False), ("off", False), (" False ", False), ("no", False), ("1", True), ("ON", True),
                       ("yes", True), ("", True)):
        assert getattr(Options.from_env({name: text}), field) is want, (name, text)
    with pytest.raises(OptionError) as e:
        Options.from_env({name: "maybe"})
    assert str(e.value) == f"{name} must be 1 or 0 (true/false, yes/no, on/off), not 'maybe'"


def test_valued_switches_and_their_errors():
    o = Options.from_env({"KVINFER_ISA": " AVX2 ", "KVINFER_CACHE": "/tmp/kc", "KVINFER_TP_START_TIMEOUT": "15",
                          "KVINFER_TP_STEP_TIMEOUT": "2.5", "KVINFER_MEASURE_REPS": "7"})
    assert (o.isa, o.cache, o.tp_start_timeout, o.tp_step_timeout, o.measure_reps) == ("avx2", "/tmp/kc", 15.0, 2.5,
                                                                                        7)
    assert o.raw("KVINFER_ISA") == " AVX2 " and o.raw("KVINFER_AMX") == ""
    bad = {"KVINFER_ISA": "avx9000", "KVINFER_TP_START_TIMEOUT": "soon", "KVINFER_TP_STEP_TIMEOUT": "-1",
           "KVINFER_MEASURE_REPS": "0"}
    for name, text in bad.items():
        with pytest.raises(OptionError, match=f"^{name} must be .*, not '{text}'$") as e:
            Options.from_env({name: text})
        assert "\n" not in str(e.value) and isinstance(e.value, ValueError)


def test_the_isa_levels_are_the_kernels_levels():
    import kvinfer.kernels as kernels

    assert options.ISA_LEVELS == kernels.LEVELS


def test_read_once_until_reloaded(monkeypatch):
    monkeypatch.setenv("KVINFER_BATCH_INVARIANT", "1")
    assert options.reload().batch_invariant
    monkeypatch.setenv("KVINFER_BATCH_INVARIANT", "0")
    assert options.options().batch_invariant  # the environment is not read again by itself
    assert not options.reload().batch_invariant and not options.options().batch_invariant
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.options().batch_invariant = True
    monkeypatch.setenv("KVINFER_AMX", "perhaps")
    with pytest.raises(OptionError, match="KVINFER_AMX"):
        options.reload()
    with pytest.raises(OptionError, match="KVINFER_AMX"):  # still bad: not cached as if good
        options.options()


def test_override_is_scoped_and_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv("KVINFER_BATCH_INVARIANT", raising=False)
    before = options.reload()
    with options.override(batch_invariant=False) as o:
        assert o is options.options() and not o.batch_invariant and o.amx == before.amx
        with options.override(amx=False):
            assert not options.options().amx and not options.options().batch_invariant
        assert options.options().amx == before.amx
        import os
        assert "KVINFER_BATCH_INVARIANT" not in os.environ
    assert options.options() is before
    with pytest.raises(TypeError):
        with options.override(no_such_switch=1):
            pass
    assert options.options() is before


def test_the_kernels_read_their_switches_from_options(monkeypatch):
    import kvinfer.kernels as kernels

    monkeypatch.setenv("KVINFER_BATCH_INVARIANT", "0")
    monkeypatch.setenv("KVINFER_AMX_KEEP", "0")
    options.reload()
    assert not kernels.batch_invariant() and not kernels.keep_tiles_enabled() and kernels.drop_source_enabled()
    with options.override(batch_invariant=True, drop_source=False):
        assert kernels.batch_invariant() and not kernels.drop_source_enabled()


def _child(opts, q):
    options.use(opts)
    q.put((options.options().batch_invariant, options.options().tp_step_timeout))


def test_a_spawned_worker_takes_the_options_it_is_handed(monkeypatch):
    # The tensor-parallel runtime spawns its workers with the parent's options (runtime._spawn): a switch set
    # in-process (override) reaches them though their inherited environment says otherwise.
    monkeypatch.setenv("KVINFER_TP_STEP_TIMEOUT", "9")
    options.reload()
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    with options.override(batch_invariant=False):
        p = ctx.Process(target=_child, args=(options.options(), q))
        p.start()
    got = q.get(timeout=120)
    p.join(timeout=60)
    assert got == (False, 9.0)


def test_a_subprocess_reads_its_environment_at_start_up():
    code = "from kvinfer.options import options; o = options(); print(o.amx, o.measure_reps)"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT.parent), "KVINFER_AMX": "off", "KVINFER_MEASURE_REPS": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "3"], out.stderr


def test_the_cli_names_a_bad_switch_in_one_line(monkeypatch, capsys):
    from kvinfer.cli import main

    monkeypatch.setenv("KVINFER_KERNELS", "nope")
    with pytest.raises(OptionError):
        options.reload()
    assert main(["models"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "kvinfer: error: KVINFER_KERNELS must be 1 or 0 (true/false, yes/no, on/off), not 'nope'"


def _environ_reads(tree):
    """(line, name) of each KVINFER_* variable read from the environment: os.environ.get / os.getenv /
    os.environ[...] / `in os.environ` with a literal name."""
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get",
                                                                                                     "getenv"):
            base = ast.unparse(node.func.value)
            if base in ("os.environ", "os", "environ") and node.args:
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            arg = node.slice
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("KVINFER_"):
            yield node.lineno, arg.value


def test_only_options_reads_kvinfer_switches_from_the_environment():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "options.py" and path.parent == ROOT:
            continue
        found += [f"{path.relative_to(ROOT.parent)}:{line}: {name}" for line, name in
                  _environ_reads(ast.parse(path.read_text()))]
    assert not found, "read these through kvinfer.options:\n" + "\n".join(found)
    # The check itself finds such a read.
    assert list(_environ_reads(ast.parse('import os\nx = os.environ.get("KVINFER_AMX", "1")')))
