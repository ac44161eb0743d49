"""Runs per second of the sandbox's warm pool against a fresh `python -c` per snippet, at the
same concurrency (the pool's worker count):
    python scripts/bench_sandbox.py [--seconds=3]"""
import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402
from machinery import sandbox_pool  # noqa: E402

# Tool calls are mostly small computations; "sympy-integrate" shows a heavier one, where the
# computation itself, not start-up, dominates and the pool helps less.
SNIPPETS = {
    "trivial": "print(1 + 1)",
    "numpy": "import numpy as np\na = np.arange(9.0).reshape(3, 3) + np.eye(3)\n"
             "print(np.linalg.det(a), np.linalg.solve(a, np.ones(3)).round(3))",
    "sympy": "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x), sp.factor(x**3 - 1))",
    "sympy-integrate": "import sympy as sp\nx = sp.symbols('x')\nprint(sp.integrate(x**2 * sp.sin(x), x))",
}


def rate(batch, seconds):
    """Runs per second of `batch()` (which returns how many runs it did), after one warm-up batch."""
    batch()
    count, begin = 0, time.monotonic()
    while time.monotonic() - begin < seconds:
        count += batch()
    return count / (time.monotonic() - begin)


def main(seconds):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **sandbox_pool.THREAD_VARS}
    with sandbox.Sandbox() as box, concurrent.futures.ThreadPoolExecutor(box.num_workers) as threads:
        started, n = time.monotonic(), box.num_workers
        preimported = box.capabilities()["preimported"]
        print(f"pool: {n} workers, ready in {time.monotonic() - started:.2f} s; preimported {preimported}")

        def warm(code):
            results = box.run_many([code] * 4 * n)
            assert all(r.ok for r in results), results[0]
            return len(results)

        def fresh(code):
            list(threads.map(lambda c: subprocess.run([sys.executable, "-I", "-c", c], env=env, check=True,
                                                      capture_output=True, timeout=120), [code] * n))
            return n

        rows = [(name, rate(lambda: warm(code), seconds), rate(lambda: fresh(code), seconds))
                for name, code in SNIPPETS.items()]
    print(f"{'snippet':<16}{'warm pool runs/s':>18}{'python -c runs/s':>18}{'speedup':>10}")
    for name, warm_rate, fresh_rate in rows:
        print(f"{name:<16}{warm_rate:>18.1f}{fresh_rate:>18.1f}{warm_rate / fresh_rate:>9.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per snippet and side")
    main(parser.parse_args().seconds)
