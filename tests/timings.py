"""Where the suite's time goes, from a JUnit XML report (``pytest --junitxml FILE``): seconds and tests per file,
and the slowest tests, as the Markdown tables of docs/testing.md.

    python -m tests.timings FILE [--slowest N] [--before EARLIER_FILE]

With ``--before``, one table of both runs: each file's tests and seconds then and now.

Under pytest-xdist the seconds of a file are the sum over its tests (setup, call and teardown, as JUnit counts
them), not the wall time it took beside the other workers' files.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    file: str
    name: str
    seconds: float
    outcome: str  # passed, failed, error or skipped


def read_cases(path: str) -> list[Case]:
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        # "tests.integration.test_x" or "tests.integration.test_x.TestClass": the file is the module's path
        parts = module.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        file = "/".join(parts) + ".py" if parts else module
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        cases.append(Case(file, case.get("name", ""), float(case.get("time", "0")), outcome.replace("failure",
                                                                                                    "failed")))
    return cases


def per_file(cases: Sequence[Case]) -> list[tuple[str, float, int]]:
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for case in cases:
        seconds[case.file] += case.seconds
        counts[case.file] += 1
    return sorted(((f, seconds[f], counts[f]) for f in seconds), key=lambda row: -row[1])


def render(cases: Sequence[Case], slowest: int) -> str:
    total = sum(c.seconds for c in cases)
    lines = ["| file | seconds | tests |", "| --- | ---: | ---: |"]
    lines += [f"| `{file}` | {seconds:.1f} | {count} |" for file, seconds, count in per_file(cases)]
    lines += [f"| **all** | **{total:.1f}** | **{len(cases)}** |", "", "| test | seconds |", "| --- | ---: |"]
    for case in sorted(cases, key=lambda c: -c.seconds)[:slowest]:
        lines.append(f"| `{case.file}::{case.name}` | {case.seconds:.1f} |")
    outcomes: dict[str, int] = defaultdict(int)
    for case in cases:
        outcomes[case.outcome] += 1
    lines += ["", ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))]
    return "\n".join(lines)


def compare(before: Sequence[Case], after: Sequence[Case]) -> str:
    then = {file: (seconds, count) for file, seconds, count in per_file(before)}
    now = {file: (seconds, count) for file, seconds, count in per_file(after)}
    files = sorted(then.keys() | now.keys(), key=lambda f: (-then.get(f, (0.0, 0))[0], f))
    lines = ["| file | tests before | seconds before | tests after | seconds after |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for file in files:
        (s0, n0), (s1, n1) = then.get(file, (0.0, 0)), now.get(file, (0.0, 0))
        lines.append(f"| `{file}` | {n0} | {s0:.1f} | {n1} | {s1:.1f} |")
    lines.append(f"| **all** | **{len(before)}** | **{sum(c.seconds for c in before):.1f}** | **{len(after)}** | "
                 f"**{sum(c.seconds for c in after):.1f}** |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.timings", description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a JUnit XML file written by pytest --junitxml")
    parser.add_argument("--slowest", type=int, default=30, help="how many of the slowest tests to list")
    parser.add_argument("--before", help="an earlier run's JUnit XML: print both runs' files side by side")
    args = parser.parse_args(argv)
    if args.before:
        print(compare(read_cases(args.before), read_cases(args.report)))
    else:
        print(render(read_cases(args.report), args.slowest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
