"""machinery/exits.py: how the stages leave. Ctrl-C, or a full disk: one line saying where the work
is kept and how to go on, not a traceback; a torchrun worker whose run ended well: exit_worker."""

import contextlib
import errno
import os
import shutil
import sys

DISK = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
        errno.EROFS: "the disk is read-only"}


@contextlib.contextmanager
def quiet_interrupt(say, where):
    """Ctrl-C: say("interrupted") on rank 0 and exit status 130 (the sandbox pool closes at exit,
    cancelling its queued runs). A disk full or read-only under `where` (the output directory):
    say() of a line naming the file and the disk, and exit status 1."""
    try:
        yield
    except BaseException as e:
        if any(isinstance(x, KeyboardInterrupt) for x in causes(e)):
            if os.environ.get("RANK", "0") == "0":
                print(say("interrupted"), file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        if isinstance(e, Exception) and (trouble := disk_trouble(e, where)):
            raise SystemExit(say(f"stopped: {trouble}")) from None
        raise


def causes(error):
    """error and every exception inside it: causes, contexts, and what dcp.save wraps in a
    CheckpointException (failures {rank: (exception, its traceback)})."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        yield e
        seen.add(id(e))
        inner = [w[0] if isinstance(w, tuple) else w for w in getattr(e, "failures", {}).values()]
        todo += [x for x in (e.__cause__, e.__context__, *inner)
                 if isinstance(x, BaseException) and id(x) not in seen]


def disk_trouble(error, where):
    """'FILE: the disk is full (...)' when error came from a full or read-only disk, else None.
    safetensors says so in words, torch.save not at all ("file write failed"): then a disk under
    `where` (the output directory) with nothing left free is taken as the cause."""
    said = lambda e: f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    for e in causes(error):
        for code, words in DISK.items():
            if isinstance(e, OSError) and e.errno == code:
                return f"{e.filename or where}: {words} ({e.strerror})"
            if os.strerror(code) in str(e):
                return f"{where}: {words} ({said(e)})"
    try:
        full = shutil.disk_usage(where).free < 2**20
    except OSError:
        return None
    return f"{where}: {DISK[errno.ENOSPC]} ({said(error)})" if full else None


def resume_line(stage, out_dir, why):
    """What quiet_interrupt says for a trainer: why it stopped, and the newest resumable checkpoint
    the same command resumes from (or that it starts again)."""
    from machinery.checkpoints import checkpoints
    if not (found := checkpoints(out_dir, resumable=True)):
        return f"{stage}: {why}; no checkpoint yet: the same command starts again"
    return (f"{stage}: {why}; the newest checkpoint is {found[-1][1]} (step {found[-1][0]}); "
            f"the same command resumes from it")


def exit_worker():
    """How a torchrun worker leaves after a run that ended well: threads joined and atexit handlers
    run, then os._exit(0) instead of the interpreter's teardown. DTensor caches keep a gloo group
    alive past destroy_process_group, and its worker thread may still take the GIL to let go of
    the last collective's tensors; a thread asking for the GIL during teardown aborts the process
    (pytorch#190489; 1 run in 10 of a two-rank CPU test). One process: a plain return."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import atexit
    import threading
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
