"""machinery/exits.py: how rl.py, sft.py and evaluate.py leave: after Ctrl-C (quiet_interrupt), and
as a torchrun worker whose run ended well (exit_worker)."""

import contextlib
import os
import sys


@contextlib.contextmanager
def quiet_interrupt(say):
    """Ctrl-C: one line on rank 0, say() (where the work is kept and how to go on), and exit
    status 130, not a traceback from wherever the run was (the sandbox pool closes at exit,
    cancelling its queued runs)."""
    try:
        yield
    except BaseException as e:
        if not by_interrupt(e):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(say(), file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def by_interrupt(error):
    """Whether error is or wraps a KeyboardInterrupt (dcp.save wraps what stopped its writer in a
    CheckpointException: failures {rank: (exception, its traceback)})."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        inner = [w[0] if isinstance(w, tuple) else w for w in getattr(e, "failures", {}).values()]
        todo += [x for x in (e.__cause__, e.__context__, *inner)
                 if isinstance(x, BaseException) and id(x) not in seen]
    return False


def resume_line(stage, out_dir, resume="the same command"):
    """What quiet_interrupt says for a trainer: its newest resumable checkpoint and the command
    that resumes from it; without one, that the same command starts again."""
    from machinery.checkpoints import checkpoints
    if not (found := checkpoints(out_dir, resumable=True)):
        return f"{stage}: interrupted before its first checkpoint; the same command starts again"
    step, path = found[-1]
    return (f"{stage}: interrupted; the newest checkpoint is {path} (step {step}); {resume} "
            "resumes from it")


def exit_worker():
    """How a torchrun worker leaves after a run that ended well: Python threads joined and atexit
    handlers run, as at any exit, then os._exit(0) instead of the interpreter's teardown. torch's
    DTensor caches keep a gloo group alive past destroy_process_group, and one of its worker
    threads can still be letting go of the last collective's tensors, which takes the GIL; Python
    ends a thread that asks for the GIL during teardown, and the process aborts (pytorch#190489;
    1 run in 10 of a two-rank CPU test on a busy machine). One process: a plain return."""
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
