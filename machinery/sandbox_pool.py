"""machinery/sandbox_pool.py: the warm pool behind sandbox.py: a thread per worker feeds each run
and keeps its deadline; _verdict judges from kernel facts; _layers() plans from what grants() finds,
and each worker's first run (_PROBE) checks that plan from inside. Never imports sandbox.py."""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import math
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import types
from concurrent.futures import Future
from dataclasses import dataclass

from machinery import sandbox_linux
from machinery.sandbox_linux import (ARCH, MAX_FILES, PR_SET_DUMPABLE, available_cores,
                                     missing_layer, prctl)
from machinery.sandbox_worker import (MAX_OPEN_FILES, MAX_SIGNALS, MAX_TASKS,  # noqa: F401 (API)
                                      PREIMPORT, THREAD_VARS, THIS_FILE as WORKER_FILE,
                                      cpu_time, remove_tree)

DEFAULT_OUTPUT_LIMIT = 64 * 1024   # bytes kept of stdout and of stderr, each
DEFAULT_DISK_MB = 64               # tmpfs size: the run's total bytes on disk
MAX_SEND_ATTEMPTS = 3              # sends of one job to workers that die before forking it
GRACE = 30.0                       # seconds a worker may be late before it is presumed hung
BACKSTOP = 3.0                     # a deadline moved by CPU waits: at most this times the timeout
LAYERS = {"uid": "a uid of its own", "landlock": "Landlock", "mount": "mount namespace",
          "tasks": "task count bound by the kernel"}
_slots = itertools.count()         # worker slots of this process's pools: their runs' uids


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
        note = f"\n[... {cut} bytes of output cut: {self.total} in all ...]\n"
        return self.head.decode("utf-8", "replace") + note + tail.decode("utf-8", "replace")


def _verdict(job: dict, exit_info: dict, failure: bytes, base_rss: int, timed_out: bool) -> tuple:
    """Never from what the run printed: "ok" is exit 0 with nothing on fd 3 (`failure`: its end)."""
    code = os.waitstatus_to_exitcode(exit_info["status"])     # -signal when a signal ended it
    if timed_out or exit_info["cpu"] >= math.ceil(job["timeout"]) + 0.95:   # RLIMIT_CPU spent
        return "timeout", code
    if code == 0 and not failure:
        return "ok", 0
    near_limit = exit_info["maxrss"] * 1024 - base_rss >= 0.9 * job["memory_mb"] * 2 ** 20
    if failure == b"M" or near_limit:   # filled memory: failed for want of it, however shown
        return "memory", code
    return ("killed" if code < 0 else "error"), code


def _job(code, timeout=10.0, memory_mb=1024, stdin="", output_limit=DEFAULT_OUTPUT_LIMIT,
         disk_mb=DEFAULT_DISK_MB) -> dict:
    if not isinstance(code, str):
        raise TypeError("code must be a str")
    job = {"code": code, "stdin": stdin or "", "timeout": float(timeout), "disk_mb": float(disk_mb),
           "memory_mb": int(memory_mb), "output_limit": int(output_limit)}
    # (a tmpfs of size=0 would have no limit at all)
    if job["timeout"] <= 0 or job["memory_mb"] <= 0 or job["disk_mb"] * 2 ** 20 < 4096:
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
    """Nothing of ours (no token or key); few malloc arenas (64 MiB each eat the address space)."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": directory, "TMPDIR": directory,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC", "PYTHONIOENCODING": "utf-8",
           "MPLBACKEND": "Agg", "USER": "sandbox", **THREAD_VARS, "MALLOC_ARENA_MAX": "2"}
    if os.environ.get("LD_LIBRARY_PATH"):      # some Python builds need it to start
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


@functools.lru_cache(maxsize=None)
def grants() -> dict:
    """sandbox_linux.detect() in a fresh process started like a worker (it forks), once."""
    found = subprocess.run([sys.executable, "-I", "-S", sandbox_linux.__file__,
                            str(sandbox_linux.run_uid(0))], env=_environment(tempfile.gettempdir()),
                           capture_output=True, text=True, timeout=120)
    if found.returncode:
        why = found.stderr.strip()[-500:]
        raise RuntimeError(f"sandbox: could not find out what confines a run here: {why}")
    return json.loads(found.stdout)


def required(require: str) -> set:
    """The LAYERS `require` asks for (docs/SANDBOX.md, 'The floor, the layers, ...')."""
    presets = {"default": {"landlock"}, "floor": set(), "all": set(LAYERS)}
    names = require.split(",")
    if require in presets or set(names) <= set(LAYERS) and len(set(names)) == len(names):
        return presets.get(require, set(names))
    raise ValueError(f"allowed: 'default' | 'floor' | 'all' | names of {sorted(LAYERS)}, "
                     f"comma-separated, each once; not {require!r}")


def _layers(found: dict) -> tuple:
    """(plan the workers follow, what is in force, {layer: why not} of LAYERS) from grants()."""
    root, user, uid, cgroup = (found[k] for k in ("mount_root", "mount_user", "uid", "cgroup"))
    # RLIMIT_NPROC counts a run alone under its own uid or user namespace; else the owner's (not 0).
    nproc_uid = not cgroup and not uid["why"] and uid["nproc"]
    nproc_userns = not cgroup and not nproc_uid and uid["why"] and not user["why"] and user["nproc"]
    nproc_owner = not (cgroup or nproc_userns or not uid["why"] or os.geteuid() == 0)
    mount = ("user" if uid["why"] and (nproc_userns or (root["why"] and not user["why"]))
             else None if root["why"] else "root")
    tasks = (cgroup and f"pids cgroup {cgroup[1]}"
             or nproc_uid and "RLIMIT_NPROC of the run's uid"
             or nproc_userns and "RLIMIT_NPROC in a user namespace"
             or nproc_owner and f"RLIMIT_NPROC of uid {os.geteuid()} (its tasks + {MAX_TASKS})")
    plan = {"landlock": found["landlock"], "mount": mount, "cgroup": cgroup and cgroup[0],
            "nproc": "owner" if nproc_owner else bool(nproc_uid or nproc_userns),
            "tasks": tasks or "polled by the worker",
            "watch": ["disk"] * (not mount) + ["tasks"] * (not tasks),
            "uid": not uid["why"], "expose": [] if uid["why"] else uid["expose"],
            "hide_proc": not uid["why"] and uid.get("hide_proc", False)}
    on, off, abi = ["seccomp", "rlimits", "no capabilities"], {}, found["landlock"]
    if uid["why"]:
        off["uid"] = uid["why"]
    else:
        notes = ["/proc shows it only its own processes"] * plan["hide_proc"] + [
            f"the Python installation opened to it under {', '.join(plan['expose'])}"
        ] * bool(plan["expose"])
        on.append("a uid of its own per worker" + f" ({'; '.join(notes)})" * bool(notes))
    if abi:
        on.append(f"Landlock ABI {abi}"
                  + " (without its TCP or signal rules: seccomp holds both)" * (abi < 6))
    else:
        off["landlock"] = found["landlock_why"]
    if mount:
        on.append(f"mount namespace{' in a user namespace' * (mount == 'user')} (tmpfs disk quota)")
    else:
        off["mount"] = f"{root['why']}; in a user namespace: {user['why']}"
    if tasks:
        on.append(tasks)
    else:
        nproc_why = (uid["why"] and (user["why"] or "uid 0 is exempt from it")
                     or "it does not bind the run's uid")
        off["tasks"] = f"pids cgroup: {found['cgroup_why']}; RLIMIT_NPROC: {nproc_why}"
    if polled := ["disk quota"] * (not mount) + ["task count"] * ("tasks" in off):
        on.append(" and ".join(polled) + " polled by the worker")
    return plan, on, off


def _waited(pid: int) -> float:
    """Seconds the run's main thread spent runnable but not running (/proc/<pid>/schedstat)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9
    return 0.0


def default_workers() -> int:
    """This rank's share of the cores: over the ranks on this node (torchrun's LOCAL_WORLD_SIZE)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, available_cores() // ranks)


class Sandbox(contextlib.AbstractContextManager):
    """Thread-safe; one per process. Futures resolve on pool threads: callbacks must not block."""

    def __init__(self, workers: int | None = None, preimport=PREIMPORT, require: str = "default"):
        if missing := missing_layer():
            raise RuntimeError(f"sandbox: refusing to start without {missing}")
        wanted = required(require)
        self.plan, on, self.off = _layers(grants())
        self.num_workers = max(1, int(workers or default_workers()))
        self.preimport = list(preimport)
        self.uids = [sandbox_linux.run_uid(next(_slots)) if self.plan["uid"] else None
                     for _ in range(self.num_workers)]
        absent = "; ".join(f"{LAYERS[k]} [{why}]" for k, why in self.off.items())
        self.description = (f"sandbox: {self.num_workers} workers; in force: {', '.join(on)}; "
                            f"not in force: {absent or 'nothing'}")
        if require != "default" and (refused := sorted(wanted & set(self.off))):
            raise RuntimeError(f"sandbox: refusing to start (require={require!r}) without "
                               + "; ".join(f"{LAYERS[k]} [{self.off[k]}]" for k in refused))
        if require == "default" and "landlock" in self.off:
            if "uid" in self.off:
                what = (f"keep uid {os.geteuid()} with nothing between it and what that uid may "
                        f"read or write (no uid of its own [{self.off['uid']}]; no Landlock "
                        f"[{self.off['landlock']}])")
                lost = ("this user's files (tokens, ~/.netrc, checkpoints, training data with its "
                        "expected outputs) and change them (the project, site-packages, out_dir)")
            else:
                what = (f"have a uid of its own but no Landlock [{self.off['landlock']}]: nothing "
                        f"keeps it to its own directory and the Python installation")
                lost = ("what any user may (the project's data/ with its answers), and what they "
                        "leave in /tmp, /var/tmp, /dev/shm or /run/lock outlives them")
            raise RuntimeError(f"sandbox: refusing to start: a run would {what}; "
                               f"--sandbox_require=floor starts anyway and gives that up: runs "
                               f"then read {lost}")
        print(self.description, file=sys.stderr, flush=True)
        prctl(PR_SET_DUMPABLE, 0)   # no run (nor our uid) opens our /proc/<pid>/mem, environ, fd
        self.root = tempfile.mkdtemp(prefix="sandbox-")      # its mode: _spawn
        self._queue, self._lock = queue.SimpleQueue(), threading.Lock()   # queue: (job, future)
        self._ready = threading.Event()            # set: a probe passed, or the pool failed
        self._probe = None                         # (hello, checks) of the first worker
        self._broken = self._trouble = None        # why it stopped for good; why none is ready
        self._closed, self._stop, self._generation = False, threading.Event(), itertools.count(1)
        self._workers, self._failures = [None] * self.num_workers, [0] * self.num_workers
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"sandbox-{i}",
                                          daemon=True) for i in range(self.num_workers)]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    def _serve(self, index: int) -> None:
        future, failures = None, self._failures
        try:
            while not (self._closed or self._broken):
                worker = self._workers[index]
                if worker is None or worker.dead or worker.proc.poll() is not None:
                    failures[index] = 0 if self._start_worker(index) else failures[index] + 1
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
        """A fresh worker, its first run the probe (a layer found not in force stops the pool)."""
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
        probe_code = _PROBE.format(host_file=WORKER_FILE, count="tasks" not in self.plan["watch"])
        probe = hello and self._run_on(worker, _job(probe_code))
        if not probe:
            return False
        try:
            checks = json.loads(probe.stdout)
            failed = [k for k in _expected(self.plan) if checks[k] is not True]
            slack = 64 * (self.plan["nproc"] == "owner")    # the owner's tasks that ended meanwhile
            failed += ["tasks"] * ((checks["tasks"] or 0) > MAX_TASKS + slack)
            failed += [f"uid {self.uids[index]}"] * (self.plan["uid"]
                                                     and checks["uid"] != self.uids[index])
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
        os.chmod(self.root, 0o711 if self.plan["uid"] else 0o700)   # runs' uids pass, to their own
        os.mkdir(directory, 0o700)
        if self.plan["cgroup"]:
            cgroup = f"{self.plan['cgroup']}/{os.path.basename(self.root)}-{name}"
            os.mkdir(cgroup)
            with open(cgroup + "/pids.max", "w") as f:
                f.write(str(MAX_TASKS + 1))       # the idle zygote is the cgroup's one other task
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {"fd": theirs.fileno(), "dir": directory, "cgroup": cgroup,
                  "preimport": self.preimport, "plan": self.plan, "uid": self.uids[index],
                  # the installation's site-packages directories: a worker (-S) adds them itself
                  "site": sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})}
        command = [sys.executable, "-I", "-S", WORKER_FILE, "--worker", json.dumps(config)]
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
        remove_tree(worker.dir)
        for _ in range(100 if worker.cgroup else 0):   # its last run may take a moment to leave
            if not os.path.exists(worker.cgroup):
                break
            with contextlib.suppress(OSError):
                os.rmdir(worker.cgroup)
            time.sleep(0.01)

    def _run_on(self, worker, job: dict) -> Result | None:
        """One run on `worker`; None if the worker died before forking it (safe to re-send)."""
        (stdin_r, feed), (out_r, out_w), (err_r, err_w) = [os.pipe() for _ in range(3)]
        fork = json.dumps({"op": "fork", "disk": int(job["disk_mb"] * 2 ** 20),
                           "cpu": math.ceil(job["timeout"]) + 1}).encode()     # its RLIMIT_CPU
        with contextlib.suppress(OSError):     # if the worker is gone, its end of file comes next
            socket.send_fds(worker.sock, [fork], [stdin_r, out_w, err_w])
        for fd in (stdin_r, out_w, err_w):
            os.close(fd)
        spec = json.dumps({k: job[k] for k in ("code", "timeout", "memory_mb", "disk_mb")})
        todo = memoryview(b"%012d" % len(spec) + spec.encode()
                          + job["stdin"].encode("utf-8", "replace"))
        out, err = _Capture(job["output_limit"]), _Capture(job["output_limit"])
        reads = {out_r: out, err_r: err}
        poller = select.poll()
        os.set_blocking(feed, False)
        poller.register(feed, select.POLLOUT)
        for fd in (out_r, err_r, worker.sock.fileno()):
            poller.register(fd, select.POLLIN)
        start = pid = ended = stopped = None
        deadline, base_rss = time.monotonic() + GRACE, 0
        try:
            while True:
                for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
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
                        status, code = _verdict(job, message, message["failure"].encode("latin-1"),
                                                base_rss, bool(stopped))
                        over = message.get("over")
                        note = f"sandbox: the run went over its quota: {over}\n" if over else ""
                        return Result("killed" if over else status, out.text(), err.text() + note,
                                      code, round((ended or time.monotonic()) - start, 6))
                now = time.monotonic()
                if now >= deadline and (pid is None or stopped):
                    worker.proc.kill()         # late to fork, or to end once killed: hung
                    deadline = now + 1.0
                elif now >= deadline:   # main-thread CPU waits don't count while under its timeout
                    waited = _waited(pid) * (cpu_time(pid) < job["timeout"])
                    moved = start + min(BACKSTOP, 1 + waited / job["timeout"]) * job["timeout"]
                    if moved > now + 0.005:
                        deadline = moved
                        continue
                    stopped, ended, deadline = True, now, now + GRACE   # SIGKILL the run's group
                    with contextlib.suppress(OSError):
                        worker.sock.send(json.dumps({"op": "kill", "pid": pid}).encode())
        finally:
            for fd in [out_r, err_r] + [feed] * (feed is not None):
                os.close(fd)

    def _drain(self) -> list:
        futures = []
        with contextlib.suppress(queue.Empty):
            while True:
                futures.append(self._queue.get_nowait()[1])
        return futures

    def _fail(self, message: str, lasting: bool = True) -> bool:
        """Fail the queued jobs; a passing failure only once every slot failed 3 times running."""
        with self._lock:
            if not lasting and (min(self._failures) < 3
                                or any(w and w.ready and not w.dead for w in self._workers)):
                return False
            self._broken = self._broken or (message if lasting else None)
            self._trouble = self._trouble or message
        self._ready.set()
        for future in self._drain():
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(self._broken or self._trouble))
        return False

    def submit(self, code: str, timeout: float = 10.0, memory_mb: int = 1024, stdin: str = "",
               output_limit: int = DEFAULT_OUTPUT_LIMIT,
               disk_mb: float = DEFAULT_DISK_MB) -> Future:
        job = _job(code, timeout, memory_mb, stdin, output_limit, disk_mb)
        future = Future()
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
        """Wait for the first worker's probe: the line of layers in force, or RuntimeError why."""
        self._ready.wait(timeout)
        if self._probe is None:
            raise RuntimeError(self._broken or self._trouble
                               or f"sandbox: no worker became ready in {timeout:g} s")
        return self.description

    def capabilities(self, timeout: float = 120.0) -> dict:
        """What confines a run here, as measured from inside by the first worker's probe run."""
        line = self.wait_ready(timeout)
        (hello, checks), plan = self._probe, self.plan
        disk = (f"tmpfs {checks['workdir_bytes'] / 2 ** 20:g} MiB" if plan["mount"] else
                f"counted by the worker: {MAX_FILES} files and the run's disk_mb, at each look "
                f"and when it ends; RLIMIT_FSIZE; O_TMPFILE, fallocate, links, renames refused")
        return {"workers": self.num_workers, "layers": line,
                "preimported": [m for m in hello["preimported"] if "." not in m],
                "worker_threads": hello["threads"], "uids": self.uids, "disk_quota": disk,
                "tasks": {"mechanism": plan["tasks"], "max": MAX_TASKS,
                          "measured": checks["tasks"]},
                "namespace": plan["mount"] and "mount" + " (in a user namespace)" * (
                    plan["mount"] == "user"), "rlimits": checks["rlimits"],
                "landlock_abi": plan["landlock"], "seccomp": f"bpf filter ({ARCH})",
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
        remove_tree(self.root)
        atexit.unregister(self.close)

    def __exit__(self, *exc):
        self.close()


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
    "host_dir_blocked": refused(os.listdir, "/"), "host_file_blocked": refused(open, {host_file!r}),
    "host_metadata_blocked": refused(os.utime, ".."), "signals_blocked": refused(os.kill, 1, 0),
    "inotify_blocked": libc.inotify_init1(0) < 0,
    "locks_blocked": refused(fcntl.flock, 0, fcntl.LOCK_SH),
    "stdin_read_only": refused(os.write, 0, b"x"),
    "workdir_writable": not refused(open, "probe", "w"),
    "host_read_only": bool(os.statvfs("/").f_flag & os.ST_RDONLY),
    "no_new_privs": libc.prctl(39, 0, 0, 0, 0) == 1,
    "capabilities_dropped": not any(caps), "seccomp_filter": libc.prctl(21, 0, 0, 0, 0) == 2,
    "not_dumpable": libc.prctl(3, 0, 0, 0, 0) == 0, "epilogue_kept": refused(os.close, 3),
    "uid": os.getuid(), "workdir_bytes": os.statvfs(".").f_blocks * os.statvfs(".").f_frsize,
    "rlimits": {{k: resource.getrlimit(getattr(resource, "RLIMIT_" + k))[1]
                for k in ("AS", "CPU", "FSIZE", "NOFILE")}},
    "tasks": {count} and tasks() or None}}))
'''


def _expected(plan: dict) -> list:
    return ("fork_blocked inet_blocked unix_bind_blocked host_metadata_blocked signals_blocked "
            "inotify_blocked locks_blocked stdin_read_only not_dumpable epilogue_kept "
            "workdir_writable no_new_privs capabilities_dropped seccomp_filter".split()
            + ["host_dir_blocked", "host_file_blocked"] * bool(plan["landlock"])
            + ["host_read_only"] * bool(plan["mount"]))
