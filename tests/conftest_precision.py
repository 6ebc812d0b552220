"""Prints the precision benchmark's figure at the end of a pytest run, passed or failed.

tests/test_check_precision.py stores its report as a user property of the test (it travels
back from an xdist worker); this hook prints every such report in the terminal summary.
"""

from __future__ import annotations

PRECISION_PROPERTY = "check_precision_report"


def pytest_terminal_summary(terminalreporter):
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            if report.when != "call":
                continue
            for name, value in getattr(report, "user_properties", []):
                if name == PRECISION_PROPERTY:
                    terminalreporter.write_sep("=", f"ddpify check precision ({report.nodeid})")
                    terminalreporter.write_line(value)
