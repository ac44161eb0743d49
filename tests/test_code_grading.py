"""machinery/code_grading.py without a sandbox: its import direction, the harnesses as valid Python, and
LiveCodeBench's output comparison. Runs against the sandbox are in tests/test_sandbox.py."""
import concurrent.futures
import json
import os
import queue
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

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


# ----------------------------------------------------------------------------- bounded work
# Work is counted, never timed: Python and builtin calls (a profile hook stops a run past its
# budget), Decimals made, bytes allocated.

class OverBudget(BaseException):      # not an Exception: the graders' own handlers let it through
    pass


def within(calls, fn, *args):
    """fn(*args), stopped with OverBudget past `calls` Python and builtin calls."""
    count = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1
            if count[0] > calls:
                raise OverBudget(f"over {calls} calls")
    sys.setprofile(profile)
    try:
        return fn(*args)
    finally:
        sys.setprofile(None)


def peak_bytes(fn, *args):
    import tracemalloc
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def nested(depth):
    value = ()
    for _ in range(depth):
        value = (value,)
    return value


def test_nested_tuples_decode_in_linear_work():
    """4,000 nested 1-tuples took 119 s (cubic): now a chain is built in one pass, and one over
    100 deep is refused (hashing it would recurse in C with no limit: a crash in a set)."""
    shallow = nested(90)
    table = code_grading._encode(shallow, set())
    assert within(50 * 90, code_grading._decode, table, {}) == shallow
    for depth in (1000, 4000):
        with pytest.raises(ValueError, match="too deep"):
            within(50 * depth, code_grading._decode, code_grading._encode(nested(depth), set()), {})
    deep_key = code_grading._encode({nested(3000): 1}, set())
    with pytest.raises(ValueError, match="too deep"):
        within(50 * 3000, code_grading._decode, deep_key, {})


def test_values_sharing_one_hash_are_refused_not_compared_pairwise():
    """A set or dict of distinct values with one hash costs n^2 comparisons to build."""
    same = [k * (2 ** 61 - 1) for k in range(5000)]           # every one hashes to 0
    for value in (set(same), frozenset(same), dict.fromkeys(same)):
        with pytest.raises(ValueError, match="share one hash"):
            code_grading._decode(code_grading._encode(value, set()), {})
    compared = []

    class Same:                                                 # as a row's prefix class may be
        def __hash__(self):
            return 0

        def __eq__(self, other):
            compared.append(1)
            return self is other
    table = code_grading._encode({Same() for _ in range(2000)}, {"Same"})
    compared.clear()                                            # (making the set compared them)
    with pytest.raises(ValueError, match="share one hash"):
        code_grading._decode(table, {"Same": Same})
    assert compared == []
    few = {-1, -2, 0, 2 ** 61 - 1, (1, 2), frozenset({3})}     # collisions a real answer has
    assert code_grading._decode(code_grading._encode(few, set()), {}) == few


def test_a_value_too_large_is_refused_before_it_is_parsed():
    """ast.literal_eval of a near-8 MiB value built millions of nodes in the trainer; the table is
    now counted (arrays, objects, commas) before any of it is parsed."""
    marker = "@@m@@"
    big = SimpleNamespace(ok=True, stdout=marker + "[" + "[]," * (2_700_000) + "[]]")
    assert peak_bytes(code_grading._call_passed, big, marker, "[]", False) < 2 * len(big.stdout)
    assert not code_grading._call_passed(big, marker, "[]", False)
    many = list(range(code_grading.MAX_VALUES - 10))
    fits = SimpleNamespace(ok=True, stdout=marker + code_grading._encode(many, set()))
    assert code_grading._call_passed(fits, marker, json.dumps(many), False)
    cycle = [1]
    cycle.append(cycle)
    looped = SimpleNamespace(ok=True, stdout=marker + code_grading._encode(cycle, set()))
    assert not code_grading._call_passed(looped, marker, "[1, [1]]", False)   # no RecursionError


def test_stdin_comparison_makes_no_more_than_the_expected_outputs_worth(monkeypatch):
    """A 4M-token line became 4M Decimals, a million-line output a million-line list."""
    from decimal import Decimal
    made = []
    monkeypatch.setattr(code_grading, "Decimal", lambda text: made.append(1) or Decimal(text))
    assert not code_grading._same_output("1 " * 1_000_000, "1")
    assert len(made) <= 2
    lines = "12\n" * 1_000_000
    assert peak_bytes(code_grading._same_output, lines, "12") < 2 * len(lines)


def livecodebench_rule(got, expected):
    """lcb_runner's grade_stdio comparison, as written there."""
    from decimal import Decimal
    a, b = ([line.strip() for line in text.strip().split("\n")] for text in (got, expected))
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            if [Decimal(t) for t in x.split()] == [Decimal(t) for t in y.split()]:
                continue
        except Exception:
            pass
        return False
    return True


def test_stdin_comparison_is_livecodebench_rule():
    import random
    rng = random.Random(0)
    pieces = ["1", "1.0", "01", "-0", "0", "2", "1e3", "1000", "nan", "NaN", "sNaN", "inf", "a",
              "Infinity", "3.50", "3.5", " ", "  ", "\t", "\u00a0", "\u2003", "\n", "\r\n", "",
              "1_0", "10"]
    for _ in range(3000):
        got = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        want = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        for pair in ((got, want), (want, got), (got, got)):
            assert code_grading._same_output(*pair) == livecodebench_rule(*pair), pair


class Run:                                  # a Result the grader can be seen to let go of
    def __init__(self, stdout):
        self.ok, self.stdout, self.stderr = True, stdout, ""


class TrickleBox:
    """submit() -> a Future; a feeder completes them one at a time, each only after the grader let
    go of the one before (or two seconds passed): how many Results were alive at once."""

    def __init__(self, output):
        self.output, self.futures, self.most_alive = output, queue.Queue(), 0

    def submit(self, code, timeout, memory_mb, stdin, output_limit):
        future = concurrent.futures.Future()
        self.futures.put(future)
        return future

    def feed(self, count):
        import weakref
        alive = []
        for _ in range(count):
            run, gone, future = Run(self.output), threading.Event(), self.futures.get(timeout=10)
            alive.append(weakref.ref(run, lambda _, gone=gone: gone.set()))
            future.set_result(run)
            del run, future                # the box keeps nothing
            self.most_alive = max(self.most_alive, sum(ref() is not None for ref in alive))
            gone.wait(2)


def test_each_test_is_decided_as_its_run_arrives_and_its_output_dropped():
    """Every Result of a sample (8 MiB of 4-byte characters each) was kept until all its tests
    were decided; now at most one is alive in the grader at a time."""
    output = "\u20ac" * 1000 + "\n3\n"                      # the right answer, after wide text
    box = TrickleBox(output)
    tests = {"fn_name": None, "cases": [{"input": "", "output": "\u20ac" * 1000 + "\n3"}] * 6}
    feeder = threading.Thread(target=box.feed, args=(6,))
    feeder.start()
    assert code_grading.run_tests("print(3)", tests, sandbox=box) == [True] * 6
    feeder.join()
    assert box.most_alive == 1


@pytest.fixture(scope="module")
def box():
    from sandbox import Sandbox
    with Sandbox(workers=2, preimport=()) as pool:
        yield pool


def test_a_forged_record_costs_no_further_round(box, monkeypatch):
    """A solution that rewrites the records its run sends (here: every call's arguments) made its
    check line ask again for the same call, round after round up to MAX_ROUNDS (17 runs); a call
    is now asked for once, and a run that did not make the call it was given fails the line."""
    row = {"fn_name": None, "cases": [], "entry_point": "f",
           "import_prefix": "def g(x):\n    return x\n",
           "test_code": "def check(candidate):\n    assert g(candidate(1)) == 2\n"
                        "    assert g(candidate(candidate(1))) == 3\n"}
    honest = "def f(x):\n    return x + 1\n"
    forged = ("import __main__\nreal = __main__._encode\n"
              "__main__._encode = lambda value, names: real(('forged', value), names)\n" + honest)
    runs, submit = [], box.submit
    monkeypatch.setattr(box, "submit", lambda *a, **kw: runs.append(1) or submit(*a, **kw))
    assert code_grading.run_tests(honest, row, timeout=5, sandbox=box) == [True, True]
    # line 1: its solution run, the test's run; line 2 (calls read at run time): the test's run,
    # then two rounds of a solution run and a test's run
    assert len(runs) == 2 + 5
    runs.clear()
    graded = code_grading.run_tests(forged, row, timeout=5, sandbox=box, stop_on_failure=True)
    assert graded == [False] * 2
    assert len(runs) <= 4
