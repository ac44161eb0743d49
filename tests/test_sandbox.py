"""sandbox.py under attack: every property of issues 3 and 15 is a real attack that must be
contained (not a mock), followed by the same checks: no process left, no run directory
left, the workers untouched, and the next run works. Then the code-interpreter helpers and
the grader with real-data shapes. Attacks are bounded (a fork storm of 200, a 400 MiB disk
fill) so a regression cannot take the machine down. No wall-clock bounds: behaviour is
checked by what ran. Linux only; well under a minute on 2 cores."""
import concurrent.futures
import ctypes
import errno
import hashlib
import io
import itertools
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time

import pytest

from machinery import sandbox_linux as confine
import sandbox
from machinery import sandbox_pool
from evaluate import run_tests
from sandbox import Result, Sandbox, format_tool_output, prepare_code

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux-only sandbox")

SECRET = "host-secret-" + secrets.token_hex(8)
PROJECT = os.path.dirname(os.path.abspath(sandbox.__file__))
PR_SET_CHILD_SUBREAPER = 36
libc = ctypes.CDLL(None, use_errno=True)


# ----------------------------------------------------------------------------- helpers

def process_table():
    """pid -> (parent pid, state) of every process on the machine."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(root):
    table = process_table()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = state
                frontier.append(pid)
    return found


def describe(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


POOLS = []                                            # the module's fixtures' pools


def known_workers(box):
    pids = set(box.worker_pids())
    for pool in POOLS + [sandbox._default]:
        if pool is not None and not pool._closed:
            pids |= set(pool.worker_pids())
    return pids


def leftovers(box, allowed=()):
    """Processes below this test process that are neither pool workers nor expected.
    This process is a child subreaper (see the fixture), so anything that escaped a run's
    process group and outlived its worker would be reparented here and found."""
    for pid, state in descendants(os.getpid()).items():
        if state == "Z" and pid not in known_workers(box):
            try:
                os.waitpid(pid, os.WNOHANG)            # orphans reparented to us
            except ChildProcessError:
                pass
    live = {p: s for p, s in descendants(os.getpid()).items() if s != "Z"}
    return {p: describe(p) for p in live
            if p not in box.baseline and p not in known_workers(box) and p not in allowed}


def assert_contained(box, workers=None, allowed=()):
    deadline = time.monotonic() + 5
    while True:
        left = leftovers(box, allowed)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes survived the run: {left}"
    if workers is not None:
        assert sorted(box.worker_pids()) == workers, "a pool worker died"
    for name in os.listdir(box.root):                 # every run directory is gone
        assert os.listdir(os.path.join(box.root, name)) == [], name
    after = box.run("print('still fine')", timeout=10)
    assert (after.status, after.stdout) == ("ok", "still fine\n"), after


def attack(box, code, timeout=1.0, allowed=(), **options):
    workers = sorted(box.worker_pids())
    started = time.monotonic()
    result = box.run(code, timeout=timeout, **options)
    elapsed = time.monotonic() - started
    assert_contained(box, workers, allowed)
    return result, elapsed


def wait_ready(box, count=2):
    deadline = time.monotonic() + 30
    while len(box.worker_pids()) < count or not all(w and w.ready for w in box._workers):
        assert time.monotonic() < deadline, "workers not ready"
        time.sleep(0.05)


def wait_for_a_run(box, asleep=False):
    """Until some worker has forked a run (a child process exists below it), or, with
    `asleep`, until that run sits in its time.sleep (clock_nanosleep), well past set-up."""
    nanosleep = {"x86_64": "230", "aarch64": "115"}[platform.machine()]

    def sleeping(pid):
        try:
            return open(f"/proc/{pid}/syscall").read().split()[0] == nanosleep
        except (OSError, IndexError):
            return False
    deadline = time.monotonic() + 30
    while not any(not asleep or sleeping(child) for pid in box.worker_pids() for child in descendants(pid)):
        assert time.monotonic() < deadline, "no run started"
        time.sleep(0.02)


def syscall_number(name):
    return confine._SYSCALLS.get(platform.machine(), {}).get(name)


@pytest.fixture(scope="module")
def box():
    os.environ["SANDBOX_TEST_SECRET"] = SECRET       # a token in the host environment
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    baseline = set(descendants(os.getpid()))
    pool = Sandbox(workers=2)
    pool.capabilities()
    pool.baseline = baseline
    POOLS.append(pool)
    yield pool
    pool.close()
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    os.environ.pop("SANDBOX_TEST_SECRET", None)


@pytest.fixture(scope="module")
def caps(box):
    return box.capabilities()


@pytest.fixture(scope="module")
def floor():
    """A pool with nothing but the floor, as on a machine that grants no further layer (root here:
    tests/test_sandbox_envs.py has the other users and machines)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sandbox_pool, "grants", granted(**NO_LANDLOCK, **NO_MOUNT, **NO_CGROUP, **NO_UID))
        pool = Sandbox(workers=1, preimport=(), require="floor")
    pool.baseline = set(descendants(os.getpid()))
    assert pool.wait_ready().endswith("simulated)]") and pool.plan["watch"] == ["disk", "tasks"]
    POOLS.append(pool)
    yield pool
    pool.close()


# ----------------------------------------------------------------------------- basics

def test_capabilities_are_in_force(box, caps):
    print(json.dumps(caps, indent=1))
    assert caps["seccomp"] == f"bpf filter ({platform.machine()})"
    assert caps["layers"] == box.description and caps["layers"].startswith("sandbox: 2 workers; in force: seccomp")
    assert set(sandbox_pool._expected(box.plan)) >= {
        "fork_blocked", "inet_blocked", "unix_bind_blocked", "no_new_privs", "capabilities_dropped",
        "stdin_read_only", "workdir_writable", "inotify_blocked", "locks_blocked",
        "host_metadata_blocked"}
    # measured inside a run
    assert all(caps["verified"][k] for k in sandbox_pool._expected(box.plan)), caps["verified"]
    assert caps["rlimits"]["NOFILE"] == sandbox_pool.MAX_OPEN_FILES and caps["rlimits"]["FSIZE"] > 0
    assert caps["worker_threads"] == 1                # forking a threaded worker is unsafe
    if "landlock" not in box.off:
        assert caps["landlock_abi"] == confine._syscall(confine._NR_LANDLOCK_CREATE, 0, 0, 1) >= 1 and caps["verified"]["host_file_blocked"]
    if "mount" not in box.off:
        assert caps["namespace"].startswith("mount") and caps["verified"]["host_read_only"]
        assert caps["disk_quota"] == f"tmpfs {sandbox_pool.DEFAULT_DISK_MB} MiB"
    if "tasks" not in box.off:
        assert caps["tasks"]["measured"] == caps["tasks"]["max"] == sandbox_pool.MAX_TASKS
        assert caps["tasks"]["mechanism"].startswith(("pids cgroup", "RLIMIT_NPROC"))


def needs(pool, layer):
    if layer in pool.off:
        pytest.skip(f"{sandbox_pool.LAYERS[layer]} is not in force here: {pool.off[layer]}")


def granted(**changes):
    """What grants() found here, with some layers refused as a machine without them would."""
    found = dict(sandbox_pool.grants(), **changes)
    return lambda: found


NO_LANDLOCK = {"landlock": 0, "landlock_why": "landlock_create_ruleset: EPERM (simulated)"}
NO_MOUNT = {"mount_root": {"why": "unshare(CLONE_NEWNS): EPERM (simulated)", "nproc": False},
            "mount_user": {"why": "unshare(CLONE_NEWUSER|CLONE_NEWNS): EPERM (simulated)", "nproc": False}}
NO_CGROUP = {"cgroup": None, "cgroup_why": "/sys/fs/cgroup/pids is on a read-only mount (simulated)"}
NO_UID = {"uid": {"why": "setresuid: EPERM (simulated)", "expose": [], "nproc": False}}


@pytest.mark.parametrize("refused,layer", [(NO_LANDLOCK, "landlock"), (NO_MOUNT, "mount"),
                                           ({**NO_CGROUP, **NO_UID}, "tasks"), (NO_UID, "uid")])
def test_a_missing_layer_is_named_and_require_all_stops_the_pool(monkeypatch, refused, layer, capfd):
    monkeypatch.setattr(sandbox_pool, "grants", granted(**refused))
    named = re.escape(sandbox_pool.LAYERS[layer] + " [") + ".*simulated"
    for require in ("all", layer):       # fail closed, naming what is missing and why
        with pytest.raises(RuntimeError, match=f"require={require!r}.*{named}"):
            Sandbox(workers=1, require=require)
    for require in ("landlok", "floor," + layer, "", layer + ",", "uid,uid", "default,landlock"):
        with pytest.raises(ValueError, match="allowed: 'default'"):     # one meaning, checked
            Sandbox(workers=1, require=require)
    with Sandbox(workers=1, preimport=(), require="floor") as pool:    # the floor starts, and says so
        line = pool.wait_ready()
        assert line == pool.description and capfd.readouterr().err.count(line) == 1
        assert re.search("not in force: .*" + named, line), line
        assert pool.run("print(1)").stdout == "1\n"


def test_unsupported_machine_stops_the_pool(monkeypatch):
    monkeypatch.setattr(confine, "ARCH", "riscv64")
    with pytest.raises(RuntimeError, match="seccomp filter for riscv64"):
        Sandbox(workers=1)


def test_exit_codes_and_statuses(box):
    cases = [("print('hi')", "ok", 0), ("import sys; sys.exit(3)", "error", 3),
             ("import os; os._exit(7)", "error", 7), ("raise SystemExit('bye')", "error", 1),
             ("1/0", "error", 1), ("import sys; sys.exit(0)", "ok", 0), ("x = (", "error", 1),
             ("raise KeyboardInterrupt", "error", 1), ("import os; os.abort()", "killed", -6),
             ("import os; os._exit(0)", "ok", 0)]   # exit status 0 and no failure: a success
    results = box.run_many([c for c, _, _ in cases], timeout=5)
    for (code, status, rc), r in zip(cases, results):
        assert (r.status, r.returncode) == (status, rc), (code, r)
    assert results[0].stdout == "hi\n" and results[3].stderr == "bye\n"
    assert "ZeroDivisionError" in results[4].stderr
    assert "sandbox_worker.py" not in results[4].stderr    # the bootstrap's frames are hidden
    assert "SyntaxError" in results[6].stderr
    assert all(r.seconds > 0 for r in results)


def test_run_many_keeps_order_and_submit_returns_a_future(box):
    codes = [f"import time; time.sleep({0.3 if i % 2 == 0 else 0}); print({i})" for i in range(6)]
    results = box.run_many(codes, timeout=5)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    future = box.submit("print(6 * 7)")
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(timeout=30).stdout == "42\n"
    results = box.run_many(["print(input())"] * 2, stdins=["a\n", "b\n"])
    assert [r.stdout for r in results] == ["a\n", "b\n"]


def test_fresh_working_directory_per_run(box):
    first = box.run("import os, tempfile\nopen('note.txt', 'w').write('x')\n"
                    "print(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])\n"
                    "print(tempfile.mkstemp()[1].startswith(os.getcwd()))")
    assert first.stdout == "True\nTrue\n", first
    second = box.run("import os; print(os.listdir('.'))")
    assert second.stdout == "[]\n", second


def test_numpy_and_sympy_work_and_are_reseeded(box, caps):
    if "numpy" not in caps["preimported"]:
        pytest.skip("numpy is not installed")
    code = "import numpy as np, random\nprint(np.random.rand(), random.random())"
    a, b = box.run_many([code, code])
    assert a.status == b.status == "ok" and a.stdout != b.stdout
    r = box.run("import numpy as np\nprint(np.linalg.det(np.eye(3) * 2))")
    assert r.stdout.strip() == "7.999999999999998" or float(r.stdout) == pytest.approx(8.0)
    if "sympy" in caps["preimported"]:
        r = box.run("import sympy as sp\nx = sp.Symbol('x')\nprint(sp.factor(x**2 - 1))")
        assert r.stdout == "(x - 1)*(x + 1)\n", r


def test_threads_keep_working(box):
    code = ("import threading\nfrom concurrent.futures import ThreadPoolExecutor\nout = []\n"
            "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(20)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "print(len(out), sum(ThreadPoolExecutor(4).map(abs, range(-5, 5))))")
    r = box.run(code)
    assert (r.status, r.stdout) == ("ok", "20 25\n"), r


# ----------------------------------------------------------------------------- time

def test_infinite_loop(box):
    r, elapsed = attack(box, "while True:\n    pass", timeout=1.0)
    assert r.status == "timeout" and r.returncode == -signal.SIGKILL and r.seconds >= 1.0


def test_sleep(box):
    r, elapsed = attack(box, "import time\ntime.sleep(60)", timeout=1.0)
    assert r.status == "timeout"


def test_sigterm_ignored(box):
    code = ("import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
            "    signal.signal(s, signal.SIG_IGN)\nprint('ignoring', flush=True)\nwhile True:\n    pass")
    r, elapsed = attack(box, code, timeout=1.0)
    assert r.status == "timeout" and r.stdout == "ignoring\n"


# ----------------------------------------------------------------------------- processes

def test_fork_storm(box):
    clone = syscall_number("clone")
    code = f"""
import ctypes, multiprocessing, os, pty, time
blocked = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        blocked += 1
        continue
    if pid == 0:                      # only reached if fork got through: stay bounded
        time.sleep(20)
        os._exit(0)
print("fork blocked", blocked)
libc = ctypes.CDLL(None, use_errno=True)
if {clone!r} is not None:
    r = libc.syscall({clone!r}, 17, 0, 0, 0, 0)     # clone(SIGCHLD): fork by another name
    if r == 0:
        time.sleep(20)
        os._exit(0)
    print("raw clone", r, ctypes.get_errno())
try:
    multiprocessing.Process(target=time.sleep, args=(20,)).start()
    print("multiprocessing STARTED")
except OSError:
    print("multiprocessing blocked")
try:
    pid, fd = pty.fork()
    if pid == 0:
        time.sleep(20)
        os._exit(0)
    print("pty STARTED")
except OSError:
    print("pty blocked")
"""
    r, _ = attack(box, code, timeout=5)
    assert "fork blocked 200" in r.stdout, r
    assert clone is None or f"raw clone -1 {errno.EPERM}" in r.stdout
    assert "multiprocessing blocked" in r.stdout and "pty blocked" in r.stdout, r


def test_subprocess_and_os_system(box, tmp_path):
    marker = str(tmp_path / "ran")
    touch = shutil.which("touch") or "/usr/bin/touch"
    code = f"""
import ctypes, os, subprocess
marker, touch = {marker!r}, {touch!r}
attempts = {{}}
def attempt(name, action):
    try:
        attempts[name] = repr(action())
    except Exception as exc:
        attempts[name] = "blocked " + type(exc).__name__
attempt("subprocess", lambda: subprocess.run([touch, marker]).returncode)
attempt("system", lambda: os.system("touch " + marker))
attempt("popen", lambda: os.popen("touch " + marker).read())
attempt("posix_spawn", lambda: os.posix_spawn(touch, ["touch", marker], {{}}))
attempt("execv", lambda: os.execv(touch, ["touch", marker]))
libc = ctypes.CDLL(None, use_errno=True)
argv = (ctypes.c_char_p * 3)(touch.encode(), marker.encode(), None)
attempt("raw execve", lambda: (libc.execve(touch.encode(), argv, None), ctypes.get_errno()))
print(attempts)
"""
    r, _ = attack(box, code, timeout=5)
    assert not os.path.exists(marker), "a program ran"
    assert r.status == "ok", r
    attempts = eval(r.stdout)
    for name in ("subprocess", "popen", "posix_spawn", "execv"):
        assert attempts[name].startswith("blocked"), (name, attempts)
    assert attempts["system"] != "0" and attempts["raw execve"] == f"(-1, {errno.EPERM})"


def test_setsid_escape(box):
    code = """
import os, time
attempts = {}
try:
    os.setsid()
    attempts["setsid"] = "ESCAPED"
except OSError:
    attempts["setsid"] = "refused"
try:
    os.setpgid(0, 0)
    attempts["setpgid"] = "same group"
except OSError:
    attempts["setpgid"] = "refused"
try:                                   # the classic daemon: fork, setsid, fork again
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(20)
        os._exit(0)
    attempts["daemon"] = "FORKED"
except OSError:
    attempts["daemon"] = "refused"
print(attempts, os.getsid(0) == os.getpid() == os.getpgid(0))
"""
    r, _ = attack(box, code, timeout=5)
    assert "ESCAPED" not in r.stdout and "FORKED" not in r.stdout, r
    assert r.stdout.strip().endswith("True"), r       # its own session and group leader


def test_kill_parent_pool_worker_and_others(box):
    victim = subprocess.Popen(["sleep", "30"])        # a process outside the run
    try:
        tgkill, ptrace = syscall_number("tgkill"), syscall_number("ptrace")
        code = f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
worker, victim, owner = os.getppid(), {victim.pid}, {os.getpid()}
attempts = {{}}
def attempt(name, action):
    try:
        action()
        attempts[name] = "DELIVERED"
    except OSError as exc:
        attempts[name] = "blocked"
attempt("kill worker", lambda: os.kill(worker, signal.SIGKILL))
attempt("killpg worker", lambda: os.killpg(worker, signal.SIGKILL))
attempt("kill victim", lambda: os.kill(victim, signal.SIGKILL))
attempt("probe owner", lambda: os.kill(owner, 0))          # signal 0: harmless if it regresses
attempt("probe everyone", lambda: os.kill(-1, 0))
attempt("probe init", lambda: os.kill(1, 0))
attempt("pidfd victim", lambda: os.pidfd_open(victim))
def raw(nr, *args):
    if libc.syscall(nr, *args) != 0:
        raise OSError(ctypes.get_errno(), "raw")
if {tgkill!r}:
    attempt("tgkill victim", lambda: raw({tgkill!r}, victim, victim, signal.SIGKILL))
if {ptrace!r}:
    attempt("ptrace victim", lambda: raw({ptrace!r}, 16, victim, 0, 0))   # PTRACE_ATTACH
os.kill(os.getpid(), 0)                    # its own process stays reachable
print(attempts)
"""
        r, _ = attack(box, code, timeout=5, allowed={victim.pid})
        attempts = eval(r.stdout)
        assert attempts and all(v == "blocked" for v in attempts.values()), attempts
        assert victim.poll() is None, "the victim was killed"
    finally:
        victim.kill()
        victim.wait()


def test_no_inherited_descriptors_and_parent_death_signal_kept(box):
    code = ("import ctypes, os\nopen_fds = []\nfor fd in range(4096):\n    try:\n"
            "        os.fstat(fd)\n        open_fds.append(fd)\n    except OSError:\n        pass\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print(open_fds, libc.prctl(1, 0, 0, 0, 0), ctypes.get_errno())")   # PR_SET_PDEATHSIG
    r, _ = attack(box, code, timeout=5)
    assert r.stdout == f"[0, 1, 2, 3] -1 {errno.EPERM}\n", r      # 3: the epilogue's pipe


def test_pool_worker_killed_from_outside(box):
    old = sorted(box.worker_pids())
    future = box.submit("import time\nprint('started', flush=True)\ntime.sleep(30)", timeout=20)
    wait_for_a_run(box, asleep=True)
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    lost = future.result(timeout=20)
    assert lost.status == "killed" and "worker" in lost.stderr, lost
    assert box.run("print('back')", timeout=10).stdout == "back\n"   # restarted
    wait_ready(box)
    assert not set(box.worker_pids()) & set(old) and len(box.worker_pids()) == 2
    assert_contained(box)                        # the sleeping run died with its worker
    assert sorted(os.listdir(box.root)) == sorted(os.path.basename(w.dir) for w in box._workers)


def test_pool_shuts_down_with_its_owner(box, tmp_path):
    script = ("import json, sys, time, sandbox\n"
              "box = sandbox.Sandbox(workers=2, preimport=())\nbox.capabilities()\n"
              "box.submit('import time; time.sleep(60)', timeout=60)\ntime.sleep(0.3)\n"
              "print(json.dumps([box.root] + box.worker_pids()), flush=True)\ntime.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=PROJECT)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env,
                             cwd=str(tmp_path))
    try:
        root, *workers = json.loads(owner.stdout.readline())
        assert len(workers) == 2 and os.path.isdir(root)
        owner.kill()                              # no atexit, no close(): a crash
        owner.wait()
        deadline = time.monotonic() + 10
        while True:
            alive = [p for p, s in descendants(os.getpid()).items() if s != "Z"
                     and p not in box.baseline and p not in known_workers(box)]
            if (not alive and not os.path.exists(root)) or time.monotonic() > deadline:
                break
            leftovers(box)                        # reaps what was reparented to us
            time.sleep(0.05)
        assert not alive, {p: describe(p) for p in alive}
        assert not os.path.exists(root), "the dead pool's directory was left behind"
    finally:
        owner.kill()
        owner.wait()


def test_close_stops_workers_and_removes_everything():
    pool = Sandbox(workers=1, preimport=())
    pool.capabilities()
    workers, root = pool.worker_pids(), pool.root
    running = pool.submit("import time; time.sleep(30)", timeout=30)
    wait_for_a_run(pool)
    pool.close()
    assert running.result(timeout=10).status == "killed"
    assert not os.path.exists(root)
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or process_table()[pid][1] == "Z"
    with pytest.raises(RuntimeError):
        pool.submit("print(1)")


# ----------------------------------------------------------------------------- files

def test_write_outside_the_working_directory(box, tmp_path):
    needs(box, "landlock")
    host = tmp_path / "host.txt"
    host.write_text("original")
    before = os.stat(host)
    token = secrets.token_hex(6)
    targets = [str(tmp_path / "escape.txt"), f"/tmp/sandbox-escape-{token}",
               os.path.join(PROJECT, f"escape-{token}"), os.path.join(box.root, "escape"),
               os.path.join(os.path.expanduser("~"), f"escape-{token}")]
    code = f"""
import os
host, targets = {str(host)!r}, {targets!r}
attempts = {{}}
def attempt(name, action):
    try:
        action()
        attempts[name] = "DONE"
    except OSError:
        attempts[name] = "blocked"
for i, path in enumerate(targets):
    attempt(f"create {{i}}", lambda: open(path, "w").write("x"))
    attempt(f"mkdir {{i}}", lambda: os.mkdir(path))
attempt("append", lambda: open(host, "a").write("x"))
attempt("truncate", lambda: os.truncate(host, 0))
attempt("chmod", lambda: os.chmod(host, 0o777))
attempt("utime", lambda: os.utime(host, (0, 0)))
attempt("xattr", lambda: os.setxattr(host, "user.pwned", b"1"))
attempt("unlink", lambda: os.unlink(host))
attempt("rename away", lambda: os.rename(host, "stolen"))
attempt("hard link", lambda: os.link(host, "hardlink"))
open("mine", "w").write("x")
attempt("rename out", lambda: os.rename("mine", targets[0]))
os.symlink(host, "link")
attempt("write through symlink", lambda: open("link", "w").write("x"))
print(attempts)
"""
    r, _ = attack(box, code, timeout=5)
    attempts = eval(r.stdout)
    assert attempts and all(v == "blocked" for v in attempts.values()), attempts
    for path in targets:
        assert not os.path.exists(path), path
    after = os.stat(host)
    assert host.read_text() == "original"
    assert (after.st_mode, after.st_mtime_ns, after.st_ino) == (before.st_mode, before.st_mtime_ns,
                                                                before.st_ino)


def test_read_host_files(box, tmp_path):
    needs(box, "landlock")
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    code = f"""
import os
attempts = {{}}
def attempt(name, action):
    try:
        attempts[name] = "READ " + repr(action())[:200]
    except OSError:
        attempts[name] = "blocked"
attempt("secret", lambda: open({str(secret)!r}).read())
attempt("passwd", lambda: open("/etc/passwd").read())
attempt("shadow", lambda: open("/etc/shadow").read())
attempt("project file", lambda: open({os.path.join(PROJECT, "sandbox.py")!r}).read())
attempt("list /", lambda: os.listdir("/"))
attempt("list home", lambda: os.listdir(os.path.expanduser("~root")))
attempt("list tmp", lambda: os.listdir({str(tmp_path)!r}))
attempt("list pool", lambda: os.listdir(".."))
attempt("proc", lambda: os.listdir("/proc"))
print(attempts)
print(len(open(os.__file__).read()) > 0)          # the standard library stays readable
"""
    r, _ = attack(box, code, timeout=5)
    assert SECRET not in r.stdout and "root:" not in r.stdout
    attempts = eval(r.stdout.splitlines()[0])
    assert all(v == "blocked" for v in attempts.values()), attempts
    assert r.stdout.splitlines()[1] == "True", r


def test_host_environment_is_not_visible(box):
    needs(box, "landlock")
    code = f"""
import os
print(dict(os.environ))
for path in ["/proc/self/environ", "/proc/1/environ", f"/proc/{{os.getppid()}}/environ",
             "/proc/{os.getpid()}/environ"]:
    try:
        print(path, open(path, "rb").read())
    except OSError:
        print(path, "blocked")
"""
    r, _ = attack(box, code, timeout=5)
    assert r.status == "ok", r
    assert SECRET not in r.stdout + r.stderr
    env = eval(r.stdout.splitlines()[0])
    assert "PYTHONPATH" not in env and "SANDBOX_TEST_SECRET" not in env
    assert env["OPENBLAS_NUM_THREADS"] == "1" and env["HOME"] == env["TMPDIR"]
    for pid in box.worker_pids():                    # nor in the workers' own environment
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert SECRET.encode() not in f.read()


def test_disk_fill(box, caps):
    needs(box, "mount")
    code = """
import json, os
written, errors = 0, set()
for i in range(400):                       # 400 MiB at most, against a 16 MiB quota
    try:
        with open(f"f{i}", "wb") as f:
            f.write(b"\\0" * (1 << 20))
        written += 1 << 20
    except OSError as exc:
        errors.add(exc.errno)
        break
try:
    with open("sparse", "wb") as f:         # a 10 GiB file with one byte in it
        f.seek(10 << 30)
        f.write(b"x")
except OSError as exc:
    errors.add(exc.errno)
count = 0
try:
    for i in range(100_000):               # inodes are bounded too
        open(f"empty{i}", "w").close()
        count += 1
except OSError as exc:
    errors.add(exc.errno)
print(json.dumps([written >> 20, sorted(errors), count]))
"""
    r, _ = attack(box, code, timeout=10, disk_mb=16)
    written, errs, count = json.loads(r.stdout)
    assert written <= 16, r
    assert set(errs) <= {errno.ENOSPC, errno.EFBIG} and errno.ENOSPC in errs, r
    assert count <= confine.MAX_FILES, r


# ----------------------------------------------------------------------------- network

def test_tcp_to_a_local_listener(box, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    unix_path = str(tmp_path / "unix.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen(8)
    unix.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0sandbox-test-" + secrets.token_hex(4))
    abstract.listen(8)
    abstract.setblocking(False)
    code = f"""
import ctypes, socket
attempts = {{}}
def attempt(name, action):
    try:
        action()
        attempts[name] = "CONNECTED"
    except OSError:
        attempts[name] = "blocked"
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1))
attempt("tcp6", lambda: socket.create_connection(("::1", {port}), timeout=1))
attempt("unix path", lambda: socket.socket(socket.AF_UNIX).connect({unix_path!r}))
attempt("unix abstract", lambda: socket.socket(socket.AF_UNIX).connect({abstract.getsockname()!r}))
libc = ctypes.CDLL(None, use_errno=True)
def raw_socket():
    if libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0) < 0:
        raise OSError(ctypes.get_errno(), "socket")
attempt("raw socket", raw_socket)
a, b = socket.socketpair()                  # local pairs stay usable (asyncio needs them)
a.sendall(b"ping")
print(attempts, b.recv(4))
"""
    try:
        r, _ = attack(box, code, timeout=5)
        attempts, _, pong = r.stdout.rpartition("} ")
        assert all(v == "blocked" for v in eval(attempts + "}").values()), r.stdout
        assert pong.strip() == "b'ping'", r
        for server in (listener, unix, abstract):
            with pytest.raises(BlockingIOError):
                server.accept()                 # the listener saw nothing
    finally:
        listener.close()
        unix.close()
        abstract.close()


def test_udp_to_a_local_listener(box):
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = f"""
import socket
attempts = {{}}
def attempt(name, action):
    try:
        action()
        attempts[name] = "SENT"
    except OSError:
        attempts[name] = "blocked"
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"leak", ("127.0.0.1", {port})))
attempt("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP))
attempt("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW))
attempt("unix dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"leak", "/dev/log"))
print(attempts)
"""
    try:
        r, _ = attack(box, code, timeout=5)
        assert all(v == "blocked" for v in eval(r.stdout).values()), r.stdout
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            listener.recvfrom(100)
    finally:
        listener.close()


# ----------------------------------------------------------------------------- memory, output

def test_memory_blowup_sudden(box, caps):
    codes = ["x = bytearray(8 * 1024 ** 3)", "x = 'a' * (4 << 30)",
             "import mmap\nm = mmap.mmap(-1, 4 << 30)\nm[-1] = 1"]
    if "numpy" in caps["preimported"]:
        codes.append("import numpy as np\nx = np.ones(1 << 31)")
    workers = sorted(box.worker_pids())
    results = box.run_many(codes, timeout=5, memory_mb=256)
    assert [r.status for r in results] == ["memory"] * len(codes), results
    assert_contained(box, workers)


def test_memory_blowup_gradual(box):
    code = ("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))   # a MiB at a time")
    r, elapsed = attack(box, code, timeout=10, memory_mb=200)
    assert r.status == "memory" and "MemoryError" in r.stderr, r
    code = ("def grow():\n    rows = []\n    while True:\n        rows.append([0] * 10000)\ngrow()")
    r, _ = attack(box, code, timeout=10, memory_mb=200)
    assert r.status == "memory", r


def test_huge_output(box):
    code = ("import sys\nline = 'x' * 999 + '\\n'\nfor _ in range(100_000):   # 100 MB\n"
            "    sys.stdout.write(line)\nsys.stderr.write('e' * 10_000_000)\nprint('END')")
    r, _ = attack(box, code, timeout=20)
    limit = sandbox_pool.DEFAULT_OUTPUT_LIMIT
    assert r.status == "ok", r.status
    assert len(r.stdout.encode()) < limit + 200 and len(r.stderr.encode()) < limit + 200
    assert "bytes of output cut" in r.stdout and r.stdout.endswith("END\n")
    assert r.stdout.startswith("x" * 999)
    r, _ = attack(box, "while True:\n    print('y' * 1000)", timeout=1.0, output_limit=4096)
    assert r.status == "timeout" and len(r.stdout) < 4096 + 200 and "cut" in r.stdout


def test_binary_output(box):
    code = ("import os, sys\nsys.stdout.buffer.write(bytes(range(256)))\nsys.stdout.flush()\n"
            "os.write(1, b'\\xff\\xfe\\x00 raw \\xc3')\nsys.stderr.buffer.write(b'\\x80\\x81 err')")
    r, _ = attack(box, code, timeout=5)
    assert r.status == "ok" and "\ufffd" in r.stdout and " raw " in r.stdout and "\x00" in r.stdout
    assert r.stderr.endswith(" err")
    json.dumps(r.__dict__)                         # text all the way, safe to log


def test_stdin_given_and_eof(box):
    results = box.run_many(["print(input()[::-1]); print(input())", "input()",
                            "import sys; print(repr(sys.stdin.read()))",
                            "import sys; print(len(sys.stdin.read()))"],
                           stdins=["héllo ✓\nxyz\n", "", "", "x" * 1_000_000 + "\n"])
    assert results[0].stdout == "✓ olléh\nxyz\n", results[0]
    assert results[1].status == "error" and "EOFError" in results[1].stderr
    assert results[2].stdout == "''\n"
    assert results[3].stdout == "1000001\n"


def test_thread_storm(box):
    code = ("import threading, time\nstop = time.time() + 30\n"
            "def spin():\n    while time.time() < stop:\n        pass\nstarted = 0\ntry:\n"
            "    for _ in range(2000):\n        threading.Thread(target=spin, daemon=True).start()\n"
            "        started += 1\nexcept RuntimeError:\n    print('refused after', started, flush=True)\n"
            "time.sleep(30)")
    r, elapsed = attack(box, code, timeout=1.5, memory_mb=256)
    assert r.status == "timeout", r


def test_segfault(box):
    r, _ = attack(box, "import ctypes\nctypes.string_at(0)", timeout=5)
    assert r.status == "killed" and r.returncode == -signal.SIGSEGV, r
    assert format_tool_output(r).endswith("Killed by SIGSEGV.")


def test_deep_recursion(box):
    workers = sorted(box.worker_pids())
    plain, c_level = box.run_many(
        ["def f(n):\n    return f(n + 1)\nf(0)",
         "import sys\nsys.setrecursionlimit(10 ** 8)\nx = []\nfor _ in range(10 ** 6):\n"
         "    x = [x]\nprint(repr(x)[:5])"],      # C-level recursion: the stack overflows
        timeout=5, memory_mb=256)
    assert plain.status == "error" and "RecursionError" in plain.stderr
    assert c_level.status in ("killed", "error", "memory"), c_level
    # Python frames live on the heap in 3.11+: unbounded recursion runs out of memory.
    unbounded = box.run("import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n"
                        "    return f(n + 1)\nf(0)", timeout=5, memory_mb=64)
    assert unbounded.status in ("memory", "killed", "error"), unbounded
    assert_contained(box, workers)


def test_timeouts_do_not_leak_into_other_runs(box):
    slow, fast = box.run_many(["while True: pass", "print('fast')"], timeout=1.0)
    assert (slow.status, fast.status, fast.stdout) == ("timeout", "ok", "fast\n")


def test_module_level_api():
    r = sandbox.run("print(1 + 1)")
    assert (r.status, r.stdout, r.returncode) == ("ok", "2\n", 0)
    assert [x.stdout for x in sandbox.run_many(["print(1)", "print(2)"])] == ["1\n", "2\n"]
    assert sandbox.submit("print(3)").result().stdout == "3\n"
    assert sandbox.capabilities()["workers"] >= 1


# ----------------------------------------------------------------------------- the tool

def test_prepare_code_prints_the_last_expression(box):
    cases = {
        "x = 5\nx * 2": "10\n",
        "print('a')": "a\n",                       # no extra None
        "None": "",
        "1, 2": "(1, 2)\n",
        "'abc'": "'abc'\n",
        "a = 3; a": "3\n",
        "(1 +\n 2)  # three": "3\n",
        "s = 'héllo ✓'\nlen(s)": "7\n",
        "x = 1": "",
        "import math\nif True:\n    y = 2\nmath.sqrt(16)": "4.0\n",
    }
    results = box.run_many([prepare_code(c) for c in cases])
    for (code, expected), r in zip(cases.items(), results):
        assert (r.status, r.stdout) == ("ok", expected), (code, r)
    assert prepare_code("x = (") == "x = ("         # syntax errors go through unchanged
    r = box.run(prepare_code("x = 1\n1 / 0"))
    assert "line 2" in r.stderr                    # line numbers survive the rewrite


def test_prepare_code_passes_code_it_cannot_parse_to_the_run(box):
    """Code ast.parse raises on with something else than SyntaxError (too deep, a NUL byte, a lone
    surrogate) goes to the run unchanged, which reports the error to the model."""
    cases = ["1" + "+1" * 100_000, "a\x00b", 'print("\ud800")']
    assert [prepare_code(c) for c in cases] == cases
    results = box.run_many(cases)
    assert [r.status for r in results] == ["error"] * 3
    assert [r.stderr.split(":")[0].split()[-1] for r in results] == \
        ["RecursionError", "SyntaxError", "UnicodeEncodeError"]


def test_prepare_code_takes_the_first_python_fence():
    text = "Let me check.\n```python\nprint(1)\n2 + 2\n```\nthen\n```python\nprint('second')\n```"
    code = prepare_code(text)
    assert "second" not in code and code.startswith("print(1)\n")
    assert prepare_code("```py\nprint(5)\n```") == "print(5)\n"    # print(...) left as is
    assert prepare_code("```python\nprint(6)") == "print(6)"          # unterminated fence
    assert prepare_code("no fence\nprint(7)") == "no fence\nprint(7)"


def test_format_tool_output():
    assert format_tool_output(Result("ok", "hi\n", "", 0, 0.1)) == "hi\n"
    assert format_tool_output(Result("error", "out", "err\n", 1, 0.1)) == "out\nerr\n"
    timeout = format_tool_output(Result("timeout", "partial", "", -9, 1.0))
    assert timeout.startswith("partial\n") and "TimeoutError" in timeout
    assert "MemoryError" in format_tool_output(Result("memory", "", "", 1, 0.1))
    long = Result("ok", "a" * 500 + "b" * 500, "", 0, 0.1)
    cut = format_tool_output(long, max_chars=256)
    assert len(cut) <= 256 and cut.startswith("a") and cut.endswith("b") and "..." in cut
    cut = format_tool_output(Result("timeout", "z" * 1000, "", -9, 1.0), max_chars=256)
    assert len(cut) <= 256 and cut.endswith("stopped.")   # the status line survives whole
    assert len(format_tool_output(long, max_chars=10)) <= 10


# ----------------------------------------------------------------------------- unit tests

STDIN_TESTS = {"fn_name": None, "cases": [
    {"input": "1 2\n", "output": "3\n"}, {"input": "10 -3\n", "output": "7"},
    {"input": "0 0\n", "output": "0\n\n"}, {"input": "5 5\n", "output": "10   \n"}]}


def test_run_tests_stdin_programs(box):
    correct = "a, b = map(int, input().split())\nprint(a + b)"
    assert run_tests(correct, STDIN_TESTS, timeout=2, sandbox=box) == [True] * 4
    trailing = "a, b = map(int, input().split())\nprint(str(a + b) + '   ')\nprint()"
    assert run_tests(trailing, STDIN_TESTS, timeout=2, sandbox=box) == [True] * 4
    wrong = "a, b = map(int, input().split())\nprint(a - b)"
    assert run_tests(wrong, STDIN_TESTS, timeout=2, sandbox=box) == [False, False, True, False]
    crash = "raise ValueError('boom')"
    assert run_tests(crash, STDIN_TESTS, timeout=2, sandbox=box) == [False] * 4
    loop = "a, b = map(int, input().split())\nwhile a > 4:\n    pass\nprint(a + b)"
    assert run_tests(loop, STDIN_TESTS, timeout=1, sandbox=box) == [True, False, True, False]
    assert run_tests("", STDIN_TESTS, sandbox=box) == [False] * 4
    assert run_tests(correct, {"fn_name": None, "cases": []}, sandbox=box) == []


FN_TESTS = {"fn_name": "twoSum", "cases": [
    {"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]"},
    {"input": "[3, 2, 4]\n6", "output": "[1, 2]"},
    {"input": "[3, 3]\n6", "output": "[0, 1]"}]}
TWO_SUM = """
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen:
                return (seen[target - n], i)          # a tuple: compared as JSON, a list
            seen[n] = i
"""


def test_run_tests_functional_problems(box):
    assert run_tests(TWO_SUM, FN_TESTS, timeout=2, sandbox=box) == [True] * 3
    function = "def twoSum(nums, target):\n    return [0, 1]"
    assert run_tests(function, FN_TESTS, timeout=2, sandbox=box) == [True, False, True]
    noisy = "def twoSum(nums, target):\n    print('debug [9, 9]')\n    return [0, 1]"
    assert run_tests(noisy, FN_TESTS, timeout=2, sandbox=box) == [True, False, True]
    crash = "class Solution:\n    def twoSum(self, nums, target):\n        return 1 / 0"
    assert run_tests(crash, FN_TESTS, timeout=2, sandbox=box) == [False] * 3
    loop = "class Solution:\n    def twoSum(self, nums, target):\n        while True: pass"
    assert run_tests(loop, FN_TESTS, timeout=1, sandbox=box) == [False] * 3
    missing = "class Solution:\n    def other(self, nums, target):\n        return [0, 1]"
    assert run_tests(missing, FN_TESTS, timeout=2, sandbox=box) == [False] * 3
    unserializable = "def twoSum(nums, target):\n    return {0, 1}"
    assert run_tests(unserializable, FN_TESTS, timeout=2, sandbox=box) == [False] * 3


def test_run_tests_expected_output_never_enters_the_sandbox(box):
    tests = {"fn_name": "answer", "cases": [{"input": "1", "output": json.dumps(SECRET)}]}
    cheat = ("import gc, sys\ndef answer(x):\n    seen = []\n    frame = sys._getframe()\n"
             "    while frame:\n        seen.append(repr(frame.f_globals) + repr(frame.f_locals))\n"
             "        frame = frame.f_back\n    text = ''.join(seen) + repr(gc.get_objects())\n"
             f"    i = text.find({SECRET[:12]!r})\n    return text[i:i + {len(SECRET)}] if i >= 0 else ''")
    assert run_tests(cheat, tests, timeout=5, sandbox=box) == [False]


def test_run_tests_stop_on_failure(box, monkeypatch):
    program = ("x = int(input())\nif x == 2:\n    print('wrong')\nelif x == 3:\n"
               "    while True:\n        pass\nelse:\n    print(x)")
    tests = {"fn_name": None, "cases": [{"input": f"{i}\n", "output": f"{i}\n"} for i in (1, 2, 3, 4)]}
    stdins, submit = [], box.submit
    monkeypatch.setattr(box, "submit", lambda code, timeout, memory_mb, stdin, **kw:
                        stdins.append(stdin) or submit(code, timeout, memory_mb, stdin, **kw))
    assert run_tests(program, tests, timeout=1, stop_on_failure=True, sandbox=box) == \
        [True, False, False, False]
    assert stdins == ["1\n", "2\n"]                  # the looping case never ran
    assert run_tests(program, tests, timeout=1, sandbox=box) == [True, False, False, True]


def test_jobs_sent_to_a_dying_worker_are_sent_again(box):
    # Workers frozen before they read their jobs, then killed: the jobs never started,
    # so the pool re-sends them to the replacements instead of reporting them killed.
    wait_ready(box)
    old = box.worker_pids()
    for pid in old:
        os.kill(pid, signal.SIGSTOP)
    futures = [box.submit(f"print({i})", timeout=10) for i in range(2)]
    time.sleep(0.2)
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    results = [f.result(timeout=30) for f in futures]
    assert [(r.status, r.stdout) for r in results] == [("ok", "0\n"), ("ok", "1\n")], results


# ----------------------------------------------------------------------------- issue 15

# Finds copies of SBXMARK<32 hex> in memory the run can read, the way an attacker would
# without /proc/self/maps (Landlock hides /proc): from seeds (the heap's break, fresh
# mallocs, addresses of live objects) it widens each to the run of readable pages around
# it, probing a page with write(2) to a pipe, which fails with EFAULT instead of crashing.
# It holds only the markers' digests, never a marker.
HEAP_SCAN = r'''
import ctypes, gc, hashlib, json, os, re
libc = ctypes.CDLL(None, use_errno=True)
libc.sbrk.restype = libc.malloc.restype = ctypes.c_void_p
libc.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
PAGE = os.sysconf("SC_PAGE_SIZE")
r, w = os.pipe()
def readable(addr):
    if addr <= PAGE or libc.write(w, addr, 1) != 1:
        return False
    os.read(r, 1)
    return True
def extent(addr, limit=1 << 30):
    lo = hi = addr & ~(PAGE - 1)
    while hi - lo < limit and readable(lo - PAGE):
        lo -= PAGE
    while hi - lo < limit and readable(hi):
        hi += PAGE
    return lo, hi
seeds = [libc.sbrk(0) - 1] + [libc.malloc(n) for n in (16, 4096, 100000, 1 << 20)]
seeds += [id(o) for o in gc.get_objects()[::100]]
regions = []
for seed in seeds:
    if seed and not any(lo <= seed < hi for lo, hi in regions) and readable(seed):
        regions.append(extent(seed))
digests, found, scanned = DIGESTS, [], 0
for lo, hi in regions:
    data = ctypes.string_at(lo, hi - lo)
    scanned += len(data)
    found += [digests[d] for d in (hashlib.sha256(m.group()).hexdigest()
                                   for m in re.finditer(rb"SBXMARK[0-9a-f]{32}", data)) if d in digests]
print(json.dumps([sorted(set(found)), scanned >> 20]))
'''


def test_no_job_data_left_in_the_worker_between_runs():
    """Issue 15.1: a run scanning its own memory must not find an earlier run's program,
    stdin or output: the zygote that forks runs never holds any of them."""
    markers = {kind: "SBXMARK" + secrets.token_hex(16) for kind in ("code", "stdin", "output")}
    digests = {hashlib.sha256(m.encode()).hexdigest(): kind for kind, m in markers.items()}
    program = (f"# {markers['code']}\n" + "# padding the program to 66 KB\n" * 2200 +
               f"print(input()[:7], {markers['output'][::-1]!r}[::-1])\n")
    assert len(program) > 66_000
    with Sandbox(workers=1) as pool:                 # one worker: both runs fork from it
        first = pool.run(program, stdin=markers["stdin"] + "x" * 70_000 + "\n")
        assert first.status == "ok" and markers["output"] in first.stdout, first
        scan = pool.run(HEAP_SCAN.replace("DIGESTS", repr(digests)), timeout=60)
    found, scanned_mib = json.loads(scan.stdout)
    assert scan.status == "ok" and scanned_mib > 10, scan
    assert found == [], f"the run found the earlier run's {found}"


def test_nothing_about_the_expected_output_is_reachable(box, monkeypatch):
    """Issue 15.2: the output limit is fixed, and no frame, global or module of the run
    holds the test's expected output or its length."""
    length = 5_123_457                    # above any pid, so it cannot match one by chance
    expected = (SECRET + "\n") * (length // (len(SECRET) + 1))
    length = len(expected)
    peek = ("import sys\nseen, frame = [], sys._getframe()\nwhile frame:\n"
            "    seen.append(repr(frame.f_locals) + repr(sorted(frame.f_globals.items(), key=str)))\n"
            "    frame = frame.f_back\nprint(''.join(seen))")
    results, submit = [], box.submit
    monkeypatch.setattr(box, "submit", lambda *a, **kw: results.append(submit(*a, **kw)) or results[-1])
    assert run_tests(peek, {"fn_name": None, "cases": [{"input": "", "output": expected}]},
                     timeout=10, sandbox=box) == [False]
    seen = results[0].result().stdout
    assert results[0].result().status == "ok" and "_run_user_code" in seen
    for leak in (SECRET, str(length), str(2 * length + 4096), str(len(expected.encode()))):
        assert leak not in seen, leak


def test_stdin_is_a_read_only_pipe(box):
    """Issue 15.3: a large stdin used to be a read-write file on the host's disk."""
    code = ("import errno, os, stat, sys\nkind = 'pipe' if stat.S_ISFIFO(os.fstat(0).st_mode) else 'FILE'\n"
            "try:\n    os.write(0, b'x' * (64 << 20))\n    wrote = 'WROTE'\nexcept OSError as exc:\n"
            "    wrote = errno.errorcode[exc.errno]\nprint(kind, wrote, len(sys.stdin.read()))")
    r, _ = attack(box, code, timeout=10, stdin="y" * (1 << 20))
    assert r.stdout == f"pipe EBADF {1 << 20}\n", r


def test_abstract_unix_socket_cannot_be_offered_to_the_host(box):
    """Issue 15.4: abstract names live in the host's network namespace, so a listener
    bound there was reachable from outside. bind and listen are refused."""
    name = "\0sandbox-test-" + secrets.token_hex(4)
    code = f"""
import socket
attempts = {{}}
def attempt(what, action):
    try:
        attempts[what] = action()
    except OSError:
        attempts[what] = "blocked"
def listen():
    s = socket.socket(socket.AF_UNIX)
    s.bind({name!r})
    s.listen(1)
    s.settimeout(10)
    s.accept()                         # only reached if the refusals regress
    return "ACCEPTED"
attempt("listen", listen)
attempt("bind a socketpair end", lambda: socket.socketpair()[0].bind({name!r} + "2") or "BOUND")
print(attempts)
"""
    future = box.submit(code, timeout=15)
    reached = False
    while not future.done():              # the host tries to connect while the run lives
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(name)
            reached = True
        except OSError:
            time.sleep(0.01)
        finally:
            probe.close()
    r = future.result()
    assert eval(r.stdout) == {"listen": "blocked", "bind a socketpair end": "blocked"}, r
    assert not reached


def test_threads_per_run_are_bounded(box, caps):
    """Issue 15.5: at most MAX_TASKS tasks per run (a pids cgroup), whatever the memory."""
    needs(box, "tasks")
    code = ("import os, threading\nthreading.stack_size(1 << 18)\nevent, started = threading.Event(), 0\n"
            "try:\n    for _ in range(300):\n        threading.Thread(target=event.wait, daemon=True).start()\n"
            "        started += 1\nexcept RuntimeError:\n    pass\nevent.set()\n"
            "try:\n    open('/sys/fs/cgroup/pids/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "    escaped = 'ESCAPED'\nexcept OSError:\n    escaped = 'stayed'\nprint(started, escaped)")
    r, _ = attack(box, code, timeout=10, memory_mb=1024)
    started, escaped = r.stdout.split()
    assert 100 <= int(started) < 300 and escaped == "stayed", r
    assert int(started) == caps["tasks"]["max"] - 1          # the main thread is the other one


def test_user_code_does_not_inherit_our_future_imports(box):
    """Issue 15.6: sandbox_pool.py has `from __future__ import annotations`; user code must not."""
    r = box.run("x: int = 1\nprint(__annotations__)")
    assert r.stdout == "{'x': <class 'int'>}\n", r


# ----------------------------------------------------------------------------- grading, real shapes

def test_grading_stdin_by_livecodebench_rules(box):
    def grade(program, output, stdin="3\n"):
        return run_tests(program, {"fn_name": None, "cases": [{"input": stdin, "output": output}]},
                         timeout=5, sandbox=box)[0]
    assert grade("print(int(input()))", "3.0") and grade("print(0.50)", "0.5\n")
    assert grade("print(1, 2.0)", "1.00 2") and grade("print(' 3 ')\nprint()\n", "\n3\n\n")
    assert not grade("print(3)\nprint(4)", "3") and not grade("print('a 3')", "a 3.0")
    assert not grade("print(3.0001)", "3")
    assert grade("import sys\nprint(3)\nsys.exit(1)", "3") and grade("print(3)\nexit()", "3")
    assert not grade("print(3)\nraise ValueError", "3")
    prelude = "print(gcd(6, 9), deque([1]).pop(), List, bisect_left([1, 5], 3), isqrt(10), accumulate)"
    assert grade(prelude, "3 1 typing.List 1 3 <class 'itertools.accumulate'>")
    deep = "def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\nprint(f(30000))"
    assert grade(deep, "30000")                      # sys.setrecursionlimit(50000)
    main = "def main():\n    print(int(open(0).read()) * 2)\nif __name__ == '__main__':\n    main()"
    assert grade(main, "6")


FUNCTIONAL = {"fn_name": "twoSum", "cases": [{"input": "[2,7,11,15]\n9", "output": "[0, 1]"},
                                             {"input": "[3,2,4]\n6", "output": "[1, 2]"}]}


def test_grading_functional_by_livecodebench_rules(box):
    def grade(program, tests=FUNCTIONAL):
        return run_tests(program, tests, timeout=5, sandbox=box)
    method = ("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
              "        seen = {}\n        for i, n in enumerate(nums):\n            if target - n in seen:\n"
              "                return seen[target - n], i\n            seen[n] = i\n")
    assert grade(method) == [True, True]                         # a tuple is taken as a list
    assert grade(method + "if __name__ == '__main__':\n    input()\n") == [True, True]   # not __main__
    assert grade("def twoSum(nums, target):\n    return [0, 1]") == [True, False]        # no class
    assert grade("import numpy as np\ndef twoSum(nums, target):\n    return np.array([0, 1])") == [True, False]
    assert grade("def twoSum(nums, target):\n    return [(0, 1)]") == [False, False]     # nested: exact
    numbers = {"fn_name": "count", "cases": [{"input": "[1, 2, 3]", "output": "3"},
                                             {"input": "{\"a\": [1]}", "output": "{\"a\": [1]}"}]}
    numpy_int = "import numpy as np\ndef count(x):\n    return np.int64(3) if isinstance(x, list) else x"
    assert grade(numpy_int, numbers) == [True, True]
    assert grade("def count(x):\n    return '3' if isinstance(x, list) else {'a': (1,)}", numbers) == [False, False]


def test_grading_taco_call_based_wrapped_outputs(box):
    # TACO row {"fn_name": "total", "inputs": [[[40, 8]], [[20]]], "outputs": [[48], [20]]},
    # converted: one JSON argument per input line, outputs still wrapped.
    taco = {"fn_name": "total", "wrapped": True,
            "cases": [{"input": "[40, 8]", "output": "[48]"}, {"input": "[20]", "output": "[20]"}]}
    assert run_tests("def total(xs):\n    return sum(xs)", taco, timeout=5, sandbox=box) == [True, True]
    assert run_tests("def total(xs):\n    return [sum(xs)]", taco, timeout=5, sandbox=box) == [True, True]
    assert run_tests("def total(xs):\n    return 48", taco, timeout=5, sandbox=box) == [True, False]
    assert run_tests("def total(xs):\n    return sum(xs)", dict(taco, wrapped=False), timeout=5,
                     sandbox=box) == [False, False]


LEETCODE_ROW = {  # an assert-style row of Open-AgentRL-30K, as data/prepare.py converts it
    "fn_name": None, "cases": [], "entry_point": "Solution().twoSum",
    "import_prefix": "import random\nimport functools\nimport collections\nfrom typing import *\n"
                     "from collections import *\nfrom itertools import *\n",
    "test_code": "def check(candidate):\n    assert candidate(nums = [2,7,11,15], target = 9) == [0,1]\n\n"
                 "    assert candidate(nums = [3,2,4], target = 6) == [1,2]\n"
                 "    assert candidate(nums = [3,3], target = 6) == [0,1]\n"}


def test_grading_assert_style_rows(box, monkeypatch):
    correct = ("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
               "        seen = defaultdict(int)\n        for i, n in enumerate(nums):\n"
               "            if target - n in seen:\n                return [seen[target - n], i]\n"
               "            seen[n] = i\n")
    codes, submit = [], box.submit
    monkeypatch.setattr(box, "submit", lambda code, *a, **kw: codes.append(code) or submit(code, *a, **kw))
    assert run_tests(correct, LEETCODE_ROW, timeout=5, sandbox=box) == [True, True, True]
    # One run of the solution per check line, with the line's call and not its assertion: the
    # comparison with a literal is made here.
    assert len(codes) == 3 and "candidate(nums=[2, 7, 11, 15], target=9)" in codes[0]
    assert not any("assert" in code or "[0,1]" in code or "[1,2]" in code for code in codes)
    always = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]"
    assert run_tests(always, LEETCODE_ROW, timeout=5, sandbox=box) == [True, False, True]
    assert run_tests("class Solution:\n    def twoSum(self", LEETCODE_ROW, sandbox=box) == [False] * 3
    assert run_tests("", LEETCODE_ROW, sandbox=box) == [False] * 3


# ----------------------------------------------------------------------------- issue 24: holes 1-5

def test_inotify_and_dnotify_see_nothing_of_the_host(box, tmp_path):
    """Hole 1: an inotify watch on a host directory showed a run the names of the files the host
    created there while it lived (dnotify, fcntl F_NOTIFY, is the older way to the same)."""
    name = "host-made-" + secrets.token_hex(6)
    code = f"""
import ctypes, fcntl, os, select, signal
libc = ctypes.CDLL(None, use_errno=True)
seen, fd = [], libc.inotify_init1(os.O_NONBLOCK)
for path in ({str(tmp_path)!r}, "/tmp", "/etc", "/usr"):
    if fd >= 0 and libc.inotify_add_watch(fd, path.encode(), 0xfff) >= 0:
        seen.append("watching " + path)
    try:
        signal.signal(signal.SIGIO, lambda *a: seen.append("dnotify"))
        fcntl.fcntl(os.open(path, os.O_RDONLY), fcntl.F_NOTIFY, fcntl.DN_CREATE | fcntl.DN_MULTISHOT)
        seen.append("dnotify on " + path)
    except OSError:
        pass
if fd >= 0 and select.select([fd], [], [], 2)[0]:
    seen.append(os.read(fd, 4096))
print(fd, seen)
"""
    future = box.submit(code, timeout=5)
    time.sleep(0.7)
    (tmp_path / name).write_text("x")
    r = future.result()
    assert r.status == "ok" and name not in r.stdout and r.stdout == "-1 []\n", r


def test_per_user_kernel_quotas_stay_with_the_host(box):
    """Hole 2: runs share their uid's kernel quotas with the host: 128 inotify instances made the
    host's inotify_init1 fail with EMFILE, ~96k queued real-time signals its timer_create with EAGAIN."""
    code = """
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
instances = [fd for fd in (libc.inotify_init1(0) for _ in range(200)) if fd >= 0]
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
queued = 0
while queued < 200_000 and libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)) == 0:
    queued += 1
print(len(instances), queued, flush=True)
time.sleep(20)
"""
    future = box.submit(code, timeout=3)
    wait_for_a_run(box, asleep=True)
    try:
        timer = ctypes.c_void_p()
        inotify, timer_made = libc.inotify_init1(0), libc.timer_create(time.CLOCK_MONOTONIC, None, ctypes.byref(timer))
        assert inotify >= 0 and timer_made == 0, (inotify, timer_made, os.strerror(ctypes.get_errno()))
        os.close(inotify)
        libc.timer_delete(timer)
    finally:
        r = future.result()
    instances, queued = map(int, r.stdout.split())
    assert instances == 0 and queued <= sandbox_pool.MAX_SIGNALS, r


def test_locks_and_leases_do_not_hold_up_the_host(box):
    """Hole 3: a lease and a flock on a host file the run may read (its Python installation) held
    up the host's own open(path, "a") and locks until the run was killed."""
    import fcntl
    import sysconfig
    if not os.access(sysconfig.get_paths()["purelib"], os.W_OK):
        pytest.skip("needs a file of ours where runs may read: the Python installation is not writable here")
    path = os.path.join(sysconfig.get_paths()["purelib"], f"_sandbox_lock_test_{secrets.token_hex(4)}.txt")
    with open(path, "w") as f:
        f.write("x")
    code = f"""
import fcntl, os, struct, time
got = {{}}
def attempt(name, action):
    try:
        action()
        got[name] = "HELD"
    except OSError:
        got[name] = "refused"
record = struct.pack("hhqqi", fcntl.F_RDLCK, 0, 0, 0, 0)
attempt("lease", lambda: fcntl.fcntl(os.open({path!r}, os.O_RDONLY), fcntl.F_SETLEASE, fcntl.F_RDLCK))
attempt("flock", lambda: fcntl.flock(os.open({path!r}, os.O_RDONLY), fcntl.LOCK_SH))
attempt("posix lock", lambda: fcntl.fcntl(os.open({path!r}, os.O_RDONLY), fcntl.F_SETLK, record))
attempt("ofd lock", lambda: fcntl.fcntl(os.open({path!r}, os.O_RDONLY), 37, record))     # F_OFD_SETLK
print(got, flush=True)
time.sleep(20)
"""
    try:
        future = box.submit(code, timeout=3)
        wait_for_a_run(box, asleep=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)   # under a lease: EWOULDBLOCK
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)                  # POSIX and OFD locks
            os.close(fd)
        finally:
            r = future.result()
        assert set(eval(r.stdout).values()) == {"refused"}, r
    finally:
        os.unlink(path)


def test_a_run_cannot_choose_its_verdict(box):
    """Hole 4: "ok" came from exit status 0, which an excepthook, atexit or a thread could give a
    failed run; "memory" and "timeout" came from text on stderr and from a SIGXCPU a run can send
    itself. The pool now takes them from the epilogue's token and from kernel facts."""
    cases = [("import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n1 / 0", "error", 0),
             ("import atexit, os\natexit.register(os._exit, 0)\nraise ValueError", "error", 0),
             ("import os, threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()\n"
              "raise ValueError", "error", 0),
             ("import os\nos.write(3, b'0' * 17)\nos._exit(0)", "error", 0),    # a guessed epilogue
             ("import sys\nprint('MemoryError', file=sys.stderr)\nsys.exit(1)", "error", 1),
             ("import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)", "killed", -signal.SIGXCPU),
             ("import sys\nprint('x')\nsys.exit(0)", "ok", 0), ("raise MemoryError", "memory", 1),
             # code of the run's own after its failure: an exception's __str__, a SystemExit's code
             ("import os\nclass Crash(Exception):\n    def __str__(self):\n        os._exit(0)\nraise Crash",
              "error", 0),
             ("import os\nclass Leave(SystemExit):\n    @property\n    def code(self):\n        os._exit(0)\n"
              "raise Leave(3)", "error", 3)]
    results = box.run_many([code for code, _, _ in cases], timeout=5)
    assert [(r.status, r.returncode) for r in results] == [(s, rc) for _, s, rc in cases], results


WRONG = "class Solution:\n    def twoSum(self, nums, target):\n        return [9, 9]\n"
GRADER_HACKS = {
    "excepthook": "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n" + WRONG,
    "os._exit at import": "import os\nos._exit(0)\n" + WRONG,
    "sys.exit at import": "import sys\nsys.exit(0)\n" + WRONG,
    "sys.exit in the call": "import sys\nclass Solution:\n    def twoSum(self, nums, target):\n        sys.exit(0)\n",
    "atexit": "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG,
    "always-equal object": "class Same:\n    def __eq__(self, other):\n        return True\n"
                           "class Solution:\n    def twoSum(self, nums, target):\n        return Same()\n",
    "always-equal list": "class Same(list):\n    def __eq__(self, other):\n        return True\n"
                         "class Solution:\n    def twoSum(self, nums, target):\n        return Same([9])\n",
    "patched builtins": "import builtins\nbuiltins.sorted = lambda *a, **k: 0\n" + WRONG,
}


@pytest.mark.parametrize("hack", GRADER_HACKS)
def test_graders_cannot_be_talked_into_a_pass(box, hack):
    """Hole 4 in the graders: on assert-style rows a wrong solution with any of these passed every
    test (or should have failed anyway); the stdin and functional graders are checked likewise."""
    more = "    assert sorted(candidate([1, 2], 3)) == sorted([1, 0])\n"
    row = dict(LEETCODE_ROW, test_code=LEETCODE_ROW["test_code"] + more)
    assert run_tests(GRADER_HACKS[hack], row, timeout=5, sandbox=box) == [False] * 4
    stdin = GRADER_HACKS[hack].replace(WRONG, "print(3)\nraise ValueError\n")     # right output, then a crash
    assert run_tests(stdin, {"fn_name": None, "cases": [{"input": "", "output": "3"}]}, sandbox=box) == [False]
    assert run_tests(GRADER_HACKS[hack], FN_TESTS, timeout=5, sandbox=box) == [False] * 3


def test_grading_rebuilds_the_prefix_classes_by_value(box):
    """The plain values of the assert-style grader keep the rows that return the prefix's own
    classes (ListNode) gradable, and numpy scalars equal to Python ones."""
    row = {"fn_name": None, "cases": [], "entry_point": "Solution().reverse",
           "import_prefix": "class ListNode:\n    def __init__(self, val=0, next=None):\n"
                            "        self.val, self.next = val, next\n"
                            "def list_node(values):\n    head = None\n    for v in reversed(values):\n"
                            "        head = ListNode(v, head)\n    return head\n"
                            "def is_same_list(a, b):\n    while a and b and a.val == b.val:\n"
                            "        a, b = a.next, b.next\n"
                            "    return a is None and b is None\n",
           "test_code": "def check(candidate):\n"
                        "    assert is_same_list(candidate(list_node([1, 2, 3])), list_node([3, 2, 1]))\n"
                        "    assert candidate(None) is None\n"}
    right = ("import numpy as np\nclass Solution:\n    def reverse(self, head):\n        prev = None\n"
             "        while head:\n            head.next, prev, head = prev, head, head.next\n        return prev\n")
    assert run_tests(right, row, timeout=5, sandbox=box) == [True, True]
    fake = ("class Val(int):\n    def __eq__(self, other):\n        return True\nclass Solution:\n"
            "    def reverse(self, head):\n        return ListNode(Val(0)) if head else None\n")
    assert run_tests(fake, row, timeout=5, sandbox=box) == [False, True]
    helper = "def is_same_list(a, b):\n    return True\n" + fake         # the test's helper, redefined
    assert run_tests(helper, row, timeout=5, sandbox=box) == [False, True]
    numpy = dict(LEETCODE_ROW, entry_point="f", test_code="def check(candidate):\n    assert candidate() == 3\n")
    assert run_tests("import numpy as np\ndef f():\n    return np.int64(3)", numpy, sandbox=box) == [True]


def test_pool_recovers_from_start_up_deaths(monkeypatch):
    """Hole 5: three start-up deaths in one worker slot raised "workers keep dying at start-up"
    from every later run, for good. Now the slot backs off and tries again."""
    deaths, spawn = [3], Sandbox._spawn

    def dying_spawn(self, index):
        worker = spawn(self, index)
        if deaths[0] > 0:
            deaths[0] -= 1
            worker.proc.kill()                    # dies before it says hello
        return worker
    monkeypatch.setattr(Sandbox, "_spawn", dying_spawn)
    with Sandbox(workers=1, preimport=()) as pool:
        with pytest.raises(RuntimeError, match="keep dying at start-up"):
            pool.wait_ready(timeout=60)           # said at start-up, with the pool's own message
        assert pool.run("print('back')", timeout=10).stdout == "back\n"
        assert pool.wait_ready().startswith("sandbox: 1 workers; in force:")


def test_pool_recovers_when_a_zygote_takes_its_directory():
    """Hole 5: a zygote that left through its `finally` (here: a request it cannot parse) removed
    the pool's root directory when it was the last one there; every later run then failed."""
    with Sandbox(workers=1, preimport=()) as pool:
        assert pool.run("print(1)").stdout == "1\n"
        pool._workers[0].sock.send(b"not json")
        deadline = time.monotonic() + 10
        while os.path.exists(pool.root) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not os.path.exists(pool.root)
        assert pool.run("print(2)", timeout=10).stdout == "2\n"


@pytest.mark.parametrize("text", ["", "max\n", "-1\n", "50000 0\n"])
def test_a_cgroup_cpu_file_without_a_quota_leaves_the_affinity(monkeypatch, text):
    """An empty cgroup file (or a zero period) is no quota, as an unreadable or malformed one."""
    real_open = open
    monkeypatch.setattr(confine, "open", lambda path, *a: io.StringIO(text)
                        if path.startswith("/sys/fs/cgroup/") else real_open(path, *a), raising=False)
    assert confine.available_cores() == len(os.sched_getaffinity(0))


def test_default_pool_replaced_when_broken_configured_and_checked(monkeypatch):
    """Issue 23.4/23.5: the default pool is this rank's share of the cores, configure() sets its
    options before it starts, check() says what is in force or raises the pool's own message; a
    broken default pool is replaced instead of failing every later run."""
    monkeypatch.setattr(sandbox_pool, "available_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert sandbox.default_workers() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert sandbox.default_workers() == 1
    monkeypatch.setattr(sandbox, "_default", None)
    monkeypatch.setattr(sandbox, "_options", dict(sandbox._options))
    sandbox.configure(workers=1, require="floor")
    try:
        assert sandbox.check().startswith("sandbox: 1 workers; in force: seccomp")
        with pytest.raises(RuntimeError, match="already started"):
            sandbox.configure(workers=3)
        sandbox._default._fail("sandbox: broken on purpose")
        assert sandbox.run("print(5)").stdout == "5\n"          # a new default pool
        sandbox._default.close()
        monkeypatch.setattr(sandbox_pool, "_PROBE", "raise SystemExit('the probe says no')")
        with pytest.raises(RuntimeError, match="the probe says no"):
            sandbox.check()
    finally:
        if sandbox._default is not None:
            sandbox._default.close()


# ----------------------------------------------------------------------------- the floor alone

FLOOR_ATTACKS = {   # what each must print, run by a pool with no layer but the floor
    "fork": ("import os\ntry:\n    os.fork() or os._exit(0)\n    print('FORKED')\nexcept OSError:\n    print('ok')",
             "ok"),
    "exec": ("import os\ntry:\n    os.execv('/bin/true', ['true'])\nexcept OSError:\n    print('ok')", "ok"),
    "socket": ("import socket\ntry:\n    socket.socket()\n    print('SOCKET')\nexcept OSError:\n    print('ok')", "ok"),
    "kill init": ("import os\ntry:\n    os.kill(1, 0)\n    print('SIGNALLED')\nexcept OSError:\n    print('ok')", "ok"),
    "inotify": ("import ctypes\nprint('ok' if ctypes.CDLL(None).inotify_init1(0) < 0 else 'INOTIFY')", "ok"),
    "flock": ("import fcntl\ntry:\n    fcntl.flock(0, fcntl.LOCK_SH)\n    print('LOCKED')\nexcept OSError:\n"
              "    print('ok')", "ok"),
    "chmod and utime on a host file": (
        "import os, sys\nfor action in (lambda: os.chmod(sys.executable, 0o777), lambda: os.utime(sys.executable)):\n"
        "    try:\n        action()\n        print('CHANGED')\n    except OSError:\n        print('ok')", "ok\nok"),
    "queued signals": ("import ctypes, os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])\n"
                       "libc, n = ctypes.CDLL(None), 0\n"
                       "while n < 10_000 and libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)) == 0:\n"
                       "    n += 1\nprint('ok' if n <= 64 else n)", "ok"),
}


def test_the_floor_alone_keeps_its_guarantees(floor):
    results = floor.run_many([code for code, _ in FLOOR_ATTACKS.values()], timeout=5)
    for (name, (_, expected)), r in zip(FLOOR_ATTACKS.items(), results):
        assert (r.status, r.stdout) == ("ok", expected + "\n"), (name, r)
    assert_contained(floor)


def test_the_floor_sends_no_signal_through_an_owner(floor):
    """F_SETOWN (or ioctl FIOSETOWN) names a process to get SIGIO when a socket has data: a way
    to signal any process of the uid that the kill rules do not see (Landlock ABI 6 scopes it)."""
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = ("import fcntl, os, socket, struct\n"
                f"for set_owner in (lambda s: fcntl.fcntl(s, fcntl.F_SETOWN, {victim.pid}),"
                f"\n                  lambda s: fcntl.ioctl(s, 0x8901, struct.pack('i', {victim.pid}))):\n"
                "    a, b = socket.socketpair()\n    try:\n        set_owner(a)\n"
                "        fcntl.fcntl(a, fcntl.F_SETFL, os.O_ASYNC)\n        b.send(b'x')\n        print('OWNED')\n"
                "    except OSError:\n        print('refused')")
        r, _ = attack(floor, code, timeout=5, allowed={victim.pid})
        assert r.stdout == "refused\nrefused\n" and victim.poll() is None, r
    finally:
        victim.kill()
        victim.wait()


def test_the_floor_polls_disk_and_tasks(floor):
    """Without a tmpfs or a kernel task bound, the pool looks at each run every WATCH seconds and
    stops one that went over its disk quota (bytes or files) or MAX_TASKS."""
    fill = "for i in range(400):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\nimport time\ntime.sleep(10)"
    many = "for i in range(100_000):\n    open(f'e{i}', 'w').close()\nimport time\ntime.sleep(10)"
    threads = ("import threading, time\nthreading.stack_size(1 << 16)\nfor _ in range(2000):\n"
               "    threading.Thread(target=time.sleep, args=(10,), daemon=True).start()\ntime.sleep(10)")
    for code, over in ((fill, "MiB on disk"), (many, "files"), (threads, "tasks, over its 256")):
        r, elapsed = attack(floor, code, timeout=8, disk_mb=16)
        assert r.status == "killed" and over in r.stderr.splitlines()[-1] and r.seconds < 7, r
    first = floor.run("import os\nopen('note', 'w').write('x')\nos.mkdir('closed', 0)\nos.symlink('/etc', 'etc')")
    second = floor.run("import os\nprint(sorted(os.listdir('.')))")
    assert first.status == "ok" and second.stdout == "[]\n", (first, second)     # cleared between runs
    assert os.stat("/etc").st_mode & 0o777 == 0o755


# ----------------------------------------------------------------------------- reward hacks

def _token_hunt(then):
    """Code that looks for the old bootstrap's per-run token up its frames, forges the epilogue
    with it when found, then does `then`."""
    return ("import os, sys\nframe = sys._getframe()\n"
            "while frame is not None and 'token' not in frame.f_locals:\n    frame = frame.f_back\n"
            "if frame is not None:\n    os.write(3, frame.f_locals['token'] + b'0')\n" + then)


# Each made a wrong solution pass every assert-style test while the check line ran in the
# solution's own process (tests/test_sandbox.py's GRADER_HACKS have the older ones).
ASSERT_HACKS = {
    "the test line read from the harness's frames":
        "import sys\nclass Solution:\n    def twoSum(self, nums, target):\n"
        "        frame = sys._getframe(1)\n        while frame is not None:\n"
        "            for value in list(frame.f_locals.values()):\n"
        "                if isinstance(value, str) and value.startswith('def check('):\n"
        "                    return eval(value.rsplit('==', 1)[1])\n"
        "            frame = frame.f_back\n        return [9, 9]\n",
    "the harness's own helper replaced": "import __main__\n"
        "class Same(list):\n    def __eq__(self, other):\n        return True\n"
        "__main__._plain = lambda value, classes, seen: value\n"
        "class Solution:\n    def twoSum(self, nums, target):\n        return Same([9])\n",
    "builtins.type patched": "import builtins\nreal = builtins.type\n"
        "class Same(list):\n    def __eq__(self, other):\n        return True\n"
        "class Fake(type):\n    def __new__(cls, *args):\n"
        "        return (int if real(args[0]) is Same else real(args[0])) if len(args) == 1 else real(*args)\n"
        "builtins.type = Fake\n"
        "class Solution:\n    def twoSum(self, nums, target):\n        return Same([9])\n",
    "the epilogue forged": _token_hunt("os._exit(0)\n"),
}


@pytest.mark.parametrize("hack", ASSERT_HACKS)
def test_the_assertion_is_out_of_the_solutions_reach(box, hack):
    """A wrong solution that reads the test line, replaces the harness's helper, patches a builtin
    the harness uses or forges the run's epilogue no longer passes: its run holds no assertion,
    only the line's calls, and its values are compared where it never ran."""
    more = "    assert sorted(candidate([1, 2], 3)) == sorted([1, 0])\n"
    row = dict(LEETCODE_ROW, test_code=LEETCODE_ROW["test_code"] + more)
    assert run_tests(ASSERT_HACKS[hack], row, timeout=5, sandbox=box) == [False] * 4


# A stdin program that prints the right answer, then crashes in a way that exits 0.
CRASHES = {
    "forged epilogue, fd 3 closed, excepthook": _token_hunt(
        "try:\n    os.close(3)\nexcept OSError:\n    pass\nsys.excepthook = lambda *a: os._exit(0)\n"
        "raise ValueError('crash')\n"),
    "atexit after the crash": "import atexit, os\natexit.register(os._exit, 0)\nraise ValueError('crash')\n",
    "a thread after the crash": "import os, threading, time\n"
                                "threading.Thread(target=lambda: (time.sleep(0.3), os._exit(0))).start()\n"
                                "raise ValueError('crash')\n",
    "the exception's __str__": "import os\nclass Crash(Exception):\n    def __str__(self):\n"
                               "        os._exit(0)\nraise Crash()\n",
    "fd 3 replaced": "import os\ntry:\n    os.dup2(os.open('/dev/null', os.O_WRONLY), 3)\nexcept OSError:\n"
                     "    pass\nimport sys\nsys.excepthook = lambda *a: os._exit(0)\nraise ValueError\n",
    "a signal": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n",
}


@pytest.mark.parametrize("crash", CRASHES)
def test_the_right_answer_then_a_crash_fails(box, crash):
    """The verdict comes from the exit status the kernel reports and a failure byte the run's
    bootstrap writes before any code of the run's own runs again, on a descriptor the run cannot
    close or replace; no token the run could read from its memory."""
    program = "print(3, flush=True)\n" + CRASHES[crash]
    tests = {"fn_name": None, "cases": [{"input": "", "output": "3"}]}
    assert run_tests(program, tests, timeout=5, sandbox=box) == [False]
    assert run_tests("print(3)", tests, timeout=5, sandbox=box) == [True]


def test_an_exit_with_status_0_is_a_success(box):
    """What the kernel reports decides: a program that prints its answer and leaves with exit
    status 0 (os._exit(0)) succeeded, as it would for any other runner; a guessed or forged
    "ok" on fd 3 only makes a run fail."""
    tests = {"fn_name": None, "cases": [{"input": "", "output": "3"}]}
    assert run_tests("import os\nprint(3, flush=True)\nos._exit(0)", tests, timeout=5, sandbox=box) == [True]
    r = box.run("import os\nprint(3, flush=True)\nos.write(3, b'0' * 17)\nos._exit(0)")
    assert (r.status, r.returncode, r.stdout) == ("error", 0, "3\n"), r


# ----------------------------------------------------------------------------- a run is another user

@pytest.fixture(scope="module")
def another_user():
    """A pool whose runs have a uid of their own and no layer beyond the floor but that (no
    Landlock, mount namespace or pids cgroup), as root on a kernel without Landlock or in Docker
    under a runtime that refuses it; the owner's environment holds credentials."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "MY_SECRET"):
            patch.setenv(name, SECRET)
        patch.setattr(sandbox_pool, "grants", granted(**NO_LANDLOCK, **NO_MOUNT, **NO_CGROUP))
        pool = Sandbox(workers=1, preimport=(), require="uid")
        pool.wait_ready()
    if "uid" in pool.off:
        pool.close()
        pytest.skip(f"no uid of its own for a run here: {pool.off['uid']}")
    pool.baseline = set(descendants(os.getpid()))
    POOLS.append(pool)
    yield pool
    pool.close()


def test_a_run_is_another_user(another_user, tmp_path):
    """Where the pool can (root, CAP_SETUID), a run has a uid of its own, never 0: nothing of the
    owner's that only its uid may read or write, no way into its /proc/<pid> (not even its command
    line, where the worker may mount a /proc of the runs' own processes), no kernel knob
    (/proc/sys) or cgroup file root owns, no inode flags on host files."""
    public = tempfile.mkdtemp()                      # a directory others may enter
    os.chmod(public, 0o755)
    secret, host = os.path.join(public, "token"), os.path.join(public, "host.txt")
    for path, mode in ((secret, 0o600), (host, 0o644)):
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, mode), "w") as f:
            f.write(SECRET)
    purelib = sysconfig.get_paths()["purelib"]
    code = f"""
import ctypes, fcntl, os, struct
libc = ctypes.CDLL(None, use_errno=True)
owner = {os.getpid()}
attempts = {{}}
def attempt(name, action):
    try:
        action()
        attempts[name] = "DONE"
    except OSError:
        attempts[name] = "blocked"
def same_value(path):
    value = open(path).read()
    open(path, "w").write(value)
def set_flags(path):
    fd = os.open(path, os.O_RDONLY)
    fcntl.ioctl(fd, 0x40086602, struct.pack("l", 0x40))      # FS_IOC_SETFLAGS: nodump
def visible(pid):
    if str(pid) not in os.listdir("/proc"):
        raise FileNotFoundError(pid)
attempt("read a 0600 file", lambda: open({secret!r}).read())
attempt("see the owner in /proc", lambda: visible(owner))
attempt("owner's command line", lambda: open(f"/proc/{{owner}}/cmdline", "rb").read())
attempt("owner's environ", lambda: open(f"/proc/{{owner}}/environ", "rb").read())
attempt("owner's memory", lambda: open(f"/proc/{{owner}}/mem", "rb"))
attempt("owner's oom score", lambda: open(f"/proc/{{owner}}/oom_score_adj", "w").write("1000"))
attempt("lower its own oom score", lambda: open("/proc/self/oom_score_adj", "w").write("0"))
def writable(path):                  # asked, not tried: nothing is left in the installation
    if not os.access(path, os.W_OK):
        raise PermissionError(path)
attempt("write site-packages", lambda: writable({purelib!r}))
attempt("write the project", lambda: writable({PROJECT!r}))
attempt("write out_dir", lambda: open(os.path.join({public!r}, "metrics.jsonl"), "a"))
attempt("write /proc/sys", lambda: same_value("/proc/sys/kernel/core_pattern"))
attempt("leave its cgroup", lambda: open("/sys/fs/cgroup/pids/cgroup.procs", "w").write(str(os.getpid())))
attempt("chattr a host file", lambda: set_flags({host!r}))
print(attempts)
print([os.getuid(), os.getgid(), os.getgroups(), libc.prctl(4, 1, 0, 0, 0)])
"""
    try:
        r, _ = attack(another_user, code, timeout=5)
    finally:
        shutil.rmtree(public)
    attempts = eval(r.stdout.splitlines()[0])
    assert attempts and [k for k, v in attempts.items() if v != "blocked"] == [], attempts
    uid, gid, groups, dumpable = eval(r.stdout.splitlines()[1])
    assert uid == gid == getattr(another_user, "uids", [None])[0] >= 1 << 30, r.stdout
    assert groups == [] and dumpable == -1, r.stdout                # PR_SET_DUMPABLE refused


def test_a_runs_oom_score_is_the_highest_and_out_of_its_reach(another_user, box):
    """Each run is the OOM killer's first choice (oom_score_adj 1000, set before it drops its
    privileges), and cannot lower it."""
    for pool in (another_user, box):
        future = pool.submit("import time\ntime.sleep(30)", timeout=30)
        wait_for_a_run(pool, asleep=True)
        runs = [child for pid in pool.worker_pids() for child in descendants(pid)]
        scores = {open(f"/proc/{pid}/oom_score_adj").read().strip() for pid in runs}
        for pid in pool.worker_pids():
            for child in descendants(pid):
                os.kill(child, signal.SIGKILL)
        future.result()
        assert scores == {"1000"}, scores


def test_the_owner_is_not_dumpable_and_runs_get_no_credentials(another_user):
    """The pool's owner makes itself not dumpable (its /proc files are root's, no process of its
    uid reads its memory or environ), and a run's environment is a fixed list: no token, key or
    secret of the owner's."""
    assert libc.prctl(3, 0, 0, 0, 0) == 0                            # PR_GET_DUMPABLE
    r = another_user.run("import os\nprint(sorted(os.environ))")
    names = eval(r.stdout)
    assert not [n for n in names if "TOKEN" in n or "KEY" in n or "SECRET" in n or n.startswith("AWS")], names
    assert SECRET not in r.stdout
    for pid in another_user.worker_pids():
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert SECRET.encode() not in f.read()


def test_workers_start_without_site(box):
    """Workers run `python -I -S`: no .pth file of any site-packages directory runs in them; the
    installation's site-packages are on sys.path all the same, and exit() and quit() are there."""
    r = box.run("import sys, numpy\nprint(sys.flags.no_site, sys.flags.isolated)\nexit(0)")
    assert (r.status, r.stdout) == ("ok", "1 1\n"), r
    for pid in box.worker_pids():
        assert b"\0-S\0" in open(f"/proc/{pid}/cmdline", "rb").read()


def test_without_a_uid_of_its_own_or_landlock_the_default_refuses(monkeypatch):
    """A plain non-root user with no layer: the default refuses to start, in one line saying what
    is missing and what require="floor" gives up; require="floor" starts."""
    monkeypatch.setattr(sandbox_pool, "grants", granted(**NO_UID, **NO_LANDLOCK))
    with pytest.raises(RuntimeError) as refusal:
        Sandbox(workers=1, preimport=())
    line = str(refusal.value)
    assert "\n" not in line and "no uid of its own [setresuid: EPERM (simulated)]" in line
    assert "no Landlock [landlock_create_ruleset: EPERM (simulated)]" in line
    assert "--sandbox_require=floor starts anyway and gives that up" in line
    with Sandbox(workers=1, preimport=(), require="floor") as pool:
        assert pool.run("print(1)").stdout == "1\n"


# ----------------------------------------------------------------------------- disk, cleanup, time, tasks

def test_disk_the_kernel_does_not_count_is_refused_or_watched(floor):
    """Without a tmpfs: O_TMPFILE and fallocate (whose blocks no file size counts) are refused, and
    files the run unlinked while it holds them open count against its disk quota."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nout = []\n"
            "try:\n    os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o600)\n    out.append('TMPFILE')\n"
            "except OSError as exc:\n    out.append(exc.errno)\n"
            "fd = os.open('f', os.O_CREAT | os.O_WRONLY)\n"
            "out.append(libc.fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(256 << 20)) or 'FALLOCATED')\n"
            "print(out, ctypes.get_errno(), flush=True)\n")
    r, _ = attack(floor, code, timeout=5, disk_mb=16)
    assert r.stdout == f"[{errno.EOPNOTSUPP}, -1] {errno.EOPNOTSUPP}\n", r
    hidden = ("import os, time\nkept = []\nfor i in range(6):\n    fd = os.open(f'u{i}', os.O_CREAT | os.O_RDWR)\n"
              "    os.unlink(f'u{i}')\n    os.write(fd, b'x' * (15 << 20))\n    kept.append(fd)\n"
              "print('written', flush=True)\ntime.sleep(10)")
    r, _ = attack(floor, hidden, timeout=8, disk_mb=16)
    assert r.status == "killed" and "MiB on disk, over" in r.stderr, r


def test_a_uid_of_its_own_without_landlock_is_not_enough_by_default(another_user, monkeypatch):
    """Issue 38.5: a run with a uid of its own but no Landlock read the project's data/ (0644, with
    the answers) and what it left in /tmp, /dev/shm or /run/lock passed to the next run of its uid.
    The default now refuses there, in one line saying why; require="uid" starts, giving that up."""
    data = os.path.join(PROJECT, "data")
    r = another_user.run(f"import os\nprint(sorted(os.listdir({data!r}))[:1])")
    assert r.status == "ok" and r.stdout != "[]\n", r                  # what require="uid" gives up
    monkeypatch.setattr(sandbox_pool, "grants", granted(**NO_LANDLOCK, **NO_MOUNT, **NO_CGROUP))
    with pytest.raises(RuntimeError) as refusal:
        Sandbox(workers=1, preimport=())
    line = str(refusal.value)
    assert "\n" not in line and "have a uid of its own but no Landlock [" in line, line
    assert "data/ with its answers" in line and "/run/lock" in line and "--sandbox_require=floor" in line


def test_two_live_pools_never_share_a_runs_uid(monkeypatch):
    """Issue 38.5: a run's uid was its slot modulo 256 in a block of the owner's, so a process's
    257th slot (a replaced default pool, a second pool) shared a uid with a live pool's runs,
    which could then read and remove each other's files."""
    assert len({confine.run_uid(slot) for slot in range(2048)}) == 2048
    monkeypatch.setattr(sandbox_pool, "_slots", itertools.count(0))
    first = Sandbox(workers=1, preimport=())
    monkeypatch.setattr(sandbox_pool, "_slots", itertools.count(256))      # 255 slots later
    second = Sandbox(workers=1, preimport=())
    try:
        assert None not in first.uids + second.uids and first.uids != second.uids
    finally:
        first.close()
        second.close()


def test_a_deep_directory_is_cleaned_up(floor):
    """A directory chain deeper than Python's recursion limit made the zygote's cleanup raise
    RecursionError: the run was reported killed, the pool failed every later job and close()
    raised. The cleanup walks without recursion now."""
    workers = sorted(floor.worker_pids())
    code = "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')"
    r = floor.run(code, timeout=10)
    assert (r.status, r.stdout) == ("ok", "deep\n"), r
    assert sorted(floor.worker_pids()) == workers
    assert floor.run("import os\nprint(os.listdir('.'))").stdout == "[]\n"
    with Sandbox(workers=1, preimport=(), require="floor") as pool:    # and close() with a chain left
        assert pool.run(code, timeout=10).stdout == "deep\n"
        fd = os.open(pool.root, os.O_RDONLY)
        for _ in range(1200):
            os.mkdir("x", dir_fd=fd)
            fd, parent = os.open("x", os.O_RDONLY, dir_fd=fd), fd
            os.close(parent)
        os.close(fd)
        root = pool.root
    assert not os.path.exists(root)


def test_a_siblings_contention_does_not_make_a_timeout(box):
    """Two runs on one CPU (as when a sibling's threads or the host take the cores): the one that
    needs 0.7 s of CPU within a 1 s timeout gets it, because the time it waited for the CPU does
    not count against it (up to a backstop of the wall clock)."""
    wait_ready(box)
    every = os.sched_getaffinity(0)
    for pid in box.worker_pids():
        os.sched_setaffinity(pid, {min(every)})
    try:
        hog = "import time\nt = time.time()\nwhile time.time() - t < 1.5:\n    pass\nprint('hog')"
        work = "import time\nwhile time.process_time() < 0.7:\n    pass\nprint('done')"
        hogged, done = box.run_many([hog, work], timeout=1.0)
    finally:
        for pid in box.worker_pids():
            os.sched_setaffinity(pid, every)
    assert (done.status, done.stdout) == ("ok", "done\n") and done.seconds > 1.0, done
    alone = box.run("import time\ntime.sleep(5)", timeout=1.0)      # waiting on nothing: on time
    assert alone.status == "timeout" and alone.seconds < 2, alone


def test_a_thread_storm_meets_the_bound_of_the_runs_uid(another_user):
    """With no pids cgroup, RLIMIT_NPROC of the run's own uid bounds its tasks in the kernel: no
    thread storm gets past MAX_TASKS between two looks."""
    code = ("import threading\nthreading.stack_size(1 << 16)\nevent, started = threading.Event(), 0\n"
            "try:\n    for _ in range(2000):\n        threading.Thread(target=event.wait, daemon=True).start()\n"
            "        started += 1\nexcept RuntimeError:\n    pass\nevent.set()\nprint(started)")
    r, _ = attack(another_user, code, timeout=10)
    assert r.status == "ok" and int(r.stdout) == sandbox_pool.MAX_TASKS - 1, r


# ----------------------------------------------------------------------------- issue 38

# Code a run leaves behind that exits 0 as soon as it finds itself running in the bootstrap (a
# frame not of the run's own code "<string>"): each made a failed run "ok" before the failure was
# reported, from the bootstrap's own calls, allocations or checks for signals and other threads.
LEFT_BEHIND = {
    "a profile hook": "import os, sys\nsys.setprofile(lambda f, e, a: f.f_code.co_filename != '<string>' "
                      "and os._exit(0))\n",
    "a trace hook on the bootstrap's frame": "import os, sys\nsys.settrace(lambda f, e, a: None)\n"
                                             "sys._getframe(1).f_trace = lambda f, e, a: os._exit(0)\n",
    "a gc callback": "import gc, os, sys\ngc.set_threshold(1)\n"
                     "gc.callbacks.append(lambda p, i: sys._getframe(1).f_code.co_filename != '<string>' "
                     "and os._exit(0))\n",
    "a signal handler": "import os, signal\nsignal.signal(signal.SIGALRM, lambda s, f: "
                        "f.f_code.co_filename != '<string>' and os._exit(0))\n"
                        "signal.setitimer(signal.ITIMER_REAL, 1e-5, 1e-5)\n",
    "a thread": "import os, sys, threading\nsys.setswitchinterval(1e-6)\nmain, go = threading.main_thread().ident, []\n"
                "def spin():\n    while not go:\n        pass\n    while True:\n"
                "        if sys._current_frames()[main].f_code.co_filename != '<string>':\n            os._exit(0)\n"
                "threading.Thread(target=spin, daemon=True).start()\ngo.append(1)\n",
    "the exit's finalizer": "import os\nclass Leave(SystemExit):\n    def __del__(self):\n        os._exit(0)\n",
}


@pytest.mark.parametrize("hook", LEFT_BEHIND)
def test_code_left_behind_runs_only_once_the_failure_is_reported(box, hook):
    """Issue 38.3: the bootstrap's first act after a failure reaches it is to report it on fd 3,
    in C, where nothing of the run's own (a hook, a finalizer, a signal handler, a thread) can run
    before; so a crash or an exit with status 3 is never "ok", whatever exits 0 after it."""
    endings = ["raise ValueError('crash')\n", "raise Leave(3)\n" if "Leave" in LEFT_BEHIND[hook]
               else "raise SystemExit(3)\n"]
    tries = 10 if hook == "a thread" else 3                 # a race on the old code: 5-15% a run
    results = box.run_many([LEFT_BEHIND[hook] + ending for ending in endings for _ in range(tries)], timeout=10)
    assert [r.status for r in results] == ["error"] * 2 * tries, results
    honest = box.run_many([LEFT_BEHIND[hook] + "print('fine')\n", LEFT_BEHIND[hook] + "raise SystemExit(0)\n"],
                          timeout=10)
    assert [r.status for r in honest] == ["ok", "ok"], honest


def test_the_failure_report_cannot_be_read_back_through_proc(floor):
    """Issue 38.3: where a run keeps the pool owner's uid, fd 3 (a pipe then) could be opened again
    through /proc/self/fd/3, and a thread blocked reading it took the failure byte before the pool
    (busy with a flood of output) did: an atexit handler then exited 0, "ok". fd 3 is a socket now,
    which no open() reaches, and the run may not shut it down."""
    code = ("import atexit, ctypes, os, socket, threading\ntry:\n    back = os.open('/proc/self/fd/3', os.O_RDONLY)\n"
            "except OSError:\n    back = None\nelse:\n    buf = ctypes.create_string_buffer(64)\n"
            "    threading.Thread(target=ctypes.CDLL(None).read, args=(back, buf, 64), daemon=True).start()\n"
            "try:\n    socket.socket(fileno=3).shutdown(socket.SHUT_WR)\nexcept OSError:\n    pass\n"
            "atexit.register(os._exit, 0)\nprint('reopened' if back is not None else 'refused', flush=True)\n"
            "threading.Thread(target=lambda: [os.write(1, b'x' * 65536) for _ in range(200)], daemon=True).start()\n"
            "raise ValueError('crash')\n")
    results = floor.run_many([code] * 6, timeout=10)
    assert [(r.status, r.stdout[:8]) for r in results] == [("error", "refused\n")] * 6, results


def test_a_run_cannot_buy_itself_time(box, floor):
    """Issue 38.4: the deadline moved by the time a run's threads waited for a CPU, its own threads
    included: 17 threads hashing (without the GIL) on one core, then a sleep, held a 0.2 s run's
    worker to the backstop (3 x 0.2 + 1 s). Now only the main thread's wait counts, while the run used less CPU
    than its timeout, and the backstop is 3 x the timeout."""
    code = ("import hashlib, os, threading, time\ngo, core = threading.Event(), {min(os.sched_getaffinity(0))}\n"
            "def spin():\n    go.wait()\n    os.sched_setaffinity(0, core)\n    while time.process_time() < 1.5:\n"
            "        hashlib.sha256(b'x' * (1 << 20)).digest()       # without the GIL: all on the core\n"
            "for _ in range(16):\n    threading.Thread(target=spin, daemon=True).start()\n"
            "go.set()\nspin()\ntime.sleep(60)")
    for pool in (box, floor):         # the floor: no pids cgroup, no uid or mount namespace
        r, _ = attack(pool, code, timeout=0.2)
        assert r.status == "timeout" and r.seconds < 0.8, r


def test_disk_out_of_the_workers_sight_is_counted(floor, tmp_path):
    """Issue 38.4: without a mount namespace the worker counts the run's directory now and then,
    and a run hid disk from it: 90 MiB in files unlinked but still mapped, 90 MiB hard-linked out
    of its directory, 60 MiB written before the next look by a run that then ended "ok". Now
    removing does nothing (what it wrote goes with the run), hard links and renames are refused,
    and the worker counts once more when the run ends."""
    os.chmod(tmp_path, 0o777)
    mapped = ("import mmap, os, time\nkept = []\nfor i in range(6):\n"
              "    fd = os.open(f'm{i}', os.O_CREAT | os.O_RDWR)\n"
              "    os.ftruncate(fd, 15 << 20)\n    kept.append(mmap.mmap(fd, 15 << 20))\n    os.close(fd)\n"
              "    os.unlink(f'm{i}')\n    kept[-1].write(b'x' * (15 << 20))\n"
              "print('hidden', flush=True)\ntime.sleep(10)")
    linked = (f"import os, time\nfor i in range(6):\n    open(f'f{{i}}', 'wb').write(b'x' * (15 << 20))\n    try:\n"
              f"        os.link(f'f{{i}}', f'{tmp_path}/l{{i}}')\n        os.rename(f'f{{i}}', f'{tmp_path}/r{{i}}')\n"
              f"    except OSError:\n        print('refused', flush=True)\n        break\n"
              f"    os.unlink(f'f{{i}}')\ntime.sleep(10)")
    burst = "for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * (15 << 20))\nprint('written')"
    for code in (mapped, linked, burst):
        r, _ = attack(floor, code, timeout=8, disk_mb=16)
        outside = sum(os.path.getsize(p) for p in tmp_path.iterdir())
        assert outside == 0 and r.stdout != "hidden\n" or r.status == "killed", (r, outside)
        assert r.status == "killed" and "MiB on disk, over" in r.stderr or r.stdout == "refused\n", r
    removed = floor.run("import os, tempfile\nwith tempfile.TemporaryDirectory() as d:\n"
                        "    open(os.path.join(d, 'x'), 'w').write('x')\nos.remove('gone') if os.path.exists('gone') "
                        "else open('gone', 'w').close()\nos.remove('gone')\nprint(os.path.exists('gone'))")
    assert (removed.status, removed.stdout) == ("ok", "True\n"), removed


def negative_dentries():
    with open("/proc/sys/fs/dentry-state") as f:
        return int(f.read().split()[4])


def test_names_a_run_looked_up_go_with_it(floor):
    """Issue 38.4: every name a run looks up and does not find leaves a negative dentry, kernel
    memory outside its limits; 300,000 of them in its directory stayed after it. A directory of
    its own per run, removed after it, takes them along (a tmpfs per run does, with a mount
    namespace)."""
    code = "import os\nfor i in range(300_000):\n    os.path.exists(f'missing{i}')\nprint('looked')"
    before = negative_dentries()
    r = floor.run(code, timeout=30)
    left = negative_dentries() - before
    assert r.stdout == "looked\n" and left < 100_000, (r, left)
