"""Writes tests/slow.txt, the tests `pytest -m "not slow"` leaves out, from a run's per-test durations.

    .venv/bin/python -m pytest -q --durations=0 > durations.log
    .venv/bin/python scripts/slow_tests.py durations.log [SECONDS]    # default: tests of 1 s or more
    .venv/bin/python -m pytest -q -m "not slow" --durations=0 > fast.log
    .venv/bin/python scripts/slow_tests.py durations.log fast.log [SECONDS]

A test is slow when it took SECONDS or more in any of the logs: give it a fast-tier run too, and the tests that
only become slow there (a module's shared fixture built by a test the fast tier now leaves out) are listed as well.

A test's setup, call and teardown are added up; parametrized cases count under their function, which is marked
whole when any case is slow.
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "slow.txt"
LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)")


def slow_functions(log: str, seconds: float) -> list[str]:
    per_case = Counter()
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            per_case[m.group(2)] += float(m.group(1))
    return sorted({case.split("[")[0] for case, t in per_case.items() if t >= seconds})


def main(argv: list[str]) -> int:
    args = argv[1:]
    seconds = 1.0
    if len(args) >= 2:
        try:
            seconds = float(args[-1])
            args = args[:-1]
        except ValueError:
            pass
    if not args:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    try:
        logs = [Path(a).read_text() for a in args]
    except OSError as e:
        print(f"slow_tests.py: {e}", file=sys.stderr)
        return 2
    names = sorted({n for log in logs for n in slow_functions(log, seconds)})
    if not names:
        print(f"slow_tests.py: no per-test durations in {', '.join(args)} (run pytest with --durations=0)",
              file=sys.stderr)
        return 1
    OUT.write_text(f"# Tests of {seconds:g} s or more in a full or fast-tier run (scripts/slow_tests.py); `pytest -m \"not slow\"` "
                   "leaves them out.\n" + "\n".join(names) + "\n")
    print(f"{len(names)} slow tests -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
