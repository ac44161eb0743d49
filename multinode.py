"""multinode.py: what makes a run over several nodes (torchrun --nnodes N, Slurm) right, or stops
it in one line at start-up: every rank sees rank 0's out_dir and inputs, every rank evaluates the
same model, long per-rank work waits on a group of its own, `srun python` without torchrun is
refused. A first reading can skip it; the README ("More than one node") says how to launch."""

import hashlib
import os
import socket
import time

import torch.distributed as dist

from common import all_gather_list, broadcast_object, gather_group, world_size


def host():
    return f"{socket.gethostname()}:{os.getcwd()}"


def _describe(path):
    """What rank 0 sees at path, to compare: a file's size, a directory's file names and sizes;
    None when path is not there (a hub id, or a path the stage itself will refuse)."""
    if not path or not os.path.exists(path):
        return None
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sorted((n, os.path.getsize(os.path.join(path, n))) for n in os.listdir(path)
                  if os.path.isfile(os.path.join(path, n)))


def check_shared(out_dir, inputs):
    """Stop at start-up unless every rank sees what rank 0 sees: a file rank 0 writes into
    out_dir (checkpoint shards from every rank meet there), and each input path (data, model)
    with the same sizes. One line names each rank that cannot see something, and what. A
    collective; nothing in a world of one."""
    if world_size() == 1:
        return
    rank = dist.get_rank()
    marker = os.path.join(out_dir, ".shared_check")
    token = f"{host()} {time.time_ns()}" if rank == 0 else None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(marker, "w") as f:
            f.write(token)
    token, seen = broadcast_object((token, [_describe(p) for p in inputs] if rank == 0 else None))
    missing = []
    try:
        with open(marker) as f:
            ok = f.read() == token
    except OSError:
        ok = False
    if not ok:
        missing.append(f"out_dir {out_dir} (rank 0's {marker} is not there)")
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
    """path on every rank, after checking that every rank names the same model and reads the same
    weights (else one line naming the ranks' paths and hashes). A collective."""
    if world_size() > 1:
        gather_group()  # made now, while the ranks are together (a collective)
    seen = all_gather_list([(path, weights_hash(path) if os.path.isdir(path) else None, host())])
    if len({(p, h) for p, h, _ in seen}) > 1:
        ranks = "; ".join(f"rank {r} ({where}): {p} (weights {h})"
                          for r, (p, h, where) in enumerate(seen))
        raise SystemExit(f"the ranks would evaluate different models: {ranks}; pass the same "
                         f"--model on a shared filesystem")
    return path


def gather_objects(obj):
    """Every rank's obj in rank order, on a gloo group with a long timeout (common.gather_group):
    for gathers after long per-rank work, which the training timeout would cut short. A
    collective."""
    if world_size() == 1:
        return [obj]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj, group=gather_group())
    return parts


def world_advice(mini_batch, prompts_per_step, world):
    """What to change when mini_batch prompts do not split over `world` processes."""
    fits = [w for w in range(1, mini_batch + 1) if mini_batch % w == 0]
    updates = max(1, prompts_per_step // mini_batch)
    bigger = -(-mini_batch // world) * world  # the next multiple of world
    return (f"--mini_batch_prompts {mini_batch} is not a multiple of the {world} processes "
            f"(every rank holds part of every mini-batch): run {', '.join(map(str, fits))} "
            f"processes, or pass --mini_batch_prompts {bigger} --prompts_per_step "
            f"{bigger * updates} ({updates} updates a step as now)")
