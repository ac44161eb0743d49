"""machinery/checkpoints.py: one checkpoint writer and reader for both trainers. A checkpoint is a
Hugging Face directory (what evaluate.py and the next stage load) plus train_state/ (sharded weights
and optimizer, each rank's RNG, the trainer's dict) for an exact resume; written under a temporary
name and renamed once complete, so a killed run leaves the previous one whole. A run holds its
out_dir (claim): no second run writes there, and a fresh start moves the old run aside."""

import contextlib
import fcntl
import os
import random
import shutil
import socket
import time
import warnings

import torch
import torch.distributed as dist

from machinery.distributed import all_gather_list, barrier, broadcast_object, world_size
from machinery.flags import damaged_weights


def check_resume(trainer, current, fields_that_matter, total_steps, path):
    """Refuse a resume whose saved config differs in a field that changes the data order or the
    schedule (unless --resume_override), naming it and the ways on; and one that would train
    nothing (at or past the last step), only rewriting the finished run's summary."""
    saved, out_dir = trainer["config"], os.path.dirname(path)
    changed = [f"--{k} is {current.get(k)!r}, {path} was made with {saved.get(k)!r}"
               for k in fields_that_matter if saved.get(k) != current.get(k)]
    ways = (f"pass another --out_dir for a new run, or --resume=false to start over in {out_dir} "
            f"(its run is moved aside)")
    if changed and not current["resume_override"]:
        raise SystemExit(f"--resume: {changed[0]}: {ways}, or --resume_override=true to continue "
                         f"that run with the new settings")
    if trainer["step"] > total_steps or (changed and trainer["step"] == total_steps):
        raise SystemExit(f"--resume: {path} is at step {trainer['step']} of a run of "
                         f"{total_steps} steps: nothing left to train; {ways}")


LOCK = ".lock"


@contextlib.contextmanager
def claim(out_dir, stage, resume=None):
    """The run's hold on out_dir, for a with block: rank 0 holds an flock on out_dir/.lock (let go
    when the process ends, even by kill -9), so a second run into it stops with one line naming
    the first. resume (the trainers'): a run that starts fresh (--resume=false, or nothing to
    resume) moves a run already in out_dir aside to out_dir.replaced-N, and says so; a killed
    save's .tmp_step_* folders go. A collective: every rank stops, or none."""
    held, problem = None, None
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        held = open(os.path.join(out_dir, LOCK), "a+")
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.truncate(0)
            held.write(f"pid {os.getpid()} on {socket.gethostname()}, {stage}, since "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            held.flush()
        except BlockingIOError:
            held.seek(0)
            problem = (f"{out_dir} is in use by another run ({held.read().strip()}): wait for it "
                       f"to end, or choose another output directory")
        except OSError as e:  # a filesystem without locks (some network ones)
            print(f"{out_dir}: cannot lock it ({e.strerror}); nothing stops a second run from "
                  f"writing there", flush=True)
        if not problem and resume is not None:  # the trainers'
            if not (resume and checkpoints(out_dir, resumable=True)):
                move_aside(out_dir, stage)
            for name in os.listdir(out_dir):  # leftovers of a run killed while saving
                if name.startswith(".tmp_step_"):
                    shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    try:
        if problem := broadcast_object(problem):
            raise SystemExit(problem)
        yield
    finally:
        if held:
            held.close()


def move_aside(out_dir, stage):
    names = [n for n in os.listdir(out_dir) if n != LOCK]
    if not any(n.startswith("step_") or n in ("metrics.jsonl", "summary.json") for n in names):
        return
    base, n = os.path.normpath(out_dir), 1
    while os.path.exists(f"{base}.replaced-{n}"):
        n += 1
    os.makedirs(f"{base}.replaced-{n}")
    for name in names:
        os.rename(os.path.join(out_dir, name), os.path.join(f"{base}.replaced-{n}", name))
    print(f"{stage}: starting a new run in {out_dir}; the run that was there is now in "
          f"{base}.replaced-{n}", flush=True)


def checkpoints(out_dir, resumable=False):
    """[(step, path)] of the complete checkpoints in out_dir, oldest first."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    found = sorted((int(n[5:]), os.path.join(out_dir, n)) for n in names
                   if n.startswith("step_") and n[5:].isdigit())
    return [(step, path) for step, path in found
            if not resumable or os.path.exists(os.path.join(path, "train_state", "trainer.pt"))]


def damaged(path):
    """What is wrong with checkpoint path ("FILE: what"), else None: its weights, the trainer
    dict and RNG files, and every shard the train_state metadata lists, at its full length."""
    from torch.distributed.checkpoint import FileSystemReader
    state = os.path.join(path, "train_state")
    if problem := damaged_weights(path):
        return problem
    for name in sorted(os.listdir(state)):
        if name.endswith(".pt"):
            try:
                torch.load(os.path.join(state, name), weights_only=False)
            except Exception as e:
                return f"{os.path.join(state, name)}: unreadable ({type(e).__name__})"
    dcp_dir = os.path.join(state, "dcp")
    try:
        shards = FileSystemReader(dcp_dir).read_metadata().storage_data.values()
    except Exception as e:
        return f"{dcp_dir}/.metadata: unreadable ({type(e).__name__})"
    for info in shards:
        file = os.path.join(dcp_dir, info.relative_path)
        size = os.path.getsize(file) if os.path.exists(file) else 0
        if size < info.offset + info.length:
            return f"{file}: truncated ({size} of at least {info.offset + info.length} bytes)"
    return None


def latest_resumable(out_dir):
    """Rank 0's newest whole resumable checkpoint, the same on every rank (None when there is
    none); a damaged newer one is named and passed over. Stops when a rank cannot read the chosen
    one, or sees one where rank 0 sees none (out_dir must be one shared directory)."""
    chosen, skipped = None, []
    if dist.get_rank() == 0:
        for _, path in reversed(checkpoints(out_dir, resumable=True)):
            if (problem := damaged(path)) is None:
                chosen = path
                break
            skipped.append(problem)
    chosen, skipped = broadcast_object((chosen, skipped))
    if skipped and chosen is None:
        raise SystemExit(f"cannot resume: {skipped[0]}; {out_dir} holds no older whole "
                         f"checkpoint with its train_state (--keep_checkpoints / "
                         f"--keep_train_state keep more)")
    for problem in skipped if dist.get_rank() == 0 else []:
        print(f"passing over a damaged checkpoint: {problem}; resuming from {chosen}")
    mine = checkpoints(out_dir, resumable=True)[-1:]
    unread = chosen and not os.path.exists(os.path.join(chosen, "train_state", "dcp", ".metadata"))
    views = all_gather_list([(socket.gethostname(), mine and mine[0][1], unread)])
    for rank, (where, seen, unread) in enumerate(views):
        if unread or (chosen is None and seen):
            what = f"cannot read {chosen}" if unread else f"sees {seen}, rank 0 none"
            raise SystemExit(f"resume: rank {rank} on {where} {what}: every rank must resume "
                             f"from the same checkpoint, out_dir {out_dir} must be shared")
    return chosen


def save_checkpoint(out_dir, step, model, optimizer, tokenizer, trainer, base_path=None,
                    dtype=None, keep=1, last=True):
    """out_dir/step_NNNNNN: a Hugging Face directory (full weights gathered on rank 0's CPU) plus
    train_state/ (fp32 weights and optimizer sharded by torch.distributed.checkpoint, each rank's
    RNG, the trainer dict). Written into .tmp_step_NNNNNN and renamed once complete; out_dir/final
    then points at it if it is the run's `last`. Only the newest `keep` checkpoints keep their
    train_state. dtype: of the HF weights, a model.DTYPES name or "auto" (the base's stored
    dtype); None: the model's own. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict)
    from model import DTYPES, Transformer
    rank = dist.get_rank()
    name = f"step_{step:06d}"
    final, tmp = os.path.join(out_dir, name), os.path.join(out_dir, ".tmp_" + name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "train_state"))
    barrier()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank == 0:  # the HF directory: the gathered weights assigned into a model built on meta
        with torch.device("meta"):
            hf = Transformer(model.config)
        hf.load_state_dict(full, assign=True, strict=False)
        hf.tie_weights()
        stored = model.config.dtype if dtype == "auto" else dtype
        (hf.to(DTYPES[stored]) if dtype else hf).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if base_path and os.path.exists(os.path.join(base_path, "generation_config.json")):
            shutil.copy(os.path.join(base_path, "generation_config.json"), tmp)
    del full
    weights, optim = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # no_dist says "assuming ... a single process": it is one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": weights, "optim": optim},
                 checkpoint_id=os.path.join(tmp, "train_state", "dcp"), no_dist=world_size() == 1)
    torch.save(dict(python=random.getstate(), torch=torch.get_rng_state(),
                    cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None),
               os.path.join(tmp, "train_state", f"rng_rank{rank}.pt"))
    barrier()
    problem = None
    if rank == 0:
        # written last: it marks the checkpoint complete, once read back whole
        torch.save(dict(trainer, step=step), os.path.join(tmp, "train_state", "trainer.pt"))
        if not (problem := damaged(tmp)):
            if os.path.exists(final):  # re-saving a step: the old one moves aside (atomic renames)
                os.rename(final, final + ".old")
            os.rename(tmp, final)
            shutil.rmtree(final + ".old", ignore_errors=True)
            for _, old in checkpoints(out_dir, resumable=True)[:-max(1, keep)]:
                shutil.rmtree(os.path.join(old, "train_state"), ignore_errors=True)
            if last:  # final points only at a finished run's checkpoint
                link = os.path.join(out_dir, ".final.tmp")
                if os.path.lexists(link):
                    os.remove(link)
                os.symlink(name, link)
                os.replace(link, os.path.join(out_dir, "final"))
    # nobody reads or resumes before rank 0 has finished writing
    if problem := broadcast_object(problem):
        raise SystemExit(f"the checkpoint of step {step} was not written whole: {problem}")
    return final


def load_checkpoint(path, model, optimizer):
    """Restore what save_checkpoint wrote into the live (possibly sharded) model and optimizer
    and this rank's RNG; returns the trainer dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    weights, optim = get_state_dict(model, optimizer)
    state = {"model": weights, "optim": optim}
    with warnings.catch_warnings():  # as in save_checkpoint
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=os.path.join(path, "train_state", "dcp"),
                 no_dist=world_size() == 1)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    rng = os.path.join(path, "train_state", f"rng_rank{dist.get_rank()}.pt")
    if os.path.exists(rng):  # absent when resuming on more ranks than were saved
        rng = torch.load(rng, weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return torch.load(os.path.join(path, "train_state", "trainer.pt"), weights_only=False)

