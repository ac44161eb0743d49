"""What grading costs the trainer: CPU time and peak RSS growth of this process for run outputs
from 1 KiB up to the grader's output cap (machinery/code_grading.GRADING_OUTPUT_LIMIT, 8 MiB),
ordinary and hostile, with the code of an older commit (default d66e18b, before issue 38) beside
today's in the same process. No sandbox runs: the Results are made here, as a run would print
them; only the trainer's side of grading is measured.

    python scripts/bench_grading.py [--old COMMIT] [--quick]

An old measurement is skipped (a dash) where its smaller size took over a second and, grown
quadratically, would take over --patience seconds. A turn (the tool-call parser's input) is
measured up to 240 KiB: 20,480 one-token tags of 12 characters. RSS growth is VmHWM after the
case less VmRSS before it (the peak reset through /proc/self/clear_refs).
"""
import argparse
import concurrent.futures
import gc
import os
import subprocess
import sys
import threading
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rollout  # noqa: E402
from machinery import code_grading  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20


def old_module(commit, path, name):
    """The file at `commit`, imported as a module of its own (None without git or the commit)."""
    try:
        source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType(name)
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * KIB for line in f if line.startswith(field))


def measure(fn):
    """(CPU seconds, peak RSS growth in bytes) of fn()."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                         # VmHWM back to VmRSS
    except OSError:
        pass
    before, start = status("VmRSS"), time.process_time()
    fn()
    return time.process_time() - start, status("VmHWM") - before


class Run:
    def __init__(self, stdout):
        self.ok, self.status, self.stdout, self.stderr = True, "ok", stdout, ""


class TrickleBox:
    """A sandbox whose runs finish one after another (as a pool's few workers finish them), each
    Result made when its run ends: what the grader keeps alive is the grader's doing."""

    def __init__(self, output):
        self.output, self.pending = output, []
        threading.Thread(target=self.finish, daemon=True).start()

    def submit(self, code, timeout, memory_mb, stdin, output_limit):
        future = concurrent.futures.Future()
        self.pending.append(future)
        return future

    def finish(self):
        idle = 0
        while idle < 500:                        # a second with nothing to run: the grading is over
            time.sleep(0.002)
            future = self.pending.pop(0) if self.pending else None
            idle = 0 if future else idle + 1
            if future:
                future.set_result(Run(self.output()))
            del future


def cases(size):
    """name -> (inputs for the old code, inputs for today's, a function of (module, inputs))."""
    marker = "@@sandbox-result-0123456789abcdef@@"
    wide = lambda: "\U0001f600" * (size // 4) + "\n3\n"       # 4 bytes a character, as a str too
    many = list(range(size // 8))
    tests = {"fn_name": None, "cases": [{"input": "", "output": "3"}] * 16}
    return {
        "stdin, one line of tokens vs 1 expected": (
            ("1 " * (size // 2),) * 2, lambda m, got: m._same_output(got, "1")),
        "stdin, lines vs 1 expected": (
            ("12\n" * (size // 3),) * 2, lambda m, got: m._same_output(got, "12")),
        "functional, a list of ints": (
            (Run(marker + repr(many)), Run(marker + code_grading._encode(many, set()))),
            lambda m, run: m._call_passed(run, marker, "[]", False)),
        "functional, [[],[],...] (hostile)": (
            (Run(marker + "[" + "[]," * (size // 3) + "[]]"),) * 2,
            lambda m, run: m._call_passed(run, marker, "[]", False)),
        "16 tests of 4-byte text, kept": (
            (TrickleBox, TrickleBox),
            lambda m, box: m.run_tests("print(3)", tests, sandbox=box(wide))),
        "unclosed <tool_call> in a turn": (
            ("<tool_call>x" * (size // 12),) * 2, lambda m, text: m.parse_tool_calls(text)),
    }


def codec_cases():
    """The value codec on the shapes that made it cubic or quadratic: (name, sizes, a table)."""
    def chain(depth):
        value = ()
        for _ in range(depth):
            value = (value,)
        return code_grading._encode(value, set())
    same = lambda n: code_grading._encode({k * (2 ** 61 - 1) for k in range(n)}, set())
    return [("nested 1-tuples, depth", (250, 500, 1000, 2000, 4000), chain),
            ("ints of one hash in a set", (1000, 4000, 16000, 64000), same)]


def quietly(fn):
    try:
        fn()
    except Exception:
        pass


def row(name, size, old, new):
    def cell(m):
        return f"{'-':>9} {'-':>9}" if m is None else f"{m[0]:8.3f}s {m[1] / MIB:7.1f}MiB"
    print(f"{name:<42}{size:>10}  {cell(old)}  {cell(new)}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="d66e18b", help="the commit to compare with ('' for none)")
    ap.add_argument("--quick", action="store_true", help="sizes up to 1 MiB only")
    ap.add_argument("--patience", type=float, default=30.0)
    args = ap.parse_args()
    old = old_module(args.old, "machinery/code_grading.py", "old_grading") if args.old else None
    old_rollout = old_module(args.old, "rollout.py", "old_rollout") if args.old else None
    print(f"old: {args.old if old else 'none'}; today: the working tree. CPU s, peak RSS growth")
    print(f"{'case':<42}{'size':>10}  {'old':^19}  {'today':^19}")
    sizes = [KIB, 64 * KIB, MIB] + ([] if args.quick else [code_grading.GRADING_OUTPUT_LIMIT])
    turn_sizes = [KIB, 16 * KIB, 64 * KIB] + ([] if args.quick else [240 * KIB])
    last = {}                                    # name -> (size, old seconds)

    def old_run(name, size, fn):
        seen, took = last.get(name, (size, 0.0))
        if took > 1.0 and took * (size / seen) ** 2 > args.patience:
            return None
        result = measure(lambda: quietly(fn))
        last[name] = (size, result[0])
        return result
    for name in cases(KIB):
        rollout_case = "tool_call" in name
        for size in turn_sizes if rollout_case else sizes:
            (old_in, new_in), fn = cases(size)[name]
            module = (old_rollout, rollout) if rollout_case else (old, code_grading)
            before = module[0] and old_run(name, size, lambda: fn(module[0], old_in))
            row(name, size, before, measure(lambda: quietly(lambda: fn(module[1], new_in))))
    for name, counts, table in codec_cases():
        for n in counts:
            text = table(n)
            before = old and old_run(name, n, lambda: old._decode(text, {}))
            row(name, n, before, measure(lambda: quietly(lambda: code_grading._decode(text, {}))))


if __name__ == "__main__":
    main()
