"""machinery/code_grading.py without a sandbox: its import direction, the harnesses as valid Python, and
LiveCodeBench's output comparison. Runs against the sandbox are in tests/test_sandbox.py."""
import os
import subprocess
import sys

from machinery import code_grading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_codetests_does_not_import_evaluate():
    code = "from machinery import code_grading; import sys; assert 'evaluate' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_harnesses_format_to_python():
    harnesses = [
        code_grading._STDIN_HARNESS.format(prelude=code_grading.LCB_PRELUDE, program="print(1)"),
        code_grading._CALL_HARNESS.format(source="def f(x):\n    return x", fn_name="f",
                                       inputs="1", marker="@@m@@"),
    ]
    line = code_grading._AssertTest("import math", "def f(x):\n    return x",
                                 "def check(candidate):\n    assert candidate(1) == 1", "f")
    harnesses.append(line.next_run()[0])
    line.stage, line.answers = "check", [["[[[1], {}]]", ["value", "[1, []]"]]]
    harnesses.append(line.next_run()[0])
    for code in harnesses:
        compile(code, "<harness>", "exec")


def test_same_output_follows_livecodebench():
    same = code_grading._same_output
    assert same("3\n", "3") and same(" 1 2 \n3.0\n", "1 2\n3")      # stripped; 3.0 == 3
    assert not same("3\n4", "3") and not same("a", "b") and not same("1 2", "1")


def test_the_calls_of_a_check_line_are_read_off_its_text():
    import ast

    def calls(line):
        function = ast.parse("def check(candidate):" + line).body[0]
        try:
            return code_grading._calls_of(function, "candidate")
        except code_grading._Dynamic:
            return None
    assert calls("    assert candidate(nums = [2,7,11,15], target = 9) == [0,1]") == \
        ["candidate(nums=[2, 7, 11, 15], target=9)"]                     # never the expected value
    assert calls("    assert is_same(candidate(make([1, 2])), make([2, 1]))") == ["candidate(make([1, 2]))"]
    assert calls("    assert candidate(1) == candidate(2)") == ["candidate(1)", "candidate(2)"]
    for dynamic in ("    assert [candidate(i) for i in range(3)] == [0, 1, 2]",
                    "    assert candidate(1) == 1 or candidate(2) == 2", "    assert candidate(candidate(1)) == 1",
                    "    helper(candidate)", "\n    for i in range(2):\n        assert candidate(i)"):
        assert calls(dynamic) is None, dynamic


def test_values_cross_as_data_and_literals_are_compared_here():
    import ast

    class ListNode:
        def __init__(self, val, next=None):
            self.val, self.next = val, next
    head = None
    for value in range(3000):                       # deeper than the recursion limit
        head = ListNode(value, head)
    cycle = [1]
    cycle.append(cycle)
    for value in ([1, (2.5, "x", b"y", 3j, None, True)], {"k": {1, 2}, (1, 2): frozenset({3})}, 2 ** 5000):
        assert code_grading._decode(code_grading._encode(value, set()), {}) == value
    again = code_grading._decode(code_grading._encode(cycle, set()), {})
    assert again[1] is again
    rebuilt = code_grading._decode(code_grading._encode(head, {"ListNode"}), {"ListNode": ListNode})
    assert (rebuilt.val, rebuilt.next.val, type(rebuilt)) == (2999, 2998, ListNode)
    for bad in (lambda: 0, iter([]), object()):
        try:
            code_grading._encode(bad, set())
            raise AssertionError(bad)
        except TypeError:
            pass
    check = code_grading._literal_check(ast.parse("def check(c):    assert c(1) == [0, 1]").body[0], "c")
    assert check([0, 1]) and not check((0, 1)) and not check([1, 0])
    assert code_grading._literal_check(ast.parse("def check(c):    assert f(c(1))").body[0], "c") is None
