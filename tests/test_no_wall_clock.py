"""No verdict and no test depends on wall-clock time.

- In the suite and the oracle, the clock is read only to report how long a run took (``wall_s``, a printed
  duration): these files, and no others, read it. Time limits on an IUT's call are the watchdog's
  (``--example-timeout``, a setting), a hang guard that no working call reaches.
- No test asserts on an elapsed time. A test bounds a child or a wait by ``hang_guard.HANG_S`` only.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLOCK = re.compile(r"\btime\.(time|monotonic|perf_counter)(_ns)?\(")

#: files of conformance/ and spec/ that read the clock -> what for (never a verdict)
REPORTS_DURATION = {
    "conformance/run/cli.py": "the report's wall_s",
    "conformance/run/plugin.py": "the report's wall_s",
    "conformance/vectors/grade.py": "grade's wall_s",
    "conformance/vectors/export.py": "the printed generation and grading times",
    "conformance/report/compat.py": "the compatibility page's wall_s column",
}


def test_the_suite_reads_the_clock_only_to_report_durations():
    readers = {str(p.relative_to(ROOT)) for d in ("conformance", "spec") for p in (ROOT / d).rglob("*.py")
               if CLOCK.search(p.read_text(encoding="utf-8"))}
    assert readers <= set(REPORTS_DURATION), f"reads the clock, and not listed here: {sorted(readers - set(REPORTS_DURATION))}"


def test_no_test_asserts_on_elapsed_time():
    offenders = []
    for p in (ROOT / "tests").rglob("*.py"):
        if p.name == Path(__file__).name:   # its own examples below
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("assert") and CLOCK.search(line):
                offenders.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "tests must not race the clock (use hang_guard.HANG_S as a guard):\n" + "\n".join(offenders)


def test_the_checks_catch_what_they_look_for():
    assert CLOCK.search("    assert time.time() - t0 < 120") and CLOCK.search("t = time.perf_counter_ns()")
    assert not CLOCK.search("time.sleep(1)")
