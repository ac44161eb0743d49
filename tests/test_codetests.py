"""codetests.py without a sandbox: its import direction, the harnesses as valid Python, and
LiveCodeBench's output comparison. Runs against the sandbox are in tests/test_sandbox.py."""
import os
import subprocess
import sys

import codetests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_codetests_does_not_import_evaluate():
    code = "import codetests, sys; assert 'evaluate' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_harnesses_format_to_python():
    harnesses = [
        codetests._STDIN_HARNESS.format(prelude=codetests.LCB_PRELUDE, program="print(1)"),
        codetests._CALL_HARNESS.format(source="def f(x):\n    return x", fn_name="f",
                                       inputs="1", marker="@@m@@"),
    ]
    line = codetests._AssertTest("import math", "def f(x):\n    return x",
                                 "def check(candidate):\n    assert candidate(1) == 1", "f")
    harnesses.append(line.next_run()[0])
    line.stage, line.answers = "check", [["[[[1], {}]]", ["value", "[1, []]"]]]
    harnesses.append(line.next_run()[0])
    for code in harnesses:
        compile(code, "<harness>", "exec")


def test_same_output_follows_livecodebench():
    same = codetests._same_output
    assert same("3\n", "3") and same(" 1 2 \n3.0\n", "1 2\n3")      # stripped; 3.0 == 3
    assert not same("3\n4", "3") and not same("a", "b") and not same("1 2", "1")
