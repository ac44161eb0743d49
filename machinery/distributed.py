"""machinery/distributed.py: what the stages share to run as one process or under torchrun, and
the start-up checks that make a run over several nodes right or stop it in one line (every rank
sees rank 0's out_dir and inputs and evaluates the same model, `srun python` without torchrun is
refused). README ("More than one node") says how to launch."""

import contextlib
import hashlib
import json
import os
import socket
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from machinery.flags import damaged_weights, looks_local

# How long a rank waits in a collective (the trainers' --dist_timeout, in minutes): longer than
# the ranks of a training step drift apart (uneven rollouts, rank 0 writing a 4B checkpoint), short
# enough that a stuck node stops the job.
DIST_TIMEOUT = timedelta(minutes=30)
# Evaluations gather on a gloo group of their own that waits this long: ranks' shares of an
# evaluation can finish hours apart (gather_objects).
GATHER_TIMEOUT = timedelta(hours=12)
_gather_groups = {}   # the default group -> its gather group; distributed() takes them down


def allocator_defaults(env=os.environ):
    """Expandable segments for torch's CUDA allocator unless the user set its options (either
    name); called before CUDA starts. The KV pool is sized from allocated bytes (rollout.kv_budget):
    with expandable segments, what is reserved stays near them (no fragmentation)."""
    if not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(env):
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


def setup_distributed(device="auto", timeout_minutes=None):
    """(rank, world, device, under_torchrun); leaves a process group, of one outside torchrun."""
    if dist.is_initialized():
        cuda = dist.get_backend() == "nccl"
    else:
        # `srun python rl.py` starts one copy per Slurm task, each unaware of the others (no
        # RANK): N runs on one out_dir. srun sets the step's task count, a batch script's shell not.
        tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or "1"
        if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and int(tasks) > 1:
            raise SystemExit(f"Slurm task {os.environ['SLURM_PROCID']} of {tasks} without "
                             f"torchrun: each would train alone; launch one torchrun per node: "
                             f"`srun --ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES ...` "
                             f"(README: More than one node)")
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else DIST_TIMEOUT
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, **alone)
    dev = torch.device("cuda", int(os.getenv("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
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
    """The gloo group of GATHER_TIMEOUT, made by the first call: a collective, all ranks at once."""
    if dist.group.WORLD not in _gather_groups:
        _gather_groups[dist.group.WORLD] = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT)
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


def gather_objects(obj, long_wait=True):
    """Every rank's obj in rank order, on gather_group (after long per-rank work) if long_wait."""
    if world_size() == 1:
        return [obj]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj, group=gather_group() if long_wait else None)
    return parts


def all_gather_list(items):
    """Every rank's list of picklable items, concatenated in rank order (on the default group)."""
    return [x for part in gather_objects(list(items), long_wait=False) for x in part]


def broadcast_object(obj):
    """Rank 0's obj on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def print0(*args):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def resolve_model(path):
    """A local directory as is, once its weight files are checked whole (a path that looks local
    and is not there: refused); a hub id downloaded by each node's local rank 0, then read from
    the node's cache; one line when that fails."""
    if os.path.isdir(path):
        if problem := damaged_weights(path):
            raise SystemExit(f"--model {path}: {problem}")
        return path
    if looks_local(path):
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
    CUDA always (fp32 GQA attention has no fused SDPA kernel: a 20k-token sequence would
    materialise [heads, T, T] scores): FSDP2, each block one unit and the root (embeddings, final
    norm, tied head) another, on CUDA bf16 compute with fp32 master weights and gradient reduction;
    built on meta, rank 0 alone reads the weights and broadcasts them.

    FSDP2's reduce-scatter AVERAGES gradients over the ranks; the trainers want the sum (each
    rank's loss is its share of the global token mean), so they backpropagate loss x world."""
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
    register_fsdp_forward_method(model, "token_logprobs")  # not forward(): gather the root too
    # token_logprobs returns a view, which FSDP warns about; it is only used out of place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model.to_empty(device=device)
    full = (Transformer.from_pretrained(path, dtype=torch.float32).state_dict()
            if dist.get_rank() == 0 else {})
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    model.tie_weights()
    # FSDP sets itself up on the first forward through the root, and the sampler calls
    # model.hidden (no hooks): one tiny forward (a collective) settles it, then reshard
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long, device=device))
    model.reshard()
    return model


def start_sandbox(workers, require, rank):
    """Every rank starts its sandbox pool (workers 0: its share of the cores) before any rollout:
    one that cannot start stops the run with its error, instead of a dead tool for the run."""
    import sandbox
    sandbox.configure(workers or None, require)
    try:
        sandbox.check()
    except RuntimeError as e:
        raise SystemExit(f"rank {rank}: {e}") from None


def compute_dtype(device):
    """The dtype a trained model computes (and samples) in: bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def clip_grads(model, max_norm):
    """Clip the gradients' global norm to max_norm (0: no clipping) -> the norm before, a float."""
    limit = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor


# ---------------------------------------------------------------- several nodes
def host():
    return f"{socket.gethostname()}:{os.getcwd()}"


def _describe(path):
    """A file's size, a directory's file names and sizes; None when path is not there (a hub id,
    or a path the stage itself will refuse)."""
    if not path or not os.path.exists(path):
        return None
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sorted((n, os.path.getsize(os.path.join(path, n))) for n in os.listdir(path)
                  if os.path.isfile(os.path.join(path, n)))


def check_shared(out_dir, inputs):
    """Stop at start-up unless every rank sees what rank 0 sees: a file rank 0 writes into out_dir
    (every rank's checkpoint shards meet there), and each input path (data, model) with the same
    sizes; one line names each rank that cannot, and what. A collective."""
    if world_size() == 1:
        return
    rank = dist.get_rank()
    marker = os.path.join(out_dir, ".shared_check")
    token = f"{host()} {time.time_ns()}" if rank == 0 else None
    if rank == 0:
        with open(marker, "w") as f:  # out_dir: made by checkpoints.claim, which comes first
            f.write(token)
    token, seen = broadcast_object((token, [_describe(p) for p in inputs] if rank == 0 else None))
    try:
        with open(marker) as f:
            ok = f.read() == token
    except OSError:
        ok = False
    missing = [] if ok else [f"out_dir {out_dir} (rank 0's {marker} is not there)"]
    for path, theirs in zip(inputs, seen):
        if theirs is not None and _describe(path) != theirs:
            what = "missing" if not os.path.exists(path) else "not the same files as rank 0's"
            missing.append(f"{path} ({what})")
    report = all_gather_list([(rank, host(), missing)])
    if rank == 0:
        os.remove(marker)
    bad = [f"rank {r} ({where}) cannot see {', '.join(m)}" for r, where, m in report if m]
    if bad:
        raise SystemExit("; ".join(bad) + f"; rank 0 runs in {host()}: every node must see the "
                         f"same out_dir, data and model (a shared filesystem: README, More than "
                         f"one node)")


def weights_hash(path, samples=16, chunk=1 << 20):
    """A hash of a model directory's weight files: each one's size and `samples` MiB read at
    spread offsets (every weight of a trained model moves, so any sample tells two apart)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin")):
            file = os.path.join(path, name)
            size = os.path.getsize(file)
            h.update(f"{name} {size}".encode())
            with open(file, "rb") as f:
                for i in range(samples):
                    f.seek(size * i // samples)
                    h.update(f.read(chunk))
    return h.hexdigest()[:16]


def same_model(path):
    """path, once every rank names the same model and reads the same weights (else one line naming
    the ranks' paths and hashes). A collective."""
    if world_size() > 1:
        gather_group()  # made now, while the ranks are together (a collective)
    seen = all_gather_list([(path, weights_hash(path) if os.path.isdir(path) else None, host())])
    if len({(p, h) for p, h, _ in seen}) > 1:
        ranks = "; ".join(f"rank {r} ({where}): {p} (weights {h})"
                          for r, (p, h, where) in enumerate(seen))
        raise SystemExit(f"the ranks would evaluate different models: {ranks}; pass the same "
                         f"--model on a shared filesystem")
    return path


def world_advice(mini_batch, prompts_per_step, world):
    """What to change when mini_batch prompts do not split over `world` processes."""
    fits = [w for w in range(1, mini_batch + 1) if mini_batch % w == 0]
    updates = max(1, prompts_per_step // mini_batch)
    bigger = -(-mini_batch // world) * world  # the next multiple of world
    return (f"--mini_batch_prompts {mini_batch} is not a multiple of the {world} processes "
            f"(every rank holds part of every mini-batch): run {', '.join(map(str, fits))} "
            f"processes, or pass --mini_batch_prompts {bigger} --prompts_per_step "
            f"{bigger * updates} ({updates} updates a step as now)")
