"""The fast tier: scripts/slow_tests.py reads a run's durations; conftest marks the tests it lists as slow."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("slow_tests", ROOT / "scripts/slow_tests.py")
slow_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slow_tests)

LOG = """============================= slowest durations ==============================
2.50s call     tests/test_a.py::test_big
0.40s setup    tests/test_a.py::test_param[x]
0.70s call     tests/test_a.py::test_param[x]
0.20s call     tests/test_a.py::test_param[y]
0.90s call     tests/test_b.py::test_quick
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_setup_and_call_add_up_and_a_slow_case_marks_its_function():
    assert slow_tests.slow_functions(LOG, 1.0) == ["tests/test_a.py::test_big", "tests/test_a.py::test_param"]
    assert slow_tests.slow_functions(LOG, 0.5) == ["tests/test_a.py::test_big", "tests/test_a.py::test_param",
                                                    "tests/test_b.py::test_quick"]
    assert slow_tests.slow_functions("no durations here", 1.0) == []


def test_every_listed_slow_test_exists_and_is_marked(request):
    listed = [line for line in (ROOT / "tests/slow.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert listed
    for name in listed:
        path, *parts = name.split("::")  # a function, or a class and its method
        source = (ROOT / path).read_text()
        assert all(p in source or p == "runTest" for p in parts), name  # (a hypothesis machine is assigned)
    me = request.node
    assert me.get_closest_marker("slow") is None  # this one is not listed
