"""machinery/code_grading.py: a code problem's program against its tests, in the sandbox, pass/fail
per test, for the three shapes of `tests` (docs/CONTRACTS.md, "Problem records") as their sources
grade them: stdin (LiveCodeBench, TACO), lcb_runner's prelude and output rules (_same_output);
fn_name, the Solution method or function's value compared by value (_call_passed); assert-style
rows (upstream's code_math), each assertion evaluated where the program never ran (_AssertTest).
The expected outputs never enter a run of the program. Imports sandbox to run, never evaluate."""

import ast
import json
import re
import secrets
from concurrent.futures import FIRST_COMPLETED, wait
from decimal import Decimal, InvalidOperation
from itertools import zip_longest

# stdout and stderr kept per test run: one fixed cap, never derived from a test
GRADING_OUTPUT_LIMIT = 8 << 20
MEMORY_MB = 1024                   # a test run's address space, on top of the warm interpreter

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

# Imported as a module (not __main__), as LiveCodeBench does (after CODEC); the value comes back
# as data (numpy values made Python ones) for the caller to rebuild and compare by value.
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
text = _encode(plain(value), ())
sys.stdout.flush()
sys.stdout.write("\\n" + {marker!r} + text + "\\n")
"""


def _same_output(got, expected):
    """LiveCodeBench: strip, split lines, strip each, same count, each line equal as text or as
    Decimals (3 == 3.0); counted first, so no more lines or Decimals than expected (plus one)."""
    got, expected = got.strip(), expected.strip()
    if got.count("\n") != expected.count("\n"):
        return False
    pairs = zip(got.split("\n"), expected.split("\n"))
    return all(x.strip() == y.strip() or _same_numbers(x, y) for x, y in pairs)


def _same_numbers(got, expected):
    """Equal as Decimals token by token (\\S+ as str.split()), lazily: at most one past expected."""
    try:
        return all(t is not None and w is not None and Decimal(t.group()) == Decimal(w)
                   for t, w in zip_longest(re.finditer(r"\S+", got), expected.split()))
    except InvalidOperation:           # not a number (or a signalling NaN compared)
        return False


def _call_passed(result, marker, expected, wrapped):
    at = result.stdout.rfind(marker)
    if not result.ok or at < 0:
        return False
    try:        # not a plain value, too large, a cycle compared, ...: no pass
        got = _decode(result.stdout[at + len(marker):].strip(), {})
        want = json.loads(expected)
        got = list(got) if isinstance(got, tuple) else got     # LiveCodeBench: tuples as lists
        # TACO/APPS ground truth is wrapped in a list: its first element passes too
        return got == want or (wrapped and isinstance(want, list) and want != [] and got == want[0])
    except Exception:
        return False


# Values that cross between a solution's run and the test's side, as one JSON text: a flat table of
# nodes, so no depth costs recursion. An atom is a JSON scalar (None, bool, str, float, int under
# 4000 bits) or [k], node k: ["int", hex], ["complex", re, im], ["bytes", hex], ["list" | "tuple" |
# "set" | "frozenset", [atom, ...]], ["dict", [[key, value], ...]], ["obj", name, [[field, atom],
# ...]] (a prefix class's object: ListNode, TreeNode). Subclasses cross as their base; others are
# refused. Decoding is linear and bounded: MAX_VALUES values, tuples 100 deep, 64 equal hashes.
CODEC = r'''
import json as _json
MAX_VALUES = 1 << 18      # values a table may hold (arrays, objects, commas of its text): bounded
def _encode(value, classes):
    nodes, seen, alive, todo = [], {}, [], []
    def node(entry):
        nodes.append(entry)
        return [len(nodes) - 1]
    def atom(v):
        t = type(v)
        if v is None or t is bool or t is str or t is float:
            return v
        if t is int:
            return v if v.bit_length() < 4000 else node(["int", hex(v)])
        if t.__module__ == "numpy" and getattr(v, "ndim", None) == 0:
            return atom(v.item())
        for base, copy in ((int, int.__int__), (float, float.__float__),
                           (complex, complex.__complex__), (str, str.__str__),
                           (bytes, bytes.__bytes__)):
            if isinstance(v, base):
                v = copy(v)
                if base is complex:
                    return node(["complex", v.real, v.imag])
                return node(["bytes", v.hex()]) if base is bytes else atom(v)
        if isinstance(v, (list, tuple, set, frozenset, dict)) or t.__name__ in classes:
            if id(v) not in seen:
                seen[id(v)] = len(nodes)
                nodes.append(None)
                alive.append(v)
                todo.append(v)
            return [seen[id(v)]]
        raise TypeError(f"the solution gave a {t.__name__}, not a plain value")
    root = atom(value)
    while todo:
        v = todo.pop()
        k = seen[id(v)]
        if isinstance(v, (list, tuple)):
            kind = list if isinstance(v, list) else tuple
            nodes[k] = [kind.__name__, [atom(x) for x in kind.__iter__(v)]]
        elif isinstance(v, dict):
            nodes[k] = ["dict", [[atom(a), atom(b)] for a, b in dict.items(v)]]
        elif isinstance(v, (set, frozenset)):
            kind = set if isinstance(v, set) else frozenset
            items = list(kind.__iter__(v))
            try:
                items.sort(key=repr)          # the same order in every process
            except Exception:
                pass
            nodes[k] = [kind.__name__, [atom(x) for x in items]]
        else:
            fields = dict.items(object.__getattribute__(v, "__dict__"))
            nodes[k] = ["obj", type(v).__name__, [[str.__str__(key), atom(x)] for key, x in fields]]
    return _json.dumps([root, nodes])
def _decode(text, classes):
    if text.count(",") + text.count("[") + text.count("{") > MAX_VALUES:
        raise ValueError(f"more than {MAX_VALUES} values")   # counted before any is parsed
    root, nodes = _json.loads(text)
    missing, opened, depth = object(), set(), [0] * len(nodes)
    def get(a):
        if type(a) is list:
            if built[a[0]] is missing:
                raise ValueError("a cycle through an immutable value")
            return built[a[0]]
        if a is None or type(a) in (bool, int, float, str):
            return a
        raise ValueError(f"not a value: {a!r}")
    def hashed(items):                 # distinct values of one hash: quadratic to put in a set
        if len(items) - len(set(map(hash, items))) > 64:
            raise ValueError("values that share one hash")
        return items
    makers = {"list": lambda e: [], "dict": lambda e: {}, "set": lambda e: set(),
              "tuple": lambda e: missing, "frozenset": lambda e: missing,    # built below
              "int": lambda e: int(e[1], 16), "bytes": lambda e: bytes.fromhex(e[1]),
              "complex": lambda e: complex(float(e[1]), float(e[2])),
              "obj": lambda e: object.__new__(classes[e[1]])}
    def unknown(entry):
        raise ValueError(f"unknown node {entry[0]!r}")
    built = [makers.get(entry[0], unknown)(entry) for entry in nodes]
    for k in range(len(nodes)):        # tuples and frozensets after what they hold: depth first,
        todo = [k]                     # each node opened once (~j: its items are built)
        while todo:
            j = todo.pop()
            if j < 0:
                j, held = ~j, nodes[~j][1]
                depth[j] = 1 + max([depth[a[0]] for a in held if type(a) is list], default=0)
                if depth[j] > 100:     # hashing a tuple recurses in C, with no limit
                    raise ValueError("nested too deep")
                items = list(map(get, held))
                built[j] = tuple(items) if nodes[j][0] == "tuple" else frozenset(hashed(items))
            elif built[j] is missing:
                if j in opened:
                    raise ValueError("a cycle through an immutable value")
                opened.add(j)
                todo += [~j] + [a[0] for a in nodes[j][1] if type(a) is list
                                and built[a[0]] is missing]
    for k, entry in enumerate(nodes):
        if entry[0] == "list":
            built[k].extend(map(get, entry[1]))
        elif entry[0] == "obj":
            for key, a in entry[2]:
                object.__setattr__(built[k], key, get(a))
    for k, entry in enumerate(nodes):
        if entry[0] == "dict":
            pairs = [(get(a), get(b)) for a, b in entry[1]]
            hashed([key for key, _ in pairs])
            built[k].update(pairs)
        elif entry[0] == "set":
            built[k].update(hashed(list(map(get, entry[1]))))
    return get(root)
'''
exec(CODEC)

# The solution's side of a check line (after CODEC): the prefix, the program, then each candidate
# call (its text, or its arguments as data), its arguments and value sent out as data. Neither the
# assertion nor its expected value is here.
_VALUES_HARNESS = """
import builtins, sys
def _values(prefix, program, entry_point, param, calls, marker):
    theirs = {{"__name__": "__main__", "__builtins__": builtins}}
    exec(compile(prefix, "<prefix>", "exec", dont_inherit=True), theirs)
    names = {{v.__name__ for v in list(theirs.values())
             if isinstance(v, type) and v.__module__ == "__main__"}}
    exec(compile(program, "<solution>", "exec", dont_inherit=True), theirs)
    candidate, records = eval(entry_point, theirs), []
    def call(*args, **kwargs):
        records.append(_encode((args, kwargs), names))
        try:
            value = candidate(*args, **kwargs)
        except Exception as exc:
            records[-1] += "\\traised\\t" + type(exc).__name__
            raise
        records[-1] += "\\tvalue\\t" + _encode(value, names)
        return value
    for kind, text in calls:
        try:
            if kind == "expr":
                space = dict(theirs, **{{param: call}})
                eval(compile(text, "<test>", "eval", dont_inherit=True), space)
            else:
                args, kwargs = _decode(text, {{n: theirs[n] for n in names if n in theirs}})
                call(*args, **kwargs)
        except Exception:
            pass                       # the test's side raises it in its turn
    sys.stdout.flush()
    sys.stdout.write("\\n" + marker + "\\n".join(records) + "\\n")
_values({prefix!r}, {program!r}, {entry_point!r}, {param!r}, {calls!r}, {marker!r})
"""

# The test's side (after CODEC): the prefix and check line, no solution code; the candidate answers
# each call with the solution's value where its arguments match that run's, else asks for it.
_CHECK_HARNESS = """
import builtins, os, sys
def _check(prefix, test, answers, marker):
    ours = {{"__name__": "__main__", "__builtins__": builtins}}
    exec(compile(prefix, "<prefix>", "exec", dont_inherit=True), ours)
    classes = {{v.__name__: v for v in list(ours.values())
               if isinstance(v, type) and v.__module__ == "__main__"}}
    exec(compile(test, "<test>", "exec", dont_inherit=True), ours)
    calls = []
    def candidate(*args, **kwargs):
        seen = _encode((args, kwargs), classes)
        if len(calls) >= len(answers) or answers[len(calls)][0] != seen:
            sys.stdout.write("\\n" + marker + "need " + str(len(calls)) + " " + seen + "\\n")
            sys.stdout.flush()
            os._exit(0)
        kind, value = answers[len(calls)][1:]
        calls.append(kind)
        if kind == "raised":
            error = getattr(builtins, value, None)
            if isinstance(error, type) and issubclass(error, Exception):
                raise error()
            raise Exception(value)
        return _decode(value, classes)
    ours["check"](candidate)
    sys.stdout.write("\\n" + marker + "pass\\n")
_check({prefix!r}, {test!r}, {answers!r}, {marker!r})
"""
MAX_ROUNDS = 8                     # runs of the solution for one check line, at most

# A candidate call under these may run never or more than once: the test's own run learns those.
_BRANCHING = (ast.BoolOp, ast.IfExp, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
              ast.GeneratorExp, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)


class _Dynamic(Exception):
    """A check line whose calls cannot be read off its text."""


def _calls_of(function: ast.FunctionDef, param: str) -> list:
    """The candidate calls of a check function in the order they run, as text, where each runs
    exactly once with arguments that depend on no value of the test's own; else _Dynamic."""
    local = {target.id for stmt in function.body if isinstance(stmt, ast.Assign)
             for target in stmt.targets if isinstance(target, ast.Name)}
    calls = []

    def visit(node, branching):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == param:
            names = {n.id for arg in node.args + node.keywords for n in ast.walk(arg)
                     if isinstance(n, ast.Name)}
            if branching or param in names or names & local:
                raise _Dynamic
            return calls.append(node)
        if isinstance(node, ast.Name) and node.id == param:
            raise _Dynamic             # the candidate passed on, or looked at
        branching = (branching or isinstance(node, _BRANCHING)
                     or isinstance(node, ast.Compare) and len(node.ops) > 1)
        for child in ast.iter_child_nodes(node):
            visit(child, branching)

    for stmt in function.body:
        if isinstance(stmt, ast.Assert):
            visit(stmt.test, False)
            if stmt.msg is not None:
                visit(stmt.msg, True)  # evaluated only when the assertion fails
        elif isinstance(stmt, ast.Expr):
            visit(stmt.value, False)
        elif isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            visit(stmt.value, False)
        elif not isinstance(stmt, ast.Pass):
            raise _Dynamic
    return [ast.unparse(call) for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


def _literal_check(function: ast.FunctionDef, param: str):
    """For `assert candidate(...) == <literal>` (or !=, `is None`, the call alone, `not` it):
    a function of the decoded value saying whether the assertion holds; else None."""
    if len(function.body) != 1 or not isinstance(function.body[0], ast.Assert):
        return None
    test = function.body[0].test

    def is_call(node):
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == param)
    if is_call(test):
        return bool
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and is_call(test.operand):
        return lambda value: not value
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    (op,), left, right = test.ops, test.left, test.comparators[0]
    if is_call(right) and isinstance(op, (ast.Eq, ast.NotEq)):
        left, right = right, left
    if not is_call(left):
        return None
    if isinstance(op, (ast.Is, ast.IsNot)):
        if not isinstance(right, ast.Constant) or right.value not in (None, True, False):
            return None
        same = right.value
        return (lambda v: v is same) if isinstance(op, ast.Is) else (lambda v: v is not same)
    try:
        expected = ast.literal_eval(right)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(op, ast.Eq):
        return lambda value: value == expected
    return (lambda value: value != expected) if isinstance(op, ast.NotEq) else None


class _AssertTest:
    """One check line of an assert-style row. A solution run sends the candidate's values out as
    data; the assertion is evaluated where no solution code ran: here for a literal comparison,
    else in the test's own run (_CHECK_HARNESS); each call that asks for: one more solution run."""

    def __init__(self, prefix: str, program: str, test: str, entry_point: str):
        self.prefix, self.program, self.test, self.entry = prefix, program, test, entry_point
        self.passed, self.rounds, self.asked, self.answers = None, 0, -1, []
        try:
            function = ast.parse(test).body[0]
            self.param = (function.args.posonlyargs + function.args.args)[0].arg
        except (SyntaxError, ValueError, IndexError, AttributeError, RecursionError):
            self.passed = False        # as the line itself would fail: no check(candidate)
            return
        try:
            self.calls = [("expr", text) for text in _calls_of(function, self.param)]
            self.literal = _literal_check(function, self.param) if len(self.calls) == 1 else None
            self.stage = "solution"
        except (_Dynamic, RecursionError):
            self.calls, self.literal, self.stage = [], None, "check"

    def next_run(self) -> tuple:
        self.marker = f"@@sandbox-{self.stage}-{secrets.token_hex(8)}@@"
        harness = _VALUES_HARNESS if self.stage == "solution" else _CHECK_HARNESS  # takes its own
        return CODEC + harness.format(prefix=self.prefix, program=self.program, test=self.test,
                                      entry_point=self.entry, param=self.param, calls=self.calls,
                                      answers=self.answers, marker=self.marker), ""

    def take(self, result) -> None:
        at = result.stdout.rfind(self.marker)
        said = result.stdout[at + len(self.marker):].strip() if result.ok and at >= 0 else None
        if self.stage == "solution":  # a line per call: arguments, "value" or "raised", what
            lines = said.split("\n", len(self.calls)) if said else []
            self.answers = [line.split("\t", 2) for line in lines if line.count("\t") >= 2]
            if said is None or not len(self.answers) == len(lines) == len(self.calls):
                self.passed = False    # a call its test could not make either, or no record
                return
            if self.literal is not None and self.answers:      # the literal comparison, here
                _, kind, value = self.answers[0]
                try:
                    self.passed = kind == "value" and bool(self.literal(_decode(value, {})))
                except KeyError:       # the value holds a prefix class: the test's run decides
                    pass
                except Exception:      # not a value, too deep, ...: no pass
                    self.passed = False
            if self.passed is None:
                self.stage = "check"
        elif said == "pass":
            self.passed = True
        elif said and said.startswith("need ") and self.rounds < MAX_ROUNDS:
            index, args = said[5:].split(" ", 1)
            # each call asked for once, in order: a run that did not make the call it was given
            # (its record forged) fails, and costs no further round
            self.passed = False if int(index) <= self.asked else None
            self.calls = self.calls[:int(index)] + [("data", args)]
            self.rounds, self.stage, self.asked = self.rounds + 1, "solution", int(index)
        else:
            self.passed = False


class _OneRun:
    """A test decided by one run: its code, its stdin, and how its Result is judged."""

    def __init__(self, code: str, stdin: str, judge):
        self.code, self.stdin, self.judge, self.passed = code, stdin, judge, None

    def next_run(self) -> tuple:
        return self.code, self.stdin

    def take(self, result) -> None:
        self.passed = bool(self.judge(result))


def _tests(source, tests):
    """One object per test (_OneRun or _AssertTest): the runs it needs, and its verdict."""
    cases = tests.get("cases") or []
    if tests.get("test_code") is not None:     # assert-style, as upstream's code_math grades
        lines = [line for line in tests["test_code"].split("\n") if line != ""]
        # line 0 is check()'s header, before every test
        return [_AssertTest(tests.get("import_prefix", ""), source, lines[0] + line,
                            tests["entry_point"]) for line in lines[1:]]
    if tests.get("fn_name"):
        jobs = []
        for case in cases:
            # a fresh random marker per case: the program cannot print a result line of its own
            marker = f"@@sandbox-result-{secrets.token_hex(8)}@@"
            code = CODEC + _CALL_HARNESS.format(source=LCB_PRELUDE + source, marker=marker,
                                                fn_name=tests["fn_name"],
                                                inputs=str(case.get("input", "")))
            jobs.append(_OneRun(code, "", lambda r, m=marker, e=str(case.get("output", "")):
                                _call_passed(r, m, e, bool(tests.get("wrapped")))))
        return jobs
    harness = _STDIN_HARNESS.format(prelude=LCB_PRELUDE, program=source)
    return [_OneRun(harness, str(case.get("input", "")),
                    lambda r, e=str(case.get("output", "")): r.ok and _same_output(r.stdout, e))
            for case in cases]


def run_tests(program, tests, timeout=6.0, stop_on_failure=False, sandbox=None):
    """Per-test pass/fail of `program` on `tests`, run in the sandbox, compared here; concurrent
    unless `stop_on_failure` (one by one, the first failure fails the rest unrun)."""
    source = program if isinstance(program, str) else ""
    if not source.strip():
        return [False] * len(_tests("", tests))
    import sandbox as sandbox_module
    box = sandbox or sandbox_module.default_sandbox()

    def send(test):
        code, stdin = test.next_run()
        return box.submit(code, timeout, MEMORY_MB, stdin, output_limit=GRADING_OUTPUT_LIMIT)

    def settle(group):                 # every test of `group` decided, their runs concurrent
        running = {send(test): test for test in group if test.passed is None}
        while running:                 # each run taken as it comes
            future = wait(running, return_when=FIRST_COMPLETED).done.pop()
            test = running.pop(future)
            test.take(future.result())
            del future                 # its output goes now, not at the next arrival
            if test.passed is None:
                running[send(test)] = test

    every = _tests(source, tests)
    if not stop_on_failure:
        settle(every)
        return [test.passed for test in every]
    passed, ok = [], True
    for test in every:               # one after another; after the first failure nothing runs
        if ok:
            settle([test])
        ok = ok and test.passed
        passed.append(ok)
    return passed
