"""What a test run cost, read from pytest's JUnit XML: the totals per test module and the slowest tests.

`.ci/run` calls it at its end, so every CI log shows the set-up time, the pytest time and the 15 slowest tests
(CONTRIBUTING.md, "The test budget"). Times are pytest's own (set-up, call and teardown of each test, seconds);
with two pytest-xdist workers the sum over tests exceeds the wall time.

Usage:
    python scripts/test_cost.py artifacts/ci/junit.xml [--slowest 15] [--modules 10]
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STATED_ABOVE_SECONDS = 10.0
"""A test module whose tests take more than this in all states its cost in its docstring (a line `Cost: ...`)."""


def read(path: str) -> list[tuple[str, float]]:
    """Every test case of a JUnit XML file as (node id, seconds), in file order.

    Raises:
        OSError: the file cannot be read. xml.etree.ElementTree.ParseError: it is not XML.
    """
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        cases.append((f"{module.replace('.', '/')}.py::{case.get('name', '')}", float(case.get("time", 0.0))))
    return cases


def states_its_cost(module: str) -> bool:
    """Whether the test module at path `module` (relative to the working directory) has a line starting `Cost:` in
    its docstring. A module that cannot be read counts as stating none."""
    try:
        docstring = ast.get_docstring(ast.parse(Path(module).read_text())) or ""
    except (OSError, SyntaxError):
        return False
    return any(line.strip().startswith("Cost:") for line in docstring.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="pytest's --junitxml file")
    parser.add_argument("--slowest", type=int, default=15, help="how many of the slowest tests to list (15)")
    parser.add_argument("--modules", type=int, default=10, help="how many of the costliest modules to list (10)")
    args = parser.parse_args(argv)
    try:
        cases = read(args.junit)
    except (OSError, ET.ParseError) as error:
        print(f"test cost: cannot read {args.junit}: {error}", file=sys.stderr)
        return 1
    per_module: collections.Counter[str] = collections.Counter()
    for node, seconds in cases:
        per_module[node.split("::")[0]] += seconds
    total = sum(seconds for _, seconds in cases)
    print(f"{len(cases)} tests, {total:,.0f} s of test time in all")
    print(f"the {args.modules} costliest test modules (s):")
    for module, seconds in per_module.most_common(args.modules):
        print(f"  {seconds:8.1f}  {module}")
    print(f"the {args.slowest} slowest tests (s):")
    for node, seconds in sorted(cases, key=lambda c: -c[1])[: args.slowest]:
        print(f"  {seconds:8.1f}  {node}")
    silent = [m for m, seconds in per_module.items() if seconds > STATED_ABOVE_SECONDS and not states_its_cost(m)]
    if silent:
        print(f"over {STATED_ABOVE_SECONDS:.0f} s without a `Cost:` line in the docstring: {', '.join(sorted(silent))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
