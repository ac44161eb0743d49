"""machinery/sandbox_linux.py: the Linux calls a run locks itself down with, via ctypes (seccomp
BPF, Landlock, mount and user namespaces, uids, capabilities, pids cgroups); detect(): which
optional layers this machine grants, and who refused the others."""
import contextlib
import ctypes
import errno
import fcntl
import json
import math
import os
import platform
import resource
import socket
import stat
import struct
import sys
import sysconfig
import tempfile

MAX_FILES = 4096                   # inodes in a run's tmpfs, files in its polled working directory
EPILOGUE_FD = 3                    # a run's socket for how it failed; closing, replacing it refused

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
ARCH = platform.machine()
# unistd.h numbers: name, x86_64, aarch64 ("-": none). EPERM for each, but those with a rule.
_TABLE = """fork 57 - vfork 58 - clone 56 220 clone3 435 435 execve 59 221 execveat 322 281
kill 62 129 tkill 200 130 tgkill 234 131 rt_sigqueueinfo 129 138 rt_tgsigqueueinfo 297 240
socket 41 198 socketpair 53 199 shutdown 48 210 connect 42 203 bind 49 200 listen 50 201
ptrace 101 117 process_vm_readv 310 270 process_vm_writev 311 271 mount 165 40 umount2 166 39
unshare 272 97 setns 308 268 bpf 321 280 pivot_root 155 41 chroot 161 51 kexec_load 246 104
kexec_file_load 320 294 init_module 175 105 finit_module 313 273 delete_module 176 106
perf_event_open 298 241 userfaultfd 323 282 keyctl 250 219 add_key 248 217 request_key 249 218
open_tree 428 428 move_mount 429 429 fsopen 430 430 fsconfig 431 431 fsmount 432 432 fspick 433 433
mount_setattr 442 442 pidfd_open 434 434 pidfd_send_signal 424 424 pidfd_getfd 438 438 kcmp 312 272
name_to_handle_at 303 264 open_by_handle_at 304 265 memfd_create 319 279 memfd_secret 447 447
swapon 167 224 swapoff 168 225 reboot 169 142 sethostname 170 161 setdomainname 171 162 iopl 172 -
ioperm 173 - acct 163 89 quotactl 179 60 quotactl_fd 443 443 syslog 103 116 lookup_dcookie 212 18
vhangup 153 58 uselib 134 - settimeofday 164 170 clock_settime 227 112 clock_adjtime 305 266
adjtimex 159 171 migrate_pages 256 238 move_pages 279 239 process_madvise 440 440
process_mrelease 448 448 io_uring_setup 425 425 io_uring_enter 426 426 io_uring_register 427 427
prlimit64 302 261 setpriority 141 140 ioprio_set 251 30 sched_setaffinity 203 122
sched_setscheduler 144 119 sched_setparam 142 118 sched_setattr 314 274 nfsservctl 180 42
fanotify_init 300 262 prctl 157 167 seccomp 317 277 shmget 29 194 shmat 30 196 shmctl 31 195
shmdt 67 197 semget 64 190 semop 65 193 semctl 66 191 semtimedop 220 192 msgget 68 186 msgsnd 69 189
msgrcv 70 188 msgctl 71 187 mq_open 240 180 mq_unlink 241 181 mq_timedsend 242 182
mq_timedreceive 243 183 mq_notify 244 184 mq_getsetattr 245 185 inotify_init 253 -
inotify_init1 294 26 inotify_add_watch 254 27 flock 73 32 fcntl 72 25 ioctl 16 29 close 3 57
dup2 33 - dup3 292 24 close_range 436 436 open 2 - openat 257 56 openat2 437 437 fallocate 285 47
chmod 90 - fchmod 91 52 fchmodat 268 53 fchmodat2 452 452 chown 92 - fchown 93 55 lchown 94 -
fchownat 260 54 utime 132 - utimes 235 - futimesat 261 - utimensat 280 88 setxattr 188 5
lsetxattr 189 6 fsetxattr 190 7 removexattr 197 14 lremovexattr 198 15 fremovexattr 199 16
setxattrat 463 463 removexattrat 466 466 truncate 76 45 unlink 87 - unlinkat 263 35 rmdir 84 -
link 86 - linkat 265 37 rename 82 - renameat 264 38 renameat2 316 276""".split()
_SYSCALLS = {arch: {name: int(nr) for name, nr in zip(_TABLE[::3], _TABLE[column::3])
                    if nr != "-"} for column, arch in ((1, "x86_64"), (2, "aarch64"))}
# Refused without a mount namespace: host file metadata, uncounted disk (docs/SANDBOX.md, layer 8).
_NEED_MOUNT = set("""chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat utime utimes
futimesat utimensat setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr
setxattrat removexattrat truncate open openat openat2 fallocate unlink unlinkat rmdir link linkat
rename renameat renameat2""".split())
_O_TMPFILE = 0o20000000            # __O_TMPFILE on x86_64 and aarch64
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NR_LANDLOCK_CREATE, _NR_LANDLOCK_ADD_RULE, _NR_LANDLOCK_RESTRICT = 444, 445, 446
_LD, _JEQ, _JGE, _AND, _RET = 0x20, 0x15, 0x35, 0x54, 0x06   # linux/filter.h, linux/seccomp.h
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_CLONE_THREAD, _CLONE_NEW = 0x00010000, 0x7E020080   # NEW{NS,CGROUP,UTS,IPC,USER,PID,NET,TIME}
_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_OWN, _GROUP = "own", "group"      # the run's pid and -pid, filled in by each child
# fcntl: locks, leases, F_NOTIFY, F_SETOWN/F_SETSIG, F_SETPIPE_SZ (docs/SANDBOX.md, layer 8).
_FCNTL_REFUSED = (6, 7, 8, 10, 15, 37, 38, 1024, 1026, 1031)
# FIOSETOWN, SIOCSPGRP (as F_SETOWN); FS_IOC_SETFLAGS (64-, 32-bit), FS_IOC_FSSETXATTR (chattr).
_IOCTL_REFUSED = (0x8901, 0x8902, 0x40086602, 0x40046602, 0x401C5820)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_SECCOMP = 1, 4, 24, 22
_PR_SET_SECUREBITS, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 28, 36, 38, 47
_CAP_SETUID, _CAP_SETPCAP, _CAP_SYS_ADMIN = 7, 8, 21
_LL_EXECUTE, _LL_WRITE, _LL_READ, _LL_READ_DIR, _LL_MAKE_CHAR = 1, 2, 4, 8, 64
_LL_MAKE_BLOCK, _LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 2048, 8192, 16384, 32768   # ABI 2, 3, 5


def _check(ret: int, what: str) -> int:
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {errno.errorcode.get(err, err)}")
    return ret


def _syscall(number: int, *args, what: str = "syscall") -> int:
    """A raw system call: buffers go as pointers, the rest as longs."""
    args = [a if isinstance(a, ctypes.Array) else ctypes.c_long(a) for a in args]
    return _check(_libc.syscall(ctypes.c_long(number), *args), what)


def prctl(option: int, a2: int = 0, a3: int = 0) -> int:
    return _check(_libc.prctl(*map(ctypes.c_ulong, (option, a2, a3, 0, 0))), f"prctl({option})")


def seccomp_filter(no_mount: bool) -> list:
    """(code, jt, jf, k) tuples, k maybe _OWN or _GROUP; `no_mount`: refuse _NEED_MOUNT too."""
    deny, allow = (_RET, 0, 0, _ERRNO | errno.EPERM), (_RET, 0, 0, _ALLOW)
    unsupported = (_RET, 0, 0, _ERRNO | errno.EOPNOTSUPP)
    prog = [(_LD, 0, 0, 4), (_JEQ, 1, 0, _AUDIT_ARCH[ARCH]), (_RET, 0, 0, _KILL_PROCESS),
            (_LD, 0, 0, 0)]
    if ARCH == "x86_64":       # x32 ABI numbers have bit 30 set: refuse them all
        prog += [(_JGE, 0, 1, 0x40000000), deny]

    def arg(index):             # seccomp_data.args[index], its low 32 bits (little-endian)
        return (_LD, 0, 0, 16 + 8 * index)

    def only(index, *values, outcomes=(deny, allow)):   # allowed when arg `index` is in `values`
        jumps = [(_JEQ, len(values) - i, 0, v) for i, v in enumerate(values)]
        return [arg(index), *jumps, *outcomes]

    def never(index, *values):  # refused when arg `index` is in `values`
        return only(index, *values, outcomes=(allow, deny))

    def no_tmpfile(index):      # O_TMPFILE: a file no directory holds, so none is counted
        return [arg(index), (_AND, 0, 0, _O_TMPFILE), (_JEQ, 1, 0, 0), unsupported, allow]

    rules = {"clone3": [(_RET, 0, 0, _ERRNO | errno.ENOSYS)],     # glibc falls back to clone()
             "clone": [arg(0), (_AND, 0, 0, _CLONE_THREAD | _CLONE_NEW),
                       (_JEQ, 1, 0, _CLONE_THREAD), deny, allow],
             # Stream socketpairs stay (asyncio's self-pipe needs one): they reach no one.
             "socketpair": [arg(0), (_JEQ, 1, 0, socket.AF_UNIX), deny, arg(1), (_AND, 0, 0, 0xF),
                            (_JEQ, 1, 0, socket.SOCK_STREAM), deny, allow],
             "kill": only(0, 0, _OWN, _GROUP),
             **dict.fromkeys(("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"), only(0, _OWN)),
             **dict.fromkeys(("prlimit64", "sched_setaffinity", "sched_setscheduler",
                              "sched_setparam", "sched_setattr"), only(0, 0, _OWN)),
             # Kept: the parent-death signal, not dumpable (oom_score_adj), no filter hiding calls.
             "prctl": never(0, PR_SET_PDEATHSIG, PR_SET_DUMPABLE, _PR_SET_SECCOMP),
             "fcntl": never(1, *_FCNTL_REFUSED), "ioctl": never(1, *_IOCTL_REFUSED),
             # fd 3, the failure report, stays the zygote's socket for the whole run.
             "close": never(0, EPILOGUE_FD), "shutdown": never(0, EPILOGUE_FD),
             "dup2": never(1, EPILOGUE_FD), "dup3": never(1, EPILOGUE_FD),
             "close_range": [arg(0), (_JGE, 3, 0, EPILOGUE_FD + 1), arg(1),
                             (_JGE, 0, 1, EPILOGUE_FD), deny, allow],
             "open": no_tmpfile(1), "openat": no_tmpfile(2), "fallocate": [unsupported],
             "openat2": [(_RET, 0, 0, _ERRNO | errno.ENOSYS)],      # its flags are in a struct
             # Removing does nothing and says it did: what a run wrote stays counted till it ends.
             **dict.fromkeys(("unlink", "unlinkat", "rmdir"), [(_RET, 0, 0, _ERRNO | 0)])}
    for name, number in _SYSCALLS[ARCH].items():
        if no_mount or name not in _NEED_MOUNT:
            block = rules.get(name, [deny])
            prog += [(_JEQ, 0, len(block), number), *block]
    return prog + [allow]


def install_seccomp(program: list, pid: int) -> None:
    values = {_OWN: pid, _GROUP: -pid}
    code = b"".join(struct.pack("HBBI", c, jt, jf, values.get(k, k) & 0xFFFFFFFF)
                    for c, jt, jf, k in program)
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(program),
                                                    ctypes.addressof(buffer)), 16)
    prctl(_PR_SET_SECCOMP, 2, ctypes.addressof(fprog))               # SECCOMP_MODE_FILTER


class Landlock:
    """A worker's ruleset over O_PATH descriptors it keeps; each child adds its cwd, restricts."""

    def __init__(self, abi: int, read_paths: list):
        self.handled = ((1 << 13) - 1 | _LL_REFER * (abi >= 2) | _LL_TRUNCATE * (abi >= 3)
                        | _LL_IOCTL_DEV * (abi >= 5))
        net, scope = 3 * (abi >= 4), 3 * (abi >= 6)   # TCP bind+connect; abstract sockets+signals
        self.attr = struct.pack("QQQ", self.handled, net, scope)
        self.size = 8 if abi < 4 else 16 if abi < 6 else 24
        rw = _LL_READ | _LL_WRITE | _LL_TRUNCATE | _LL_IOCTL_DEV
        wanted = ([(path, _LL_READ | _LL_READ_DIR) for path in read_paths]
                  + [(f"/dev/{name}", rw) for name in ("null", "full")]
                  + [(f"/dev/{name}", _LL_READ) for name in ("zero", "urandom", "random")])
        self.fds, self.rules = [], []
        for path, rights in filter(lambda item: os.path.exists(item[0]), wanted):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)   # above 0-3, which a child's pipes take
            self.fds.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
            os.close(fd)
            kept = ~0 if os.path.isdir(path) else rw | _LL_EXECUTE
            self.rules.append((rights & self.handled & kept, self.fds[-1]))

    def install(self) -> None:
        ruleset = _syscall(_NR_LANDLOCK_CREATE, ctypes.create_string_buffer(self.attr), self.size,
                           0, what="landlock_create_ruleset")
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY)
        workdir = self.handled & ~(_LL_EXECUTE | _LL_MAKE_CHAR | _LL_MAKE_BLOCK)
        for rights, fd in self.rules + [(workdir, cwd)]:
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd))
            _syscall(_NR_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0, what="landlock_add_rule")
        _syscall(_NR_LANDLOCK_RESTRICT, ruleset, 0, what="landlock_restrict_self")
        for fd in self.fds + [cwd, ruleset]:
            os.close(fd)


def enter_mount_namespace(workdir: str, disk_mb: float, userns: bool,
                          owner: int | None = None) -> None:
    """Mounts read-only, nosuid, private (else our tmpfs reaches the host); a tmpfs on `workdir`."""
    if userns:
        uid, gid = os.geteuid(), os.getegid()
        _check(_libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
        prctl(PR_SET_DUMPABLE, 1)   # else /proc/self/*_map belong to root (the zygote is not)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        prctl(PR_SET_DUMPABLE, 0)
    else:
        _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", 1 | 2, 0, 1 << 18, 0), 32)
    _syscall(_SYSCALLS[ARCH]["mount_setattr"], -100, ctypes.create_string_buffer(b"/"), 0x8000,
             attr, 32, what="mount_setattr")                           # AT_FDCWD, AT_RECURSIVE
    options = f"size={int(disk_mb * 2 ** 20)},nr_inodes={MAX_FILES},mode=0700" + (
        f",uid={owner},gid={owner}" if owner is not None else "")
    _check(_libc.mount(b"sandbox", workdir.encode(), b"tmpfs", 2 | 4 | 8, options.encode()),
           "mount(tmpfs)")
    os.chdir(workdir)                                          # into the tmpfs, not beneath it


def worker_namespace(closed: list, keep: list, hide: bool) -> bool:
    """A tmpfs over each `closed` directory, `keep` paths bound back; `hide`: hidepid /proc (if)."""
    _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount(MS_PRIVATE)")
    umask = os.umask(0o022)
    try:
        for top in closed:
            below = [p for p in keep if p.startswith(top + "/") and os.path.exists(p)]
            below = [p for p in below if not any(p.startswith(q + "/") for q in below)]
            held = [os.open(path, os.O_PATH | os.O_CLOEXEC) for path in below]
            _check(_libc.mount(b"tmpfs", top.encode(), b"tmpfs", 2 | 4, b"mode=0755"),
                   "mount(tmpfs)")
            for path, fd in zip(below, held):
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
                os.makedirs(path if is_dir else os.path.dirname(path), 0o755, exist_ok=True)
                if not is_dir:
                    open(path, "w").close()        # a bind mount needs a file to cover
                _check(_libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None,
                                   _MS_BIND | _MS_REC, None), f"mount({path}, MS_BIND)")
                os.close(fd)
    finally:
        os.umask(umask)
    for option in (b"hidepid=invisible", b"hidepid=2") if hide else ():   # 5.8+, older kernels
        if _libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, option) == 0:  # nosuid,nodev,noexec
            return True
    return False


def has_capability(cap: int) -> bool:
    sets = (ctypes.c_uint32 * 6)()     # effective, permitted, inheritable; low then high 32 bits
    _check(_libc.capget(struct.pack("Ii", 0x20080522, 0), sets), "capget")
    return bool((sets[0] | sets[3] << 32) >> cap & 1)


def become(uid: int) -> None:
    for call, args in ((os.setgroups, [[]]), (os.setresgid, [uid] * 3), (os.setresuid, [uid] * 3)):
        try:
            call(*args)
        except OSError as exc:
            raise OSError(exc.errno, f"{call.__name__}: {errno.errorcode.get(exc.errno)}") from None


def drop_capabilities(last_cap: int, uid: int | None = None) -> None:
    """Every capability gone for good; `uid`: become it on the way, while CAP_SETUID is held."""
    if has_capability(_CAP_SETPCAP):
        prctl(_PR_SET_SECUREBITS, 0xEF)   # NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE + locks
        for cap in range(last_cap + 1):
            prctl(_PR_CAPBSET_DROP, cap)
    if uid is not None:
        become(uid)
    prctl(_PR_CAP_AMBIENT, 4)         # PR_CAP_AMBIENT_CLEAR_ALL
    _check(_libc.capset(struct.pack("Ii", 0x20080522, 0), bytes(24)), "capset")   # version 3


def set_oom_score() -> None:
    """oom_score_adj 1000; the run cannot lower it later (docs/SANDBOX.md, layer 2)."""
    dumpable = prctl(3)                # PR_GET_DUMPABLE: a non-dumpable process's /proc is root's
    if not dumpable:
        prctl(PR_SET_DUMPABLE, 1)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    finally:
        if not dumpable:
            prctl(PR_SET_DUMPABLE, 0)


def run_uid(slot: int) -> int:
    """The runs' uid of worker `slot` (docs/SANDBOX.md, 'A run is another user')."""
    pid = os.getpid()
    with contextlib.suppress(OSError):
        pid += os.stat("/proc/self/ns/pid").st_ino * 2654435761
    return (1 << 30) + (pid + slot // 256 * 40503) % (1 << 22) * 256 + slot % 256


def readable_paths() -> list:
    """System libraries and the Python installation, no more (no editable project install)."""
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime",
             "/sys/devices/system/cpu", sysconfig.get_config_var("LIBDIR")]
    paths += [sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")]
    real = [os.path.realpath(p) for p in paths if p and os.path.exists(p)]
    return sorted(set(real), key=real.index)


def pids_cgroup() -> tuple:
    """([directory, version], why not) of our pids cgroup: v1, else cgroup2 with pids delegated."""
    try:
        paths = dict(line.rstrip("\n").split(":", 2)[1:] for line in open("/proc/self/cgroup"))
    except OSError as exc:
        return None, f"/proc/self/cgroup: {exc.strerror}"
    candidates = [("/sys/fs/cgroup/pids" + paths.get("pids", "/").rstrip("/"), "v1",
                   "cgroup.procs")]
    candidates += [(root + paths.get("", "/").rstrip("/"), "v2", "cgroup.subtree_control")
                   for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")]
    why = []
    for directory, version, probe in filter(lambda c: os.path.isfile(f"{c[0]}/{c[2]}"), candidates):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            why.append(f"{directory} is on a read-only mount")
        elif not os.access(directory, os.W_OK):
            why.append(f"{directory} is not writable by uid {os.geteuid()}")
        elif version == "v2" and "pids" not in open(f"{directory}/{probe}").read():
            why.append(f"pids is not delegated below {directory} (cgroup.subtree_control)")
        else:
            return [directory, version], None
    return None, "; ".join(why) or "no pids cgroup hierarchy is mounted"


def available_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (v2, else v1)."""
    cores = len(os.sched_getaffinity(0))
    for quota_file, period_file in (("cpu.max", "cpu.max"),
                                    ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        with contextlib.suppress(OSError, ValueError, IndexError, ZeroDivisionError):  # no quota
            quota, period = (open("/sys/fs/cgroup/" + f).read().split()[i]
                             for f, i in ((quota_file, 0), (period_file, -1)))
            if quota not in ("max", "-1"):
                cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return cores


def missing_layer() -> str | None:
    """What this machine lacks of the floor: without it no run is confined at all."""
    return ((not sys.platform.startswith("linux") and "Linux")
            or (ARCH not in _SYSCALLS and f"a seccomp filter for {ARCH}")
            or (sys.version_info < (3, 11) and "Python 3.11 or later (a run's guard)") or None)


def _refusal(exc: OSError, cap: int | None = None) -> str:
    """Its errno and who refused it (a seccomp filter refuses invalid arguments; the kernel not)."""
    why, name = [exc.strerror], exc.strerror.split("(")[0].split(":")[0]
    number = {**_SYSCALLS[ARCH], "landlock_create_ruleset": _NR_LANDLOCK_CREATE}.get(name)
    if number and _libc.syscall(ctypes.c_long(number), *[ctypes.c_long(-1)] * 5) == -1 and \
            ctypes.get_errno() in (errno.EPERM, errno.EACCES, errno.ENOSYS):
        why.append("refused by a seccomp filter on this process")
    if cap is not None and not has_capability(cap):
        why.append("this process lacks " + {_CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
                                            _CAP_SETUID: "CAP_SETUID"}[cap])
    return ", ".join(why)


def _in_child(trial, *args) -> dict:
    """`trial(*args)`'s dict, run in a forked child; if the child dies, that is the why."""
    read, write = os.pipe()
    if (pid := os.fork()) == 0:
        try:
            os.write(write, json.dumps(trial(*args)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        found = json.loads(f.read() or '{"why": "the child trying it died", "nproc": false, '
                                        '"expose": [], "hide_proc": false}')
    os.waitpid(pid, 0)
    return found


def _nproc_binds() -> bool:
    """Whether RLIMIT_NPROC binds this process (it does not bind root, nor CAP_SYS_RESOURCE)."""
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    try:
        if os.fork() == 0:
            os._exit(0)
    except OSError:
        return True                   # this process is the one task its count allows
    os.wait()
    return False


def _try_mount(directory: str, userns: bool) -> dict:
    """In a child: a mount namespace as a run enters it (and whether RLIMIT_NPROC then binds)."""
    found = {"why": None, "nproc": False}
    try:
        enter_mount_namespace(directory, 1, userns)
        found["nproc"] = _nproc_binds()
    except OSError as exc:
        found["why"] = _refusal(exc, None if userns else _CAP_SYS_ADMIN)
    return found


def _try_uid(uid: int, paths: list) -> dict:
    # "expose": the topmost directories above `paths` other users may not enter (pyenv under /root)
    closed = set()
    for parts in (path.split("/") for path in paths):
        aboves = ("/".join(parts[:i]) for i in range(2, len(parts)))
        closed.add(next((a for a in aboves if not os.stat(a).st_mode & stat.S_IXOTH), ""))
    found = {"why": None, "expose": sorted(closed - {""}), "nproc": False, "hide_proc": False}
    try:
        try:
            found["hide_proc"] = worker_namespace(found["expose"], paths, True)
        except OSError as exc:
            if found["expose"]:
                raise OSError(exc.errno, f"{', '.join(found['expose'])} closed to other users, "
                              f"and no mount namespace to open: {exc.strerror}")
        become(uid)
        unreadable = [p for p in paths if not os.access(p, os.R_OK | os.X_OK * os.path.isdir(p))]
        if unreadable:
            found["why"] = f"uid {uid} cannot read {unreadable[0]}"
        found["hide_proc"] &= not os.path.exists(f"/proc/{os.getppid()}")
        found["nproc"] = _nproc_binds()
    except OSError as exc:
        found["why"] = (f"uid {uid} is not mapped in this user namespace"
                        if exc.errno == errno.EINVAL else _refusal(exc, _CAP_SETUID))
        with contextlib.suppress(OSError):
            if exc.strerror.startswith("setgroups") and \
                    open("/proc/self/setgroups").read().strip() == "deny":
                found["why"] += " (setgroups is denied in this user namespace)"
    return found


def detect(uid: int) -> dict:
    """Each optional layer tried as a run uses it; it forks (grants() runs it in a new process)."""
    found = {"landlock": 0, "landlock_why": None}
    try:
        found["landlock"] = _syscall(_NR_LANDLOCK_CREATE, 0, 0, 1, what="landlock_create_ruleset")
    except OSError as exc:
        hint = {errno.ENOSYS: "; no Landlock in this kernel?",
                errno.EOPNOTSUPP: "; add landlock to lsm= at boot"}
        found["landlock_why"] = _refusal(exc) + hint.get(exc.errno, "")
    found["cgroup"], found["cgroup_why"] = pids_cgroup()
    directory = tempfile.mkdtemp(prefix="sandbox-detect-")
    found["mount_root"], found["mount_user"] = (_in_child(_try_mount, directory, userns)
                                                for userns in (False, True))
    os.rmdir(directory)
    found["uid"] = _in_child(_try_uid, uid, readable_paths())
    return found


if __name__ == "__main__":
    print(json.dumps(detect(int(sys.argv[1]))))
