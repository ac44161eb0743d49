"""common.py: what every stage shares: one flag parser, distributed set-up and the few collectives
the trainers use (none of them runs in a one-process run), rank-0 printing, hub-id resolution,
FSDP2 model building (where the trainers' x world comes from), the sandbox's start-up check.
Beside it: checkpoint.py (save, resume), runlog.py (metrics.jsonl, wandb, kept trajectories),
multinode.py (the start-up checks of a run over several nodes)."""

import argparse
import contextlib
import inspect
import io
import json
import os
import tokenize
import warnings
from dataclasses import fields
from datetime import timedelta

import torch
import torch.distributed as dist

import checks

# How long a rank waits in a collective (the trainers' --dist_timeout, in minutes): longer than
# the ranks of a training step drift apart (uneven rollouts, rank 0 writing a 4B checkpoint), short
# enough that a stuck node stops the job. Evaluations gather on a group of their own
# (multinode.gather_objects).
DIST_TIMEOUT = timedelta(minutes=30)
# Evaluations gather their results on a gloo group of their own, which waits this long: ranks'
# shares of an evaluation can finish hours apart (multinode.gather_objects).
GATHER_TIMEOUT = timedelta(hours=12)
_gather_groups = {}   # the default group -> its gather group; distributed() takes them down


def _bool(text):
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes")


def _field_comments(cls):
    """field -> the comment on its line in the class source (what --help says of it);
    {} without source."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments = {}
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        if t.type == tokenize.COMMENT:
            name = lines[t.start[0] - 1].split(":")[0].strip()
            comments[name] = t.string.lstrip("# ").replace("%", "%%")
    return comments


def parse_config(cls, argv, doc="", presets=None):
    """A `cls` dataclass from --name value / --name=value flags ('-' and '_' alike; a bare bool
    flag means true). presets: {name: {field: value}}; `--preset NAME` sets those defaults under
    the explicit flags. `--` (torchrun's separator) is skipped; --help lists every default, with
    the comment beside the field in the dataclass."""
    argv = [a for a in argv if a != "--"]
    values = {}
    if presets:  # a first pass reads --preset alone, so its values become the defaults --help shows
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--preset", choices=sorted(presets))
        values = presets.get(pre.parse_known_args(argv)[0].preset) or {}
    p = argparse.ArgumentParser(description=doc, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if presets:
        p.add_argument("--preset", choices=sorted(presets), help="named preset of defaults")
    comments = _field_comments(cls)
    for f in fields(cls):
        default = values.get(f.name, f.default)
        names = sorted({f"--{f.name}", f"--{f.name.replace('_', '-')}"})
        if type(f.default) is bool:
            kind = dict(type=_bool, nargs="?", const=True)
        else:
            kind = dict(type=type(f.default))
        help_text = f"{comments.get(f.name, '')} (default: {default!r})".lstrip()
        p.add_argument(*names, dest=f.name, default=default, help=help_text, **kind)
    args = vars(p.parse_args(argv))
    args.pop("preset", None)
    return cls(**args)


def setup_distributed(device="auto", timeout_minutes=None):
    """(rank, world, device, under_torchrun). Always leaves a process group behind (a world of
    one when not under torchrun), so the code is the same in both cases; the collectives below
    skip a world of one."""
    if dist.is_initialized():
        cuda = dist.get_backend() == "nccl"
    else:
        checks.refuse_bare_srun()
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else DIST_TIMEOUT
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, **alone)
    dev = torch.device("cpu")
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    return dist.get_rank(), dist.get_world_size(), dev, "RANK" in os.environ


@contextlib.contextmanager
def distributed(device="auto", timeout_minutes=None):
    """setup_distributed() for a with block. Leaving it normally, every rank waits for the others
    first (gloo aborts a rank whose peer tears the group down before it); a group made here is then
    destroyed. An exception skips the wait: a failing rank must not hang on its peers."""
    created = not dist.is_initialized()
    info = setup_distributed(device, timeout_minutes)
    try:
        yield info
        if info[1] > 1:
            dist.barrier()
            if group := _gather_groups.pop(dist.group.WORLD, None):
                dist.destroy_process_group(group)   # on every rank before any tears down
                dist.barrier()                      # the default group: no peer sees it closed
    finally:
        if created:
            _gather_groups.clear()
            dist.destroy_process_group()


def gather_group():
    """The gloo group with GATHER_TIMEOUT for gathers after long per-rank work. Made on the first
    call, a collective: every rank calls it at the same point, while the ranks are together."""
    if dist.group.WORLD not in _gather_groups:
        group = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT)
        _gather_groups[dist.group.WORLD] = group
    return _gather_groups[dist.group.WORLD]


# ---------------------------------------------------------------- collectives
# A one-process run keeps a process group of one, so the code reads the same in both cases, but
# calls no collective on it: after a gloo collective, even over one rank, small CPU ops run 2-3x
# slower for the rest of the process (the toy run: 9% slower end to end).
def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier():
    if world_size() > 1:
        dist.barrier()


def all_reduce(values, device, op=dist.ReduceOp.SUM):
    """A list of numbers reduced over the ranks (float64), as floats."""
    if world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_gather_list(items):
    """Every rank's list of picklable items, concatenated in rank order."""
    if world_size() == 1:
        return list(items)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(items))
    return [x for part in parts for x in part]


def broadcast_object(obj, src=0):
    """Rank src's obj on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def print0(*args):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def resolve_model(path):
    """A local directory as is, once its weight files are checked whole; a path that looks local
    and is not there is refused. A hub id is downloaded once per node (each node has its own
    cache) by its local rank 0, then read from the cache; one line when that fails."""
    if os.path.isdir(path):
        if problem := checks.damaged_weights(path):
            raise SystemExit(f"--model {path}: {problem}")
        return path
    if checks.looks_local(path):
        raise SystemExit(f"--model {path}: no such directory (a hub id looks like owner/name)")
    from huggingface_hub import snapshot_download
    first, local, error = int(os.environ.get("LOCAL_RANK", 0)) == 0, None, None
    try:
        local = snapshot_download(path) if first else None
    except Exception as e:  # offline, unknown id, no access: all end the run the same way
        error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    errors = [e for e in all_gather_list([error]) if e]
    if not errors and local is None:
        try:
            local = snapshot_download(path, local_files_only=True)
        except Exception as e:
            errors = [f"{type(e).__name__}: not in this node's cache"]
    if errors:
        raise SystemExit(f"--model {path}: not a local directory, and the hub id could not be "
                         f"fetched ({errors[0]}); offline, download it first or pass a directory")
    return local


def build_model(path, device, sharded):
    """A model to train. One CPU process: the checkpoint as is, in fp32. Under torchrun, and on
    CUDA always (one process too: fp32 GQA attention has no fused SDPA kernel, a 20k-token sequence
    would materialise [heads, T, T] scores): FSDP2 with each block one unit and the root
    (embeddings, final norm, tied head) another; on CUDA bf16 compute with fp32 master weights and
    gradient reduction. Rank 0 alone reads the weights and broadcasts them into the sharded model,
    built on the meta device (no rank holds a full fp32 copy but rank 0).

    FSDP2's reduce-scatter AVERAGES gradients over the ranks (it divides their sum by the world
    size). The trainers want a sum: each rank's loss is already its share of the global token
    mean, so they backpropagate loss x world (rl.update, sft's step) and the average becomes it."""
    from model import ModelConfig, Transformer
    if not (sharded or device.type == "cuda"):
        return Transformer.from_pretrained(path, device=device, dtype=torch.float32)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import (MixedPrecisionPolicy, fully_shard,
                                        register_fsdp_forward_method)
    with open(os.path.join(path, "config.json")) as f:
        config = ModelConfig.from_dict(json.load(f))
    with torch.device("meta"):
        model = Transformer(config)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype(device), reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # not forward(): gather the root's weights around it
    register_fsdp_forward_method(model, "token_logprobs")
    # token_logprobs returns a view; FSDP warns about in-place use of it, and it is only used out
    # of place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model.to_empty(device=device)
    full = {}
    if dist.get_rank() == 0:
        full = Transformer.from_pretrained(path, dtype=torch.float32).state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    model.tie_weights()
    # FSDP sets itself up on the first forward through the root; the sampler calls model.hidden
    # (no hooks), so one tiny forward (a collective) settles it, then the root gives back its
    # weights
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long, device=device))
    model.reshard()
    return model


def start_sandbox(workers, require, rank):
    """Every rank starts its sandbox pool (workers 0: its share of the cores) and waits for it
    before any rollout: a sandbox that cannot start stops the run with its own error, instead of
    a dead tool for the whole run. The pool prints its line of layers itself, as it starts."""
    import sandbox
    sandbox.configure(workers or None, require)
    try:
        sandbox.check()
    except RuntimeError as e:
        raise SystemExit(f"rank {rank}: {e}") from None


def compute_dtype(device):
    """The dtype a trained model computes (and samples) in: bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def clip_grads(model, max_norm):
    """Clip the gradients' global norm to max_norm (0: no clipping); returns the norm before, a
    float (under FSDP2 clip_grad_norm_ returns a DTensor)."""
    limit = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
