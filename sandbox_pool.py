"""sandbox_pool.py: the machinery behind sandbox.py: the warm pool, its zygotes, the child.

sandbox.py is the front (what the rest of the project calls, and the method in brief); this file,
with confine.py (the kernel calls a run locks itself down with), is how it is done. The pieces,
in the order a run meets them (docs/SANDBOX.md has the reasoning):
- Sandbox: the pool, one thread per worker in the calling process. It writes each run's job and
  stdin, reads and caps its output (_Capture), keeps its deadline, polls what the kernel does
  not bound (_overdrawn), and gives the verdict (_verdict) from kernel facts and the run's
  epilogue, never from what the run printed.
- _zygote_main: one worker, `python -I sandbox_pool.py --worker CONFIG` (this file run as a
  script): it pre-imports, then forks one child per "fork" request, which carries four pipe ends
  and no job data, and reports the child's pid and exit status.
- _child: confines the forked child in the fixed order, then _run_user_code runs the code like
  `python -c` and writes the epilogue (the run's token and how it ended) on fd 3.
- grants() and _layers(): what this machine grants of the optional LAYERS (confine.detect(),
  once per process) and the plan the children follow; _PROBE and _expected(): each worker's
  first run checks from inside that the plan holds.
This file never imports sandbox.py: it runs alone as the workers' script.
"""
from __future__ import annotations

import atexit
import builtins
import concurrent.futures
import contextlib
import errno
import functools
import gc
import io
import itertools
import json
import linecache
import math
import mmap
import os
import platform
import queue
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import dataclass

if __name__ == "__main__":  # a worker runs under `python -I`: no script directory on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import confine
from confine import (ARCH, MAX_FILES, PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE,
                     PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, Landlock, available_cores,
                     drop_capabilities, enter_mount_namespace, install_seccomp, missing_layer,
                     prctl, readable_paths, seccomp_filter)

_THIS_FILE = os.path.abspath(__file__)     # what the workers run, whatever the cwd later
DEFAULT_OUTPUT_LIMIT = 64 * 1024   # bytes kept of stdout and of stderr, each
DEFAULT_DISK_MB = 64               # tmpfs size: the run's total bytes on disk
MAX_TASKS = 256                    # tasks per run, the main thread included
MAX_OPEN_FILES = 256
# Queued signals: a quota each uid shares with the host (RLIMIT_SIGPENDING).
MAX_SIGNALS = 64
# Seconds between two looks at a run whose disk or tasks the kernel does not bound.
WATCH = 0.1
MAX_SEND_ATTEMPTS = 3              # sends of one job to workers that die before forking it
GRACE = 30.0                       # seconds a worker may be late before it is presumed hung
PREIMPORT = ("numpy", "numpy.random", "sympy")   # imported once per worker, if installed
# Cheap stdlib modules model code (and the graders' prelude) use all the time.
WARM_STDLIB = ("math cmath fractions decimal itertools functools collections heapq bisect random "
               "statistics string re json typing datetime copy operator dataclasses enum").split()
# Libraries load submodules lazily on first use (sympy's printers and solvers, numpy's
# linalg); doing it once in the worker spares every run that cost.
WARMUP = {
    "numpy": "import numpy as np\n"
             "np.linalg.det(np.eye(3)); np.linalg.solve(np.eye(2), np.ones(2))\n"
             "str(np.arange(3)); np.random.default_rng(0).random(2)",
    "sympy": "import sympy as sp\nx = sp.Symbol('x')\nstr(sp.expand((x + 1) ** 3))\n"
             "sp.solve(x ** 2 - 1, x); sp.factor(x ** 2 - 1)\n"
             "sp.simplify(sp.sin(x) ** 2 + sp.cos(x) ** 2)\n"
             "str(sp.integrate(x * sp.sin(x), x)); sp.diff(sp.exp(x), x); sp.Rational(1, 3) + 1\n"
             "sp.latex(x ** 2); sp.N(sp.pi, 10); sp.Matrix([[1, 2], [3, 4]]).det()"}


@dataclass
class Result:
    status: str                     # "ok" | "error" | "timeout" | "memory" | "killed"
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None   # exit code, or -signal when killed by a signal
    seconds: float = 0.0            # wall time of the run

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------- the child: confine, then run

_THREAD_VARS = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                       "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                                       "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")}
_KEEP_ALIVE = []                   # the zygote's stdio and __main__: never finalized in a child
_SETUP_FAILED = 125                # exit code of a child that could not confine itself


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := os.read(fd, size - len(data))):
        data += chunk
    return data


def _child(zygote: dict, fds: list, address_space: int) -> None:
    """In a freshly forked child: every layer in the fixed order, or exit 125 saying which."""
    step, plan = "descriptors", zygote["plan"]
    try:
        signal.set_wakeup_fd(-1)               # the zygote's, not ours
        os.setsid()
        for fd, target in zip(fds, (0, 1, 2, 3)):
            os.dup2(fd, target)
        keep = sorted(zygote["landlock"].fds if zygote["landlock"] else [])
        for low, high in zip([3] + keep, keep + [1 << 16]):   # close all but those
            os.closerange(low + 1, high)
        # stdin starts with the job: its length in 12 digits, then its JSON
        job = json.loads(_read_exactly(0, int(_read_exactly(0, 12))))
        step = "mount namespace"
        if plan["mount"]:
            enter_mount_namespace(zygote["dir"], job["disk_mb"], plan["mount"] == "user")
        else:
            os.chdir(zygote["dir"])
        step = "rlimits"
        memory = address_space + job["memory_mb"] * 2 ** 20   # on top of the warm interpreter
        cpu = math.ceil(job["timeout"]) + 1
        disk = int(job["disk_mb"] * 2 ** 20)
        # NPROC counts this run alone, in its user namespace.
        nproc = (("NPROC", MAX_TASKS, MAX_TASKS),) * plan["nproc"]
        # The CPU limit sends SIGXCPU at the soft one, SIGKILL a second later at the hard one.
        limits = (("AS", memory, memory), ("CPU", cpu, cpu + 1), ("FSIZE", disk, disk),
                  ("NOFILE", MAX_OPEN_FILES, MAX_OPEN_FILES), ("CORE", 0, 0),
                  ("MSGQUEUE", 0, 0), ("SIGPENDING", MAX_SIGNALS, MAX_SIGNALS)) + nproc
        for which, soft, hard in limits:
            resource.setrlimit(getattr(resource, "RLIMIT_" + which), (soft, hard))
        step = "no_new_privs"
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        step = "landlock"
        if zygote["landlock"]:
            zygote["landlock"].install()
        step = "capabilities"
        drop_capabilities(zygote["cap_last"])
        step = "parent-death signal"
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote["pid"]:
            raise RuntimeError("the worker died")
        step = "seccomp"
        install_seccomp(zygote["seccomp"], os.getpid())
        if "numpy.random" in sys.modules:      # else every run of a worker draws the same
            sys.modules["numpy.random"].seed(int.from_bytes(os.urandom(4), "little"))
    except BaseException as exc:
        os.write(2, f"sandbox: could not confine the run ({step}): {exc!r}\n".encode())
        os._exit(_SETUP_FAILED)
    try:
        _run_user_code(job.pop("code"), bytes.fromhex(job.pop("token")))
    finally:
        os._exit(_SETUP_FAILED)


def _run_user_code(source: str, token: bytes) -> None:
    """Behave like `python -c source` in a fresh interpreter, then exit. As soon as the code has
    ended, the epilogue writes the token and how it ended (0: ran to its end or SystemExit,
    E: an exception, M: a MemoryError) on fd 3, before excepthooks, threads or atexit run."""
    # Address space set aside (untouched, so free) and given back on MemoryError, so the
    # traceback can be printed under the limit.
    reserve = mmap.mmap(-1, 4 << 20)
    sys.argv, sys.dont_write_bytecode = ["-c"], True
    sys.path.insert(0, "")
    _KEEP_ALIVE.append((sys.modules.get("__main__"), sys.stdin, sys.stdout, sys.stderr))
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", line_buffering=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGCHLD", "SIGALRM", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    linecache.cache["<string>"] = (len(source), None, source.splitlines(True), "<string>")
    status, error = 0, None
    try:   # dont_inherit: not this file's `from __future__ import annotations`
        exec(compile(source, "<string>", "exec", dont_inherit=True), main.__dict__)
    except SystemExit as exc:
        status = 0 if exc.code is None else exc.code & 0xFF if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        status, error = 1, exc
        if isinstance(exc, MemoryError):
            reserve.close()
            traceback.clear_frames(exc.__traceback__)
            main.__dict__.clear()
            gc.collect()
    memory = (isinstance(error, MemoryError)
              or isinstance(error, OSError) and error.errno == errno.ENOMEM)
    with contextlib.suppress(OSError):
        os.write(3, token + (b"M" if memory else b"E" if error else b"0"))
    del token
    if error is not None:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, _THIS_FILE):
            tb = tb.tb_next            # hide the bootstrap's own frames
        try:
            sys.excepthook(type(error), error.with_traceback(tb), tb)
        except BaseException:
            os.write(2, f"{type(error).__name__}\n".encode())
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        threading._shutdown()          # wait for non-daemon threads, like Python does
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


# ---------------------------------------------------------------- the worker (zygote)

def _zygote_main(config: dict) -> None:
    """Fork one child per "fork" request (it carries four pipe ends, no job data), report
    its pid and exit status, SIGKILL its group on "kill"; exit when the pool hangs up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to the owner
    prctl(PR_SET_CHILD_SUBREAPER, 1)   # strays of a run land here and are killed
    prctl(PR_SET_DUMPABLE, 0)          # no run opens our /proc/<pid>/mem, even as our uid
    sock = socket.socket(fileno=config["fd"])
    imported, plan = [], config["plan"]
    # Children are born in this pids cgroup; moving each run into it instead would take
    # cgroup_threadgroup_rwsem for writing, which can wait out an RCU grace period (10-30 ms).
    if config["cgroup"]:
        with open(config["cgroup"] + "/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    for name in WARM_STDLIB + config["preimport"]:
        with contextlib.suppress(Exception):
            __import__(name)
            imported.append(name)
            exec(WARMUP.get(name, ""), {"__name__": "__warmup__"})
    zygote = {"pid": os.getpid(), "dir": config["dir"], "plan": plan,
              "seccomp": seccomp_filter(not plan["mount"]),
              "cap_last": int(open("/proc/sys/kernel/cap_last_cap").read()),
              "landlock": plan["landlock"] and Landlock(plan["landlock"], readable_paths())}
    gc.collect()
    gc.freeze()                        # children then do not dirty these pages with GC bits
    # A child's end (SIGCHLD) wakes the select below through this pipe; no pidfd needed.
    wake, woken = os.pipe()
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    child = None
    try:
        preimported = [m for m in imported if m in config["preimport"]]
        threads = len(os.listdir("/proc/self/task"))
        sock.send(json.dumps({"op": "hello", "preimported": preimported,
                              "threads": threads}).encode())
        while True:
            ready = select.select([sock, wake], [], [])[0]
            if wake in ready:
                os.read(wake, 4096)
            if child and os.waitid(os.P_PID, child, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                _kill_group(child)     # a zombie keeps its pid: no reuse race
                _, status, usage = os.wait4(child, 0)
                child = None
                strays = open(f"/proc/self/task/{os.getpid()}/children").read().split()
                for stray in map(int, strays):
                    _kill_group(stray)
                    os.waitpid(stray, 0)
                if not plan["mount"]:
                    _clear(config["dir"])
                sock.send(json.dumps({"op": "exit", "status": status, "maxrss": usage.ru_maxrss,
                                      "cpu": usage.ru_utime + usage.ru_stime}).encode())
            if sock in ready:
                message, fds, _, _ = socket.recv_fds(sock, 4096, 4)
                if not message:
                    return             # the pool hung up: closing, or its owner died
                request = json.loads(message)
                if request["op"] == "fork" and child is None and len(fds) == 4:
                    with open("/proc/self/statm") as f:
                        pages = f.read().split()[:2]
                    address_space, rss = (int(n) * os.sysconf("SC_PAGE_SIZE") for n in pages)
                    if (child := os.fork()) == 0:
                        _child(zygote, fds, address_space)       # never returns
                    sock.send(json.dumps({"op": "forked", "pid": child, "rss": rss}).encode())
                elif request["op"] == "kill" and request["pid"] == child:
                    _kill_group(child)
                for fd in fds:
                    os.close(fd)
    finally:
        if child:
            _kill_group(child)
            os.waitpid(child, 0)
        if config["cgroup"]:
            parent = os.path.dirname(config["cgroup"])
            with contextlib.suppress(OSError):     # out of our cgroup, so that it can go
                open(parent + "/cgroup.procs", "w").write(str(os.getpid()))
        if not plan["mount"]:
            _clear(config["dir"])
        # The pool's root too, if it is the last one there (its owner died).
        for path in (config["cgroup"], config["dir"], os.path.dirname(config["dir"])):
            with contextlib.suppress(OSError, TypeError):
                os.rmdir(path)
        os._exit(0)


def _clear(directory: str) -> None:
    """Empty a working directory on the host's disk (no mount namespace). A run may have made
    directories with mode 0: without root's override each is opened up first (by path, never
    through a symlink it finds; a run that could swap one in meanwhile has no Landlock, and can
    do more to its uid's files itself)."""
    for root, names, _ in os.walk(directory) if os.geteuid() else ():
        for path in (os.path.join(root, name) for name in names):
            with contextlib.suppress(OSError):
                os.path.islink(path) or os.chmod(path, 0o700)
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)


def _kill_group(pid: int) -> None:
    for action in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            action(pid, signal.SIGKILL)


# ---------------------------------------------------------------- the pool's pieces

class _Capture:
    """Keeps the head and the tail of a stream, `limit` bytes in all."""

    def __init__(self, limit: int):
        self.limit = max(64, int(limit))
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        room = max(0, self.limit - self.limit // 2 - len(self.head))
        self.total += len(data)
        self.head += data[:room]       # in place: amortized, whatever the limit
        self.tail += data[room:]
        if len(self.tail) > self.limit + 65536:    # trim now and then, not on every chunk
            del self.tail[:len(self.tail) - self.limit // 2]

    def text(self) -> str:
        if self.total <= self.limit:
            return (self.head + self.tail).decode("utf-8", "replace")
        tail = self.tail[len(self.tail) - self.limit // 2:]
        cut = self.total - len(self.head) - len(tail)
        return (self.head.decode("utf-8", "replace")
                + f"\n[... {cut} bytes of output cut: {self.total} in all ...]\n"
                + tail.decode("utf-8", "replace"))


def _verdict(job: dict, exit_info: dict, epilogue: bytes, base_rss: int, timed_out: bool) -> tuple:
    """(status, returncode) of a finished run, from what the kernel and the pool saw (exit status,
    CPU time, peak memory, the deadline) and the run's epilogue; nothing the run prints counts."""
    code = os.waitstatus_to_exitcode(exit_info["status"])     # -signal when a signal ended it
    ended = epilogue[16:] if len(epilogue) == 17 and epilogue[:16] == job["token"] else None
    # The CPU rlimit's SIGXCPU, then SIGKILL, come only once the CPU time is spent.
    if timed_out or exit_info["cpu"] >= math.ceil(job["timeout"]) + 0.95:
        return "timeout", code
    if code == 0 and ended == b"0":
        return "ok", 0
    # A failing run that filled its memory failed for want of it, however that showed (3.11
    # reports a failed frame allocation as SystemError, C code may crash).
    near_limit = exit_info["maxrss"] * 1024 - base_rss >= 0.9 * job["memory_mb"] * 2 ** 20
    if ended == b"M" or near_limit and ended != b"0":
        return "memory", code
    return ("killed" if code < 0 else "error"), code


def _job(code, timeout=10.0, memory_mb=1024, stdin="", output_limit=DEFAULT_OUTPUT_LIMIT,
         disk_mb=DEFAULT_DISK_MB) -> dict:
    if not isinstance(code, str):
        raise TypeError("code must be a str")
    job = {"code": code, "stdin": stdin or "", "timeout": float(timeout),
           "memory_mb": int(memory_mb), "output_limit": int(output_limit),
           "disk_mb": float(disk_mb), "token": os.urandom(16)}
    if job["timeout"] <= 0 or job["memory_mb"] <= 0 or job["disk_mb"] * 2 ** 20 < 4096:
        # (a tmpfs of size=0 would have no limit at all)
        raise ValueError("timeout and memory_mb must be positive, disk_mb at least 4 KiB")
    return job


def _receive(sock: socket.socket, timeout: float) -> dict | None:
    """A worker's next message; None when the worker is gone or said nothing in time."""
    poller = select.poll()             # not select(): the owner may hold over 1024 descriptors
    poller.register(sock, select.POLLIN)
    with contextlib.suppress(OSError):
        if poller.poll(timeout * 1000) and (data := sock.recv(65536)):
            return json.loads(data)
    return None


def _environment(directory: str) -> dict:
    """A worker's environment is its runs' (nothing of ours), plus a cap on glibc malloc arenas,
    whose 64 MiB reservations per thread eat the address-space limit."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": directory, "TMPDIR": directory,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC", "PYTHONIOENCODING": "utf-8",
           "MPLBACKEND": "Agg", "USER": "sandbox", **_THREAD_VARS, "MALLOC_ARENA_MAX": "2"}
    if os.environ.get("LD_LIBRARY_PATH"):      # some Python builds need it to start
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


@functools.lru_cache(maxsize=None)
def grants() -> dict:
    """What this machine grants of the optional layers: confine.detect() in a fresh process
    started like a worker (it forks to try them), once per process."""
    found = subprocess.run([sys.executable, "-I", confine.__file__],
                           env=_environment(tempfile.gettempdir()),
                           capture_output=True, text=True, timeout=120)
    if found.returncode:
        why = found.stderr.strip()[-500:]
        raise RuntimeError(f"sandbox: could not find out what confines a run here: {why}")
    return json.loads(found.stdout)


LAYERS = {"landlock": "Landlock", "mount": "mount namespace",
          "tasks": "task count bound by the kernel"}


def _layers(found: dict) -> tuple:
    """(plan the children follow, what is in force, {layer: why not} of LAYERS) from grants()."""
    root, user, cgroup = found["mount_root"], found["mount_user"], found["cgroup"]
    # A run's own user namespace bounds its tasks (RLIMIT_NPROC there counts only them).
    nproc = not cgroup and not user["why"] and user["nproc"]
    if nproc or (root["why"] and not user["why"]):
        mount = "user"
    else:
        mount = "root" if not root["why"] else None
    if cgroup:
        tasks = f"pids cgroup {cgroup[1]}"
    else:
        tasks = "RLIMIT_NPROC in a user namespace" if nproc else None
    plan = {"landlock": found["landlock"], "mount": mount, "cgroup": cgroup and cgroup[0],
            "nproc": nproc, "tasks": tasks or "polled by the pool",
            "watch": ["disk"] * (not mount) + ["tasks"] * (not tasks)}
    on, off, abi = ["seccomp", "rlimits", "no capabilities"], {}, found["landlock"]
    if abi:
        on.append(f"Landlock ABI {abi}"
                  + " (without its TCP or signal rules: seccomp holds both)" * (abi < 6))
    else:
        off["landlock"] = found["landlock_why"]
    if mount:
        where = " in a user namespace" if mount == "user" else ""
        on.append(f"mount namespace{where} (tmpfs disk quota)")
    else:
        off["mount"] = f"{root['why']}; in a user namespace: {user['why']}"
    if tasks:
        on.append(tasks)
    else:
        nproc_why = user["why"] or "uid 0 is exempt from it"
        off["tasks"] = f"pids cgroup: {found['cgroup_why']}; RLIMIT_NPROC: {nproc_why}"
    if polled := ["disk quota"] * (not mount) + ["task count"] * ("tasks" in off):
        on.append(" and ".join(polled) + " polled by the pool")
    return plan, on, off


def _usage(directory: str) -> tuple:
    """(files, bytes) under `directory`, counting stops past MAX_FILES."""
    files, size, todo = 0, 0, [directory]
    while todo and files <= MAX_FILES:
        with contextlib.suppress(OSError), os.scandir(todo.pop()) as entries:
            for entry in entries:
                files += 1
                size += entry.stat(follow_symlinks=False).st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
    return files, size


def default_workers() -> int:
    """This rank's share of the machine: its cores over the ranks on this node (torchrun's
    LOCAL_WORLD_SIZE)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, available_cores() // ranks)


# ---------------------------------------------------------------- the pool

class Sandbox:
    """A warm pool of sandbox workers, one run per worker at a time, one pool thread per
    worker feeding and watching it. Thread-safe; use one per process (the module-level
    functions share a default one). Futures resolve on pool threads: callbacks must not block.
    require: "floor" (start with what the machine grants), "all", or names of LAYERS
    ("landlock,mount")."""

    def __init__(self, workers: int | None = None, preimport=PREIMPORT, require: str = "floor"):
        if missing := missing_layer():
            raise RuntimeError(f"sandbox: refusing to start without {missing}")
        wanted = set(LAYERS) if require == "all" else set(require.split(",")) - {"floor", ""}
        if wanted - set(LAYERS):
            raise ValueError(f"sandbox: require is 'floor', 'all' or names of {sorted(LAYERS)}, "
                             f"not {require!r}")
        self.plan, on, self.off = _layers(grants())
        self.num_workers = max(1, int(workers or default_workers()))
        self.preimport = list(preimport)
        absent = "; ".join(f"{LAYERS[k]} [{why}]" for k, why in self.off.items())
        self.description = (f"sandbox: {self.num_workers} workers; in force: {', '.join(on)}; "
                            f"not in force: {absent or 'nothing'}")
        if refused := sorted(wanted & set(self.off)):
            raise RuntimeError(f"sandbox: refusing to start (require={require!r}) without "
                               + "; ".join(f"{LAYERS[k]} [{self.off[k]}]" for k in refused))
        print(self.description, file=sys.stderr, flush=True)
        self.root = tempfile.mkdtemp(prefix="sandbox-")
        self._queue = queue.SimpleQueue()          # (job, future)
        self._lock = threading.Lock()
        self._ready = threading.Event()            # set: a probe passed, or the pool failed
        self._probe = None                         # (hello, checks) of the first worker
        self._broken = None                        # why the pool stopped for good
        self._trouble = None                       # why no worker is ready now
        self._closed, self._stop = False, threading.Event()
        self._generation = itertools.count(1)
        self._workers = [None] * self.num_workers
        self._failures = [0] * self.num_workers
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"sandbox-{i}",
                                          daemon=True)
                         for i in range(self.num_workers)]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    # -- one thread per worker --------------------------------------------------------------

    def _serve(self, index: int) -> None:
        future, failures = None, self._failures
        try:
            while not (self._closed or self._broken):
                worker = self._workers[index]
                if worker is None or worker.dead or worker.proc.poll() is not None:
                    # the slot's first worker, or it died
                    started = self._start_worker(index)
                    failures[index] = 0 if started else failures[index] + 1
                    if failures[index] >= 3:   # it may pass (memory, processes): wait, try again
                        self._fail("sandbox: workers keep dying at start-up", lasting=False)
                        self._stop.wait(min(30.0, 2.0 ** (failures[index] - 3)))
                    continue
                with contextlib.suppress(queue.Empty):
                    job, future = self._queue.get(timeout=0.5)
                    if future.set_running_or_notify_cancel():
                        self._resolve(index, job, future)
        except BaseException as exc:               # a bug of ours: fail loudly, not with a hang
            self._fail(f"sandbox: pool thread failed: {exc!r}")
            if future is not None and not future.done():
                future.set_exception(RuntimeError(self._broken))

    def _resolve(self, index: int, job: dict, future) -> None:
        result = None
        for _ in range(MAX_SEND_ATTEMPTS):         # a worker that died before forking it: again
            if self._workers[index].ready and not self._workers[index].dead:
                result = self._run_on(self._workers[index], job)
            if result is not None or self._closed or self._broken:
                break
            self._start_worker(index)
        if result is None and self._broken:
            return future.set_exception(RuntimeError(self._broken))
        lost = Result("killed", "", "sandbox: the worker died before the run\n", -9, 0.0)
        future.set_result(result or lost)

    def _start_worker(self, index: int) -> bool:
        """A fresh worker in slot `index`; its first run is the probe, checked here. False when
        it died or said nothing; a probe that finds a layer not in force stops the pool."""
        if self._workers[index] is not None:
            self._retire(self._workers[index])
        if self._closed:
            return False
        try:
            worker = self._workers[index] = self._spawn(index)
        except OSError as exc:     # e.g. no processes left; a zygote took the pool's directory
            self._trouble = f"sandbox: could not start a worker: {exc}"
            return False
        hello = _receive(worker.sock, 120.0)
        if hello and hello["threads"] > 1:
            return self._fail(f"sandbox: a worker has {hello['threads']} threads after its imports")
        probe_code = _PROBE.format(host_file=_THIS_FILE, count="tasks" not in self.plan["watch"])
        probe = hello and self._run_on(worker, _job(probe_code))
        if not probe:
            return False
        try:
            checks = json.loads(probe.stdout)
            failed = [k for k in _expected(self.plan) if checks[k] is not True]
            failed += ["tasks"] * ((checks["tasks"] or 0) > MAX_TASKS)
        except (ValueError, KeyError):
            failed = [probe.stderr.strip()[-300:] or probe.status]
        if failed:
            return self._fail(f"sandbox: refusing to start, not in force: {', '.join(failed)}")
        with self._lock:
            self._probe, self._trouble = self._probe or (hello, checks), None
        worker.ready = True
        self._ready.set()
        return True

    def _spawn(self, index: int) -> types.SimpleNamespace:
        name = f"worker{index}-{next(self._generation)}"
        directory, cgroup = os.path.join(self.root, name), None
        os.makedirs(self.root, 0o700, exist_ok=True)   # the last zygote to go takes it (owner died)
        os.mkdir(directory, 0o700)
        if self.plan["cgroup"]:
            cgroup = f"{self.plan['cgroup']}/{os.path.basename(self.root)}-{name}"
            os.mkdir(cgroup)
            with open(cgroup + "/pids.max", "w") as f:
                f.write(str(MAX_TASKS + 1))       # the idle zygote is the cgroup's one other task
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {"fd": theirs.fileno(), "dir": directory, "cgroup": cgroup,
                  "preimport": self.preimport, "plan": self.plan}
        command = [sys.executable, "-I", _THIS_FILE, "--worker", json.dumps(config)]
        proc = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=_environment(directory),
                                cwd=directory, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                start_new_session=True)
        theirs.close()
        return types.SimpleNamespace(proc=proc, sock=ours, dir=directory, cgroup=cgroup,
                                     ready=False, dead=False)

    def _retire(self, worker) -> None:
        worker.dead = True
        worker.proc.kill()
        worker.proc.wait()
        worker.sock.close()
        shutil.rmtree(worker.dir, ignore_errors=True)
        for _ in range(100 if worker.cgroup else 0):   # its last run may take a moment to leave
            if not os.path.exists(worker.cgroup):
                break
            with contextlib.suppress(OSError):
                os.rmdir(worker.cgroup)
            time.sleep(0.01)

    def _run_on(self, worker, job: dict) -> Result | None:
        """One run on `worker`; None if the worker died before forking it (safe to re-send)."""
        pipes = [os.pipe() for _ in range(4)]
        (stdin_r, feed), (out_r, out_w), (err_r, err_w), (end_r, end_w) = pipes
        with contextlib.suppress(OSError):     # if the worker is gone, its end of file comes next
            socket.send_fds(worker.sock, [b'{"op": "fork"}'], [stdin_r, out_w, err_w, end_w])
        for fd in (stdin_r, out_w, err_w, end_w):
            os.close(fd)
        fields = {k: job[k] for k in ("code", "timeout", "memory_mb", "disk_mb")}
        spec = json.dumps({"token": job["token"].hex(), **fields}).encode()
        todo = memoryview(b"%012d" % len(spec) + spec + job["stdin"].encode("utf-8", "replace"))
        out, err = _Capture(job["output_limit"]), _Capture(job["output_limit"])
        end = _Capture(64)
        reads = {out_r: out, err_r: err, end_r: end}
        poller = select.poll()
        os.set_blocking(feed, False)
        poller.register(feed, select.POLLOUT)
        for fd in (out_r, err_r, end_r, worker.sock.fileno()):
            poller.register(fd, select.POLLIN)
        start = pid = ended = None
        stopped = over = None                  # stopped: "timeout", or what the run went over
        deadline, base_rss, looked = time.monotonic() + GRACE, 0, 0.0
        watch = self.plan["watch"]
        try:
            while True:
                if watch and pid and not stopped:
                    wake = min(deadline, looked + WATCH)
                else:
                    wake = deadline
                for fd, _ in poller.poll(max(0.0, wake - time.monotonic()) * 1000):
                    if fd == feed:
                        try:
                            todo = todo[os.write(feed, todo[:1 << 20]):]
                        except OSError:        # EPIPE: the run did not read all its stdin
                            todo = todo[:0]
                        if not todo:
                            poller.unregister(feed)
                            os.close(feed)
                            feed = None
                    elif fd in reads:
                        if data := os.read(fd, 1 << 16):
                            reads[fd].add(data)
                        else:
                            poller.unregister(fd)
                    elif (message := _receive(worker.sock, 0)) is None:
                        worker.dead = True
                        if pid is None:
                            return None
                        why = "the pool was closed" if self._closed else "the worker process died"
                        return Result("killed", out.text(),
                                      err.text() + f"sandbox: {why} during this run\n",
                                      -signal.SIGKILL, round(time.monotonic() - start, 6))
                    elif message["op"] == "forked":
                        pid, base_rss = message["pid"], message["rss"]
                        start = time.monotonic()
                        deadline = start + job["timeout"]
                    elif message["op"] == "exit":
                        for fd in reads:       # the child is reaped: read its pipes to the end
                            while data := os.read(fd, 1 << 16):
                                reads[fd].add(data)
                        epilogue = bytes(end.head + end.tail) * (end.total <= 64)
                        status, code = _verdict(job, message, epilogue, base_rss,
                                                stopped == "timeout")
                        note = f"sandbox: the run was stopped: {over}\n" if over else ""
                        return Result("killed" if over else status, out.text(), err.text() + note,
                                      code, round((ended or time.monotonic()) - start, 6))
                now = time.monotonic()
                if watch and pid and not stopped and now >= looked + WATCH:
                    looked, over = now, self._overdrawn(worker, pid, job)
                    deadline = now if over else deadline
                if now >= deadline and (pid is None or stopped):
                    worker.proc.kill()         # late to fork, or to end once killed: hung
                    deadline = now + 1.0
                elif now >= deadline:          # the deadline: SIGKILL the run's group
                    stopped, ended, deadline = over or "timeout", now, now + GRACE
                    with contextlib.suppress(OSError):
                        worker.sock.send(json.dumps({"op": "kill", "pid": pid}).encode())
        finally:
            for fd in [feed, out_r, err_r, end_r]:
                if fd is not None:
                    os.close(fd)

    def _overdrawn(self, worker, pid: int, job: dict) -> str | None:
        """What a run the kernel does not bound went over, if anything (looked at every WATCH s)."""
        if "tasks" in self.plan["watch"]:
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()   # those after the command name
                if (tasks := int(fields[17])) > MAX_TASKS:      # num_threads
                    return f"{tasks} tasks, over its {MAX_TASKS}"
        if "disk" in self.plan["watch"]:
            files, size = _usage(worker.dir)
            if files > MAX_FILES or size > job["disk_mb"] * 2 ** 20:
                return (f"{files} files, {size / 2 ** 20:.1f} MiB on disk, "
                        f"over its {MAX_FILES} files or {job['disk_mb']:g} MiB")
        return None

    def _drain(self) -> list:
        futures = []
        with contextlib.suppress(queue.Empty):
            while True:
                futures.append(self._queue.get_nowait()[1])
        return futures

    def _fail(self, message: str, lasting: bool = True) -> bool:
        """Fail the queued jobs with `message`; a lasting failure also stops the pool (a probe that
        found a layer not in force), a passing one only once every slot failed to start a worker
        three times in a row and none is ready to take them."""
        with self._lock:
            if not lasting:
                serving = any(w and w.ready and not w.dead for w in self._workers)
                if min(self._failures) < 3 or serving:
                    return False
            self._broken = self._broken or (message if lasting else None)
            self._trouble = self._trouble or message
        self._ready.set()
        for future in self._drain():
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(self._broken or self._trouble))
        return False

    # -- public API -------------------------------------------------------------------------

    def submit(self, code: str, timeout: float = 10.0, memory_mb: int = 1024, stdin: str = "",
               output_limit: int = DEFAULT_OUTPUT_LIMIT,
               disk_mb: float = DEFAULT_DISK_MB) -> concurrent.futures.Future:
        """Queue one run; the Future resolves to its Result."""
        job = _job(code, timeout, memory_mb, stdin, output_limit, disk_mb)
        future = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._broken:
                raise RuntimeError(self._broken or "sandbox is closed")
            self._queue.put((job, future))
        return future

    def run(self, code: str, timeout: float = 10.0, memory_mb: int = 1024, stdin: str = "",
            **options) -> Result:
        return self.submit(code, timeout, memory_mb, stdin, **options).result()

    def run_many(self, codes, timeout: float = 10.0, memory_mb: int = 1024, stdins=None,
                 **options) -> list:
        codes = list(codes)
        stdins = list(stdins) if stdins is not None else [""] * len(codes)
        if len(stdins) != len(codes):
            raise ValueError("stdins must match codes")
        futures = [self.submit(c, timeout, memory_mb, s, **options) for c, s in zip(codes, stdins)]
        return [f.result() for f in futures]

    def wait_ready(self, timeout: float = 120.0) -> str:
        """Wait for the first worker's probe; the line of layers in force, or RuntimeError saying
        why no worker started (the pool's own message)."""
        self._ready.wait(timeout)
        if self._probe is None:
            raise RuntimeError(self._broken or self._trouble
                               or f"sandbox: no worker became ready in {timeout:g} s")
        return self.description

    def capabilities(self, timeout: float = 120.0) -> dict:
        """What confines a run here, as measured from inside by the first worker's probe run."""
        line = self.wait_ready(timeout)
        (hello, checks), plan = self._probe, self.plan
        abi, mount = plan["landlock"], plan["mount"]
        if mount:
            disk_quota = f"tmpfs {checks['workdir_bytes'] / 2 ** 20:g} MiB"
        else:
            disk_quota = f"polled: {MAX_FILES} files and the run's disk_mb"
        return {"kernel": platform.release(), "arch": ARCH, "python": platform.python_version(),
                "workers": self.num_workers,
                "preimported": [m for m in hello["preimported"] if "." not in m],
                "worker_threads": hello["threads"], "process_group": True, "subreaper": True,
                "layers": line,
                "tasks": {"mechanism": plan["tasks"], "max": MAX_TASKS,
                          "measured": checks["tasks"]},
                "namespace": mount and "mount" + " (in a user namespace)" * (mount == "user"),
                "disk_quota": disk_quota, "rlimits": checks["rlimits"], "landlock_abi": abi,
                "landlock": {"filesystem": abi >= 1, "tcp": abi >= 4,
                             "signals_and_abstract_sockets": abi >= 6},
                "privileges": f"no capabilities (uid {os.geteuid()})",
                "seccomp": f"bpf filter ({ARCH})",
                "verified": {k: v for k, v in checks.items() if isinstance(v, bool)}}

    def worker_pids(self) -> list:
        return [w.proc.pid for w in self._workers if w is not None and not w.dead]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        for future in self._drain():
            future.cancel()
        for worker in filter(None, list(self._workers)):
            with contextlib.suppress(OSError):
                worker.sock.shutdown(socket.SHUT_RDWR)   # its zygote kills the run and exits
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=30)
        for worker in filter(None, self._workers):
            self._retire(worker)
        shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# The first run of every worker: confinement measured from inside, not assumed; _expected says
# which facts must hold under a plan.
_PROBE = r'''import ctypes, fcntl, json, os, resource, socket, threading
libc, caps = ctypes.CDLL(None), (ctypes.c_uint32 * 6)()
libc.capget((ctypes.c_uint32 * 2)(0x20080522, 0), caps)
def refused(action, *args):
    try:
        action(*args) == 0 and os._exit(0)     # a fork that got through: its child leaves
    except OSError:
        return True
    return False
def tasks(count=1):
    threading.stack_size(1 << 17)              # small stacks: the bound met is on tasks, not memory
    event = threading.Event()
    with __import__("contextlib").suppress(RuntimeError):
        while count < 4096:
            threading.Thread(target=event.wait, daemon=True).start()
            count += 1
    event.set()
    return count
print(json.dumps({{"fork_blocked": refused(os.fork), "inet_blocked": refused(socket.socket),
    "unix_bind_blocked": refused(socket.socketpair()[0].bind, "\0sandbox-probe"),
    "host_dir_blocked": refused(os.listdir, "/"),
    "host_file_blocked": refused(open, {host_file!r}),
    "host_metadata_blocked": refused(os.utime, ".."), "signals_blocked": refused(os.kill, 1, 0),
    "inotify_blocked": libc.inotify_init1(0) < 0,
    "locks_blocked": refused(fcntl.flock, 0, fcntl.LOCK_SH),
    "stdin_read_only": refused(os.write, 0, b"x"),
    "workdir_writable": not refused(open, "probe", "w"),
    "host_read_only": bool(os.statvfs("/").f_flag & os.ST_RDONLY),
    "no_new_privs": libc.prctl(39, 0, 0, 0, 0) == 1,
    "capabilities_dropped": not any(caps), "seccomp_filter": libc.prctl(21, 0, 0, 0, 0) == 2,
    "workdir_bytes": os.statvfs(".").f_blocks * os.statvfs(".").f_frsize,
    "rlimits": {{k: resource.getrlimit(getattr(resource, "RLIMIT_" + k))[1]
                for k in ("AS", "CPU", "FSIZE", "NOFILE")}},
    "tasks": {count} and tasks() or None}}))
'''


def _expected(plan: dict) -> list:
    """The probe's facts that must hold under `plan`."""
    facts = ["fork_blocked", "inet_blocked", "unix_bind_blocked", "host_metadata_blocked",
             "signals_blocked", "inotify_blocked", "locks_blocked", "stdin_read_only",
             "workdir_writable", "no_new_privs", "capabilities_dropped", "seccomp_filter"]
    if plan["landlock"]:
        facts += ["host_dir_blocked", "host_file_blocked"]
    if plan["mount"]:
        facts.append("host_read_only")
    return facts


if __name__ == "__main__":     # a worker: `python -I sandbox_pool.py --worker CONFIG` (_spawn)
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("sandbox_pool.py runs as a pool's worker; to run code: python sandbox.py CODE")
    _zygote_main(json.loads(sys.argv[2]))
