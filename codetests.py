"""codetests.py: run a code problem's program against its tests in the sandbox, pass/fail per test.

run_tests takes the three shapes of a problem's `tests` (docs/CONTRACTS.md, "Problem records") and
grades each the way its source does:
  stdin programs (LiveCodeBench, TACO): lcb_runner's import prelude, then the program as a script
    on each case's input; its output compared by LiveCodeBench's rules (_same_output);
  functional problems (fn_name): the Solution method or top-level function called on each case's
    arguments, the value compared by value (_call_passed; TACO/APPS's wrapped ground truth too);
  assert-style rows (upstream's code_math): one run per check line, passed when the run ends "ok"
    (_ASSERT_HARNESS).
One sandboxed run per test; the expected outputs never enter the sandbox, they are compared here.
evaluate.py's code grader (score_code) calls run_tests; this module imports sandbox (when it runs
something), never evaluate.
"""

import ast
import json
import secrets
from decimal import Decimal, InvalidOperation

# stdout and stderr kept per test run: one fixed cap, never derived from a test
GRADING_OUTPUT_LIMIT = 8 << 20

# lcb_runner/evaluation/testing_util.py's import_string, before stdin and functional programs.
_LCB_MODULES = ("string re datetime collections heapq bisect copy math random statistics "
                "itertools functools operator io sys json builtins typing").split()
LCB_PRELUDE = ("".join(f"from {m} import *\n" for m in _LCB_MODULES)
               + "".join(f"import {m}\n" for m in _LCB_MODULES[:-2])
               + "sys.setrecursionlimit(50000)\n")

_STDIN_HARNESS = """{prelude}
try:
    exec(compile({program!r}, "<solution>", "exec", dont_inherit=True))
except SystemExit:             # LiveCodeBench grades the output printed before a SystemExit
    pass
"""

# Assert-style rows (upstream's code_math): the row's import_prefix, the program, then one line of
# check(candidate). The program runs in a namespace of its own; check() in a fresh one made from
# the prefix after it, restored after every call; whatever crosses between them is rebuilt from
# plain builtins (numpy scalars made Python ones) and the prefix's own classes (ListNode, ...), so
# no object, helper or builtin of the program's takes part in a comparison; exiting early fails.
# (A backslash at a line's end inside the string joins the next line to it: the text is one line.)
_ASSERT_HARNESS = """import builtins
def _plain(value, classes, seen):
    if type(value) in (bool, int, float, complex, str, bytes, type(None)):
        return value
    if id(value) in seen:
        return seen[id(value)]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return _plain(value.item(), classes, seen)
    for base, copy in ((int, int.__int__), (float, float.__float__), (complex, complex.__complex__),
                       (str, str.__str__), (bytes, bytes.__bytes__)):
        if isinstance(value, base):
            return copy(value)
    if isinstance(value, (list, dict)):
        out = seen[id(value)] = [] if isinstance(value, list) else {{}}
        if isinstance(value, list):
            out.extend(_plain(x, classes, seen) for x in list.__iter__(value))
        else:
            out.update((_plain(k, classes, seen), _plain(x, classes, seen)) \
for k, x in dict.items(value))
        return out
    for base in (tuple, frozenset, set):
        if isinstance(value, base):
            return base(_plain(x, classes, seen) for x in base.__iter__(value))
    if type(value).__name__ in classes:
        out = seen[id(value)] = object.__new__(classes[type(value).__name__])
        for key, x in dict.items(object.__getattribute__(value, "__dict__")):
            object.__setattr__(out, key, _plain(x, classes, seen))
        return out
    raise TypeError(f"the solution gave a {{type(value).__name__}}, not a plain value")
def _space(prefix, clean):
    names = {{"__name__": "__main__", "__builtins__": dict(clean)}}
    exec(compile(prefix, "<prefix>", "exec", dont_inherit=True), names)
    return names
def _classes(names):
    return {{v.__name__: v for v in names.values() \
if isinstance(v, type) and v.__module__ == "__main__"}}
def _grade(prefix, program, test, entry_point):
    clean = dict(vars(builtins))
    theirs = _space(prefix, clean)
    try:
        exec(compile(program, "<solution>", "exec", dont_inherit=True), theirs)
        candidate = eval(entry_point, theirs)
    except SystemExit:
        raise AssertionError("the solution exited before its test ran") from None
    ours = _space(prefix, clean)
    exec(compile(test, "<test>", "exec", dont_inherit=True), ours)
    saved, saved_builtins = dict(ours), dict(ours["__builtins__"])
    def call(*args, **kwargs):
        args, kwargs = _plain((args, kwargs), _classes(theirs), {{}})
        try:
            value = candidate(*args, **kwargs)
        except SystemExit:
            raise AssertionError("the solution exited during its test") from None
        finally:                 # what the test sees, as it was before the call
            for names, snapshot in ((ours, saved), (saved["__builtins__"], saved_builtins)):
                names.clear()
                names.update(snapshot)
        return _plain(value, _classes(ours), {{}})
    ours["check"](call)
_grade({prefix!r}, {program!r}, {test!r}, {entry_point!r})
"""

# Imported as a module (not __main__), as LiveCodeBench does; the value comes back as its
# repr (numpy values made Python ones) for the caller to rebuild and compare by value.
_CALL_HARNESS = """import json, sys, types
solution = types.ModuleType("solution")
exec(compile({source!r}, "<solution>", "exec", dont_inherit=True), solution.__dict__)
owner = solution.Solution() if isinstance(getattr(solution, "Solution", None), type) else solution
value = getattr(owner, {fn_name!r})(\
*[json.loads(line) for line in {inputs!r}.split("\\n") if line.strip()])
def plain(v):
    if type(v).__module__ == "numpy" and hasattr(v, "tolist"):
        return plain(v.tolist())
    if isinstance(v, dict):
        return {{plain(k): plain(x) for k, x in v.items()}}
    return type(v)(map(plain, v)) if type(v) in (list, tuple, set, frozenset) else v
text = repr(plain(value))
sys.stdout.flush()
sys.stdout.write("\\n" + {marker!r} + text + "\\n")
"""


def _numbers(line):
    return [Decimal(t) for t in line.split()]


def _same_output(got, expected):
    """LiveCodeBench: strip the whole, split lines, strip each, same count, each line equal as text
    or as lists of Decimal numbers (3 == 3.0)."""
    a, b = ([line.strip() for line in text.strip().split("\n")] for text in (got, expected))
    try:
        return len(a) == len(b) and all(x == y or _numbers(x) == _numbers(y) for x, y in zip(a, b))
    except InvalidOperation:
        return False


def _call_passed(result, marker, expected, wrapped):
    at = result.stdout.rfind(marker)
    if not result.ok or at < 0:
        return False
    try:        # a repr that is no literal (an object of its own class) equals no expected value
        got = ast.literal_eval(result.stdout[at + len(marker):].strip())
        want = json.loads(expected)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    got = list(got) if isinstance(got, tuple) else got     # LiveCodeBench: tuples as lists
    # TACO/APPS ground truth is wrapped in a list: its first element passes too.
    return got == want or (wrapped and isinstance(want, list) and len(want) > 0
                           and got == want[0])


def _jobs(source, tests):
    """(code, stdin, check) per test: the sandbox's input, and how its Result is judged."""
    cases = tests.get("cases") or []
    if tests.get("test_code") is not None:     # assert-style, as upstream's code_math grades
        lines = [line for line in tests["test_code"].split("\n") if line != ""]
        jobs = []
        for line in lines[1:]:                 # line 0 is check()'s header, before every test
            code = _ASSERT_HARNESS.format(prefix=tests.get("import_prefix", ""), program=source,
                                          test=lines[0] + line, entry_point=tests["entry_point"])
            jobs.append((code, "", lambda r: r.ok))
        return jobs
    if tests.get("fn_name"):
        jobs = []
        for case in cases:
            # a fresh random marker per case: the program cannot print a result line of its own
            marker = f"@@sandbox-result-{secrets.token_hex(8)}@@"
            code = _CALL_HARNESS.format(source=LCB_PRELUDE + source, fn_name=tests["fn_name"],
                                        inputs=str(case.get("input", "")), marker=marker)
            jobs.append((code, "", lambda r, m=marker, e=str(case.get("output", "")):
                         _call_passed(r, m, e, bool(tests.get("wrapped")))))
        return jobs
    harness = _STDIN_HARNESS.format(prelude=LCB_PRELUDE, program=source)
    return [(harness, str(case.get("input", "")),
             lambda r, e=str(case.get("output", "")): r.ok and _same_output(r.stdout, e))
            for case in cases]


def run_tests(program, tests, timeout=6.0, stop_on_failure=False, memory_mb=1024, sandbox=None):
    """Per-test pass/fail of `program` on `tests` (the three shapes of docs/CONTRACTS.md), one
    sandboxed run per test, concurrent unless `stop_on_failure` (one by one, the first failure
    fails the rest unrun). Outputs are compared here, not in the sandbox; an assert-style test
    passes when its run ends "ok" (the sandbox's epilogue after check() returned,
    _ASSERT_HARNESS)."""
    source = program if isinstance(program, str) else ""
    jobs = _jobs(source, tests)
    if not source.strip():
        return [False] * len(jobs)
    import sandbox as sandbox_module
    box = sandbox or sandbox_module.default_sandbox()

    def launch(code, stdin):
        return box.submit(code, timeout, memory_mb, stdin, output_limit=GRADING_OUTPUT_LIMIT)

    if not stop_on_failure:
        futures = [launch(code, stdin) for code, stdin, _ in jobs]
        return [bool(check(future.result())) for (_, _, check), future in zip(jobs, futures)]
    passed, ok = [], True
    for code, stdin, check in jobs:  # one after another; after the first failure nothing runs
        ok = ok and bool(check(launch(code, stdin).result()))
        passed.append(ok)
    return passed
