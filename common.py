"""common.py: what every stage shares: one flag parser, distributed set-up, rank-0 printing,
metrics files that survive a resume, atomic checkpoint directories, hub-id resolution."""

import argparse
import json
import os
import shutil
from dataclasses import asdict, fields
from datetime import timedelta

import torch
import torch.distributed as dist

# Long enough for a rollout of 64 x 16 trajectories of 20k tokens, or rank 0 writing a 4B
# checkpoint, while the other ranks wait in a collective.
DIST_TIMEOUT = timedelta(hours=2)


def _bool(text):
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes")


def parse_config(cls, argv, doc="", presets=None):
    """A `cls` dataclass from --name value / --name=value flags ('-' and '_' alike; a bare bool
    flag means true). presets: {name: {field: value}}; `--preset NAME` sets those defaults under
    the explicit flags. `--` (torchrun's separator) is skipped; --help lists every default."""
    argv = [a for a in argv if a != "--"]
    values = {}
    if presets:
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--preset", choices=sorted(presets))
        known, _ = pre.parse_known_args(argv)
        values = dict(presets.get(known.preset) or {})
    p = argparse.ArgumentParser(description=doc, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if presets:
        p.add_argument("--preset", choices=sorted(presets), help="named preset of defaults")
    for f in fields(cls):
        default = values.get(f.name, f.default)
        names = sorted({f"--{f.name}", f"--{f.name.replace('_', '-')}"})
        kind = type(f.default)
        if kind is bool:
            p.add_argument(*names, dest=f.name, type=_bool, nargs="?", const=True, default=default,
                           help=f"(default: {default})")
        else:
            p.add_argument(*names, dest=f.name, type=kind, default=default, help=f"(default: {default!r})")
    args = vars(p.parse_args(argv))
    args.pop("preset", None)
    return cls(**args)


def setup_distributed(device="auto"):
    """(rank, world, device, under_torchrun). Always leaves a process group behind (a world of
    one when not under torchrun), so collectives and barriers are the same code in both cases."""
    if dist.is_initialized():
        cuda = dist.get_backend() == "nccl"
    else:
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=DIST_TIMEOUT)
        else:
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    return dist.get_rank(), dist.get_world_size(), dev, "RANK" in os.environ


def print0(*args):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def resolve_model(path):
    """A local directory as is; a hub id is downloaded by rank 0 first, then read from the cache."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download
    local = snapshot_download(path) if dist.get_rank() == 0 else None
    dist.barrier()
    return local or snapshot_download(path, local_files_only=True)


def check_resume(saved, current, fields_that_matter, allow):
    """Refuse to resume a run whose saved config differs in a field that changes the data order
    or the schedule, naming it, unless `allow` (the --resume_override flag)."""
    for name in fields_that_matter:
        if saved.get(name) != current.get(name) and not allow:
            raise SystemExit(f"--resume: {name} is {current.get(name)!r} but the checkpoint was made with "
                             f"{saved.get(name)!r}; pass --resume_override=true to continue anyway")


class Metrics:
    """out_dir/metrics.jsonl on rank 0. A resumed run first drops the lines past its step (written
    after the checkpoint it resumes from), so no step appears twice."""

    def __init__(self, path, config, step=0):
        self.path = path if (not dist.is_initialized() or dist.get_rank() == 0) else None
        if self.path is None:
            return
        kept = []
        if step and os.path.exists(path):
            for line in open(path):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by the kill
                if rec.get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        self.log(event="resume" if step else "start", step=step, config=asdict(config))

    def log(self, **record):
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def replace_dir(tmp, final):
    """Move a finished directory into place: a kill at any moment leaves the old or the new one."""
    if os.path.exists(final):
        os.rename(final, final + ".old")
    os.rename(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)


def save_hf(state, config, tokenizer, path, dtype=None, base_path=None):
    """A gathered full state dict -> a Hugging Face checkpoint directory (rank 0 only)."""
    from model import Transformer
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    (model.to(dtype) if dtype else model).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if base_path and os.path.exists(os.path.join(base_path, "generation_config.json")):
        shutil.copy(os.path.join(base_path, "generation_config.json"), path)
