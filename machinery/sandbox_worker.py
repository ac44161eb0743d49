"""machinery/sandbox_worker.py: a pool's worker, run without `site` (no .pth file runs).
_zygote_main forks a child per request and watches what the kernel does not bound; _child confines
the child; _run_user_code runs the code like `python -c`, in a guard reporting failures on fd 3."""
from __future__ import annotations

import ast
import atexit
import builtins
import contextlib
import errno
import faulthandler
import gc
import io
import json
import linecache
import mmap
import operator
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types
from itertools import repeat, starmap

if __name__ == "__main__":  # a worker runs under `python -I`: no project directory on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from machinery.sandbox_linux import (EPILOGUE_FD, MAX_FILES, PR_SET_CHILD_SUBREAPER,
                                     PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG,
                                     Landlock, drop_capabilities, enter_mount_namespace,
                                     install_seccomp, prctl, readable_paths, seccomp_filter,
                                     set_oom_score, worker_namespace)

THIS_FILE = os.path.abspath(__file__)     # what the workers run, whatever the cwd later
MAX_TASKS = 256                    # tasks per run, the main thread included
MAX_OPEN_FILES = 256
MAX_SIGNALS = 64                   # queued: a quota each uid shares with the host (SIGPENDING)
WATCH = 0.1                        # seconds between looks at what the kernel does not bound
PREIMPORT = ("numpy", "numpy.random", "sympy")   # imported once per worker, if installed
# Cheap stdlib modules model code (and the graders' prelude) use all the time.
WARM_STDLIB = ("math cmath fractions decimal itertools functools collections heapq bisect random "
               "statistics string re json typing datetime copy operator dataclasses enum").split()
WARMUP = {   # lazily loaded submodules (sympy's printers and solvers, numpy's linalg), loaded here
    "numpy": "import numpy as np\n"
             "np.linalg.det(np.eye(3)); np.linalg.solve(np.eye(2), np.ones(2))\n"
             "str(np.arange(3)); np.random.default_rng(0).random(2)",
    "sympy": "import sympy as sp\nx = sp.Symbol('x')\nstr(sp.expand((x + 1) ** 3))\n"
             "sp.solve(x ** 2 - 1, x); sp.factor(x ** 2 - 1)\n"
             "sp.simplify(sp.sin(x) ** 2 + sp.cos(x) ** 2)\n"
             "str(sp.integrate(x * sp.sin(x), x)); sp.diff(sp.exp(x), x); sp.Rational(1, 3) + 1\n"
             "sp.latex(x ** 2); sp.N(sp.pi, 10); sp.Matrix([[1, 2], [3, 4]]).det()"}
THREAD_VARS = dict.fromkeys(["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                             "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                             "BLIS_NUM_THREADS"], "1")
_KEEP_ALIVE = []                   # the zygote's stdio and __main__: never finalized in a child
_SETUP_FAILED = 125                # exit code of a child that could not confine itself
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := os.read(fd, size - len(data))):
        data += chunk
    return data


def _child(zygote: dict, fds: list, address_space: int, cpu: int, disk: int) -> None:
    """In a freshly forked child: every layer in the fixed order, or exit 125 saying which."""
    step, plan, uid = "descriptors", zygote["plan"], zygote["uid"]
    try:
        signal.set_wakeup_fd(-1)               # the zygote's, not ours
        os.setsid()
        for fd, target in zip(fds, (0, 1, 2, 3)):
            os.dup2(fd, target)
        keep = sorted(zygote["landlock"].fds if zygote["landlock"] else [])
        for low, high in zip([3] + keep, keep + [1 << 16]):   # close all but those
            os.closerange(low + 1, high)
        job = json.loads(_read_exactly(0, int(_read_exactly(0, 12))))   # length in 12 digits, JSON
        step = "oom score"
        set_oom_score()
        step = "mount namespace"
        if plan["mount"]:
            enter_mount_namespace(zygote["dir"], job["disk_mb"], plan["mount"] == "user", uid)
        else:
            os.chdir(zygote["dir"])
        step = "rlimits"
        memory = address_space + job["memory_mb"] * 2 ** 20   # on top of the warm interpreter
        # NPROC: this run alone, or the owner's uid; CPU: SIGXCPU at soft, SIGKILL a second later.
        nproc = MAX_TASKS + (_tasks_of(os.getuid()) - 1 if plan["nproc"] == "owner" else 0)
        limits = [("AS", memory, memory), ("CPU", cpu, cpu + 1), ("FSIZE", disk, disk),
                  ("NOFILE", MAX_OPEN_FILES, MAX_OPEN_FILES), ("CORE", 0, 0), ("MSGQUEUE", 0, 0),
                  ("SIGPENDING", MAX_SIGNALS, MAX_SIGNALS)]
        for which, soft, hard in limits + [("NPROC", nproc, nproc)] * bool(plan["nproc"]):
            resource.setrlimit(getattr(resource, "RLIMIT_" + which), (soft, hard))
        step = "no_new_privs"
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        step = "landlock"
        if zygote["landlock"]:
            zygote["landlock"].install()
        step = "capabilities" + (f" and uid {uid}" if uid is not None else "")
        drop_capabilities(zygote["cap_last"], uid)
        prctl(PR_SET_DUMPABLE, 0)              # a uid change made it fs.suid_dumpable's
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
        _run_user_code(job.pop("code"))
    finally:
        os._exit(_SETUP_FAILED)


# The guard: its handlers step a reporter (`[] = it`): nothing runs before the report on fd 3.
_MARKS = [f"guard {os.urandom(8).hex()}: {name}" for name in ("SystemExit", "exit", "crash")]
_GUARD = ast.parse("try:\n    pass\nexcept '{}':\n    [] = '{}'\n    raise\nexcept:\n"
                   "    [] = '{}'\n    raise\n".format(*_MARKS)).body[0]
for _node in ast.walk(_GUARD):
    if "lineno" in _node._attributes:
        _node.lineno = _node.end_lineno = _node.col_offset = _node.end_col_offset = -1


def _guarded(source: str) -> types.CodeType:
    """`source` compiled, its statements after docstring and __future__ imports inside _GUARD."""
    tree = compile(source, "<string>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    head = next((i for i, node in enumerate(tree.body)
                 if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                         or getattr(node, "module", 0) == "__future__")), len(tree.body))
    if head < len(tree.body):
        _GUARD.body, tree.body = tree.body[head:], tree.body[:head] + [_GUARD]
    code = compile(tree, "<string>", "exec", dont_inherit=True)
    # Reporters writing on fd 3 in C: a crash; a SystemExit with a code not None, 0, False.
    dump = starmap(faulthandler.dump_traceback, repeat((EPILOGUE_FD, False))).__next__
    codes = map(SystemExit.code.__get__, starmap(sys.exception, repeat(())))
    fine = map(frozenset(map(id, (None, 0, False))).__contains__, map(id, codes))
    exit_report = map(operator.call, map((dump, None.__init__).__getitem__, fine)).__next__
    consts = dict(zip(_MARKS, (SystemExit, iter(exit_report, None), iter(dump, None))))
    return code.replace(co_consts=tuple(consts.get(c, c) if isinstance(c, str) else c
                                        for c in code.co_consts))


def _tasks_of(uid: int) -> int:
    """The tasks of real uid `uid` now (what its RLIMIT_NPROC counts), from /proc/*/status."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, KeyError), open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
            count += int(fields["Threads"]) * (int(fields["Uid"].split()[0]) == uid)
    return count


def _run_user_code(source: str) -> None:
    """Behave like `python -c source`, then exit (docs/SANDBOX.md, 'Verdicts')."""
    exit_code = SystemExit.code.__get__        # the status asked, not what a subclass says
    reserve = mmap.mmap(-1, 4 << 20)   # untouched (free); freed on MemoryError for the traceback
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
    try:
        try:
            code = _guarded(source)
        except BaseException:      # a syntax error: nothing of the run's own has run yet
            os.write(EPILOGUE_FD, b"E")
            raise
        exec(code, main.__dict__)
    except SystemExit as exc:      # a status other than 0 is already reported
        code = exit_code(exc)
        status = 0 if code is None else code & 0xFF if isinstance(code, int) else 1
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException as exc:
        status, error = 1, exc
    if error is not None:
        if isinstance(error, MemoryError) or getattr(error, "errno", None) == errno.ENOMEM:
            os.write(EPILOGUE_FD, b"M")
        if isinstance(error, MemoryError):
            reserve.close()
            traceback.clear_frames(error.__traceback__)
            main.__dict__.clear()
            gc.collect()
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, THIS_FILE):
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


def _zygote_main(config: dict) -> None:
    """Fork a child per "fork", report its pid and exit, SIGKILL it on "kill"; end on hang-up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to the owner
    prctl(PR_SET_CHILD_SUBREAPER, 1)   # strays of a run land here and are killed
    prctl(PR_SET_DUMPABLE, 0)          # no run opens our /proc/<pid>/mem, even as our uid
    sock = socket.socket(fileno=config["fd"])
    plan, uid, directory = config["plan"], config["uid"], config["dir"]
    if plan["expose"] or plan["hide_proc"]:    # Python reachable by the runs' uid; /proc hidden
        worker_namespace(plan["expose"], readable_paths() + [directory], plan["hide_proc"])
    if not plan["mount"]:
        _fresh(directory, uid)
    if config["cgroup"]:   # children born here: moving each run in waits out an RCU grace period
        with open(config["cgroup"] + "/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    for name in WARM_STDLIB + config["preimport"]:
        with contextlib.suppress(Exception):
            __import__(name)
            exec(WARMUP.get(name, ""), {"__name__": "__warmup__"})
    zygote = {"pid": os.getpid(), "dir": directory, "plan": plan, "uid": uid,
              "seccomp": seccomp_filter(not plan["mount"]),
              "cap_last": int(open("/proc/sys/kernel/cap_last_cap").read()),
              "landlock": plan["landlock"] and Landlock(plan["landlock"], readable_paths())}
    gc.collect()
    gc.freeze()                        # children then do not dirty these pages with GC bits
    wake, woken = os.pipe()   # SIGCHLD wakes the select below through this pipe (no pidfd needed)
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    child = disk = cpu_limit = over = stopped = None
    looked = watched = 0.0
    try:
        hello = {"op": "hello", "preimported": [m for m in config["preimport"] if m in sys.modules],
                 "threads": len(os.listdir("/proc/self/task"))}
        sock.send(json.dumps(hello).encode())
        while True:
            watching = child and plan["watch"] and not stopped
            ready = select.select([sock, wake], [], [], WATCH if watching else None)[0]
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
                began = time.thread_time()
                if not plan["mount"]:          # counted once more as it goes, with the names
                    over = _too_much(*_walk(directory, remove=True), disk) or over
                    _fresh(directory, uid)     # it looked up there (negative dentries)
                watched += time.thread_time() - began
                failure = b""
                with contextlib.suppress(OSError):
                    os.set_blocking(report, False)
                    while chunk := os.read(report, 1 << 16):
                        failure = chunk[-1:]
                os.close(report)
                sock.send(json.dumps({"op": "exit", "status": status, "maxrss": usage.ru_maxrss,
                                      "cpu": usage.ru_utime + usage.ru_stime + watched,
                                      "over": over, "failure": failure.decode("latin-1")}).encode())
            elif watching and time.monotonic() >= looked + WATCH:
                looked, began = time.monotonic(), time.thread_time()
                if ("tasks" in plan["watch"] and (fields := _stat(child))
                        and int(fields[17]) > MAX_TASKS):       # num_threads
                    over = f"{fields[17]} tasks, over its {MAX_TASKS}"
                else:
                    over = _too_much(*_walk(directory), disk) if "disk" in plan["watch"] else None
                watched += time.thread_time() - began   # the looking is the run's CPU time
                if over or cpu_time(child) + watched >= cpu_limit:
                    stopped = _kill_group(child) or True
            if sock in ready:
                message, fds, _, _ = socket.recv_fds(sock, 4096, 3)
                if not message:
                    return             # the pool hung up: closing, or its owner died
                request = json.loads(message)
                if request["op"] == "fork" and child is None and len(fds) == 3:
                    pages = open("/proc/self/statm").read().split()[:2]
                    address_space, rss = (int(n) * os.sysconf("SC_PAGE_SIZE") for n in pages)
                    disk, cpu_limit, over, stopped = request["disk"], request["cpu"], None, False
                    # fd 3: a socket (no open() of /proc/<pid>/fd/3 reaches it), read at the end.
                    report, theirs = (end.detach() for end in socket.socketpair())
                    looked, watched = time.monotonic(), 0.0
                    if (child := os.fork()) == 0:      # the child: _child never returns
                        _child(zygote, fds + [theirs], address_space, cpu_limit, disk)
                    os.close(theirs)
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
            with contextlib.suppress(OSError):  # out of our cgroup, so that it can go
                procs = os.path.dirname(config["cgroup"]) + "/cgroup.procs"
                open(procs, "w").write(str(os.getpid()))
        if not plan["mount"]:
            _walk(directory, remove=True)
        for path in (config["cgroup"], directory, os.path.dirname(directory)):   # root if last
            with contextlib.suppress(OSError, TypeError):
                os.rmdir(path)
        os._exit(0)


def _too_much(files: int, size: int, disk: int) -> str | None:
    if files > MAX_FILES or size > disk:
        return (f"{files} files, {size / 2 ** 20:.1f} MiB on disk, "
                f"over its {MAX_FILES} files or {disk / 2 ** 20:g} MiB")
    return None


def _stat(pid: int) -> list:
    """/proc/<pid>/stat after the command name (no ptrace rights needed); [] once it is gone."""
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()
    return []


def cpu_time(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def _fresh(directory: str, uid: int | None) -> None:
    """A new empty working directory, owned by the runs' uid (dropping the old one's dentries)."""
    with contextlib.suppress(OSError):
        os.rmdir(directory)
        os.mkdir(directory, 0o700)
    if uid is not None:
        os.chown(directory, uid, uid)


def _walk(top: str, remove: bool = False) -> tuple:
    """(entries, bytes) below `top` (to MAX_FILES), without recursion, one fd at a time."""
    entries = size = 0

    def scan(fd: int) -> list:         # count one directory (unlinking its files): its subdirs
        nonlocal entries, size
        subdirs = []
        with contextlib.suppress(OSError), os.scandir(fd) as found:
            for entry in found:
                entries += 1
                with contextlib.suppress(OSError):
                    size += entry.stat(follow_symlinks=False).st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append(entry.name)
                elif remove:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=fd)
                if entries > MAX_FILES and not remove:
                    break
        return subdirs

    try:
        fd = os.open(top, _DIR)
    except OSError:
        return 0, 0
    above, todo = [], scan(fd)         # above: (device, inode, subdirs left, name) per level
    try:
        while (deeper := todo and (remove or entries <= MAX_FILES)) or above:
            if deeper:
                name = todo.pop()
                try:
                    try:
                        child = os.open(name, _DIR, dir_fd=fd)
                    except PermissionError:    # its owner closed it: open it up (root needs not)
                        os.chmod(name, 0o700, dir_fd=fd)
                        child = os.open(name, _DIR, dir_fd=fd)
                except OSError:
                    continue
                here = os.fstat(fd)
                above.append((here.st_dev, here.st_ino, todo, name))
                os.close(fd)
                fd, todo = child, scan(child)
            else:
                device, inode, todo, name = above.pop()
                parent = os.open("..", _DIR, dir_fd=fd)
                os.close(fd)
                fd, here = parent, os.fstat(parent)
                if (here.st_dev, here.st_ino) != (device, inode):
                    break              # moved meanwhile: stop, rather than walk elsewhere
                if remove:
                    with contextlib.suppress(OSError):
                        os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    return entries, size


def remove_tree(path: str) -> None:
    _walk(path, remove=True)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _kill_group(pid: int) -> None:
    for action in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            action(pid, signal.SIGKILL)


if __name__ == "__main__":     # `python -I -S sandbox_worker.py --worker CONFIG` (Sandbox._spawn)
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("sandbox_worker.py runs as a pool's worker; to run code: python sandbox.py CODE")
    _config = json.loads(sys.argv[2])
    sys.path.extend(_config["site"])   # without `site`: its directories, none of its .pth files
    import site                        # under -S importing it runs nothing; exit() and help()
    for install in (site.setquit, site.setcopyright, site.sethelper):
        install()
    _zygote_main(_config)
