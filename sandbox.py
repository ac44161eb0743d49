"""sandbox.py: run untrusted, model-written Python fast, and keep it contained.

API: run, run_many, submit (a Future), capabilities() on a default pool of this rank's share of the
cores, or on a `Sandbox`; configure() and check() for the default pool; prepare_code and
format_tool_output: the code tool (rollout.TOOLS). code_grading.run_tests grades code with it.
    python sandbox.py 'print(1 + 1)'   python sandbox.py --tool $'x = 6 * 7\nx'
    python sandbox.py --capabilities   python scripts/bench_sandbox.py

The method: a warm pool of `python -I -S` zygotes (numpy and sympy pre-imported), each forking a
child per run that gets its job and stdio as pipes from the pool. The child confines itself (its
own session, oom_score_adj, [pids cgroup], [mount namespace], rlimits, no_new_privs, [Landlock], no
capabilities [and a uid of its own], parent-death signal, seccomp); a [layer] applies where the
machine grants it, and by default a pool refuses to start without Landlock (require="floor" starts
anyway). "ok" is exit status 0 with no failure reported on fd 3, never what the run printed. The
pool, zygote and kernel calls: machinery/sandbox_*.py; why each layer: docs/SANDBOX.md.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import sys
import threading
from concurrent.futures import Future

from machinery.sandbox_pool import Result, Sandbox, default_workers  # noqa: F401 (re-exported)

_FENCE_OPEN = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n", re.IGNORECASE)
# Wraps the final bare expression: prints its repr (not None) like the REPL; line numbers stay.
_SHOW = (b"(lambda __value: None if __value is None else print(repr(__value)))((", b"))")
_default, _default_lock = None, threading.Lock()      # the pool of the module-level functions
_options = {"workers": None, "require": "default"}


def prepare_code(code: str) -> str:
    """The first ```python fenced block if any; a final bare expression's value printed (`ast`)."""
    if match := _FENCE_OPEN.search(code):
        end = code.find("```", match.end())
        code = code[match.end():] if end < 0 else code[match.end():end]
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code             # the run reports it to the model (bad syntax, a NUL, too deep)
    if not body or not isinstance(body[-1], ast.Expr):
        return code
    last = body[-1].value
    if isinstance(last, ast.Call) and isinstance(last.func, ast.Name) and last.func.id == "print":
        return code             # prints by itself and returns None: nothing to add
    data = code.encode()        # ast offsets are (line, UTF-8 byte column)
    starts = [0] + [i + 1 for i, byte in enumerate(data) if byte == 0x0A]
    start = starts[last.lineno - 1] + last.col_offset
    end = starts[last.end_lineno - 1] + last.end_col_offset
    return (data[:start] + _SHOW[0] + data[start:end] + _SHOW[1] + data[end:]).decode()


def format_tool_output(result: Result, max_chars: int = 256) -> str:
    """stdout, stderr, why the run stopped; cut to `max_chars` (head, tail), status line whole."""
    text, rc = result.stdout or "", result.returncode
    if result.stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + result.stderr
    names = {s.value: s.name for s in signal.Signals}
    killed = f"Killed by {names.get(-rc, f'signal {-rc}')}." if rc and rc < 0 else "Killed."
    note = {"timeout": "TimeoutError: the code ran out of time and was stopped.",
            "memory": "MemoryError: the code ran out of memory and was stopped.",
            "killed": killed}.get(result.status, "")
    if note and text and not text.endswith("\n"):
        text += "\n"
    budget = max_chars - len(note)
    if budget <= 0:
        return note[:max_chars]
    room = budget - len("\n...\n")
    if len(text) > budget:
        text = text[:budget] if room <= 0 else (text[:(room + 1) // 2] + "\n...\n"
                                                + text[len(text) - room // 2:])
    return text + note


def configure(workers: int | None = None, require: str = "default") -> None:
    """The default pool's options before it starts (--sandbox_workers, --sandbox_require)."""
    with _default_lock:
        started = _default is not None and not _default._closed
        if started and _options != {"workers": workers, "require": require}:
            raise RuntimeError("sandbox.configure: the default sandbox has already started "
                               "with other options")
        _options.update(workers=workers, require=require)


def default_sandbox() -> Sandbox:
    """The pool of the module-level functions; a closed or broken one is replaced."""
    global _default
    with _default_lock:
        if _default is None or _default._closed or _default._broken:
            if _default is not None:
                _default.close()
            _default = Sandbox(**_options)
        return _default


def check(timeout: float = 120.0) -> str:
    """Start the default pool; the line of layers in force, or RuntimeError (once per rank)."""
    return default_sandbox().wait_ready(timeout)


def _forget_default_after_fork() -> None:
    global _default, _default_lock     # a forked copy has the pool's objects, not its threads
    _default, _default_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_default_after_fork)


def run(code: str, timeout: float = 10.0, memory_mb: int = 1024, stdin: str = "") -> Result:
    return default_sandbox().run(code, timeout, memory_mb, stdin)


def run_many(codes, timeout: float = 10.0, memory_mb: int = 1024, stdins=None) -> list:
    return default_sandbox().run_many(codes, timeout, memory_mb, stdins)


def submit(code: str, timeout: float = 10.0, memory_mb: int = 1024, stdin: str = "") -> Future:
    return default_sandbox().submit(code, timeout, memory_mb, stdin)


def capabilities() -> dict:
    return default_sandbox().capabilities()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Run Python code in the sandbox.")
    parser.add_argument("code", nargs="?", help="code to run ('-' reads it from stdin)")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--memory-mb", type=int, default=1024)
    parser.add_argument("--stdin", default="", help="text given to the program on stdin")
    parser.add_argument("--tool", action="store_true", help="prepare_code + format_tool_output")
    parser.add_argument("--capabilities", action="store_true", help="print what is in force")
    args = parser.parse_args(argv)
    if args.capabilities:
        return print(json.dumps(capabilities(), indent=2))
    if args.code is None:
        parser.error("give code to run, or --capabilities")
    code = sys.stdin.read() if args.code == "-" else args.code
    result = run(prepare_code(code) if args.tool else code, args.timeout, args.memory_mb,
                 args.stdin)
    if args.tool:
        return print(format_tool_output(result))
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    print(f"[sandbox] status={result.status} returncode={result.returncode} "
          f"{result.seconds:.3f}s", file=sys.stderr)
    sys.exit(0 if result.ok else result.returncode if (result.returncode or 0) > 0 else 1)


if __name__ == "__main__":
    main()
