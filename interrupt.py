"""interrupt.py: what Ctrl-C does in rl.py, sft.py and evaluate.py: one line saying where the work
is kept and how to go on, exit status 130, no traceback from wherever the run was."""

import contextlib
import os
import sys


@contextlib.contextmanager
def quiet_interrupt(say):
    """Ctrl-C: one line on rank 0, say() (where the work is kept and how to go on), and exit
    status 130, instead of a traceback from wherever the run was (the sandbox pool closes at
    exit, cancelling its queued runs)."""
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
    from checkpoint import checkpoints
    found = checkpoints(out_dir, resumable=True)
    if not found:
        return f"{stage}: interrupted before its first checkpoint; the same command starts again"
    return (f"{stage}: interrupted; the newest checkpoint is {found[-1][1]} (step "
            f"{found[-1][0]}); {resume} resumes from it")
