"""common.py: what every stage shares: one flag parser, distributed set-up, rank-0 printing,
metrics files that survive a resume, one checkpoint writer and reader, hub-id resolution."""

import argparse
import contextlib
import inspect
import io
import json
import os
import random
import secrets
import shutil
import tokenize
import warnings
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


def _field_comments(cls):
    """field -> the comment on its line in the class source (what --help says of it); {} without source."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    return {lines[t.start[0] - 1].split(":")[0].strip(): t.string.lstrip("# ").replace("%", "%%")
            for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}


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
        kind = dict(type=_bool, nargs="?", const=True) if type(f.default) is bool else dict(type=type(f.default))
        help_text = f"{comments.get(f.name, '')} (default: {default!r})".lstrip()
        p.add_argument(*names, dest=f.name, default=default, help=help_text, **kind)
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
        alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=DIST_TIMEOUT, **alone)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    return dist.get_rank(), dist.get_world_size(), dev, "RANK" in os.environ


@contextlib.contextmanager
def distributed(device="auto"):
    """setup_distributed() for a with block. Leaving it normally, every rank waits for the others
    first (gloo aborts a rank whose peer tears the group down before it); a group made here is then
    destroyed. An exception skips the wait: a failing rank must not hang on its peers."""
    created = not dist.is_initialized()
    info = setup_distributed(device)
    try:
        yield info
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()


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
    """out_dir/metrics.jsonl on rank 0 (path None: no file; out_dir: where wandb writes). A resumed run first
    drops the lines past its step (written after the checkpoint it resumes from), so no step appears twice.
    With config.wandb_project set, rank 0 also logs to Weights & Biases: the config once, every line's numbers
    under the same names ("time": {"rollout": s} as time/rollout), the final summary; a resumed run continues
    the same wandb run."""

    def __init__(self, path, config, step=0, out_dir=None):
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.path, self.wandb = path if rank0 else None, None
        if rank0 and getattr(config, "wandb_project", ""):
            self.wandb = start_wandb(config, out_dir or os.path.dirname(path), step)
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
        numbers = flat_numbers({k: v for k, v in record.items() if k not in ("step", "config")})
        if self.wandb and numbers:
            self.wandb.log(numbers, step=record.get("step", 0))

    def finish(self, summary=None):
        """The run's summary into wandb (its numbers), and the wandb run closed."""
        if self.wandb:
            self.wandb.summary.update(flat_numbers(summary or {}))
            self.wandb.finish()
            self.wandb = None


def flat_numbers(record, prefix=""):
    """{"time": {"rollout": 1.5}, "event": "step"} -> {"time/rollout": 1.5}: the numbers, nested names joined by /."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flat_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):  # bools too; strings and None are not plotted
            out[prefix + key] = value
    return out


def start_wandb(config, out_dir, step):
    """wandb.init on rank 0: project config.wandb_project, name config.wandb_run; the run's id kept in
    out_dir/wandb_run_id, so a resumed run (step > 0) continues the same wandb run."""
    try:
        import wandb
    except ImportError:
        raise SystemExit("--wandb_project needs the wandb package: pip install wandb") from None
    id_file = os.path.join(out_dir, "wandb_run_id")
    run_id = open(id_file).read().strip() if step and os.path.exists(id_file) else secrets.token_hex(4)
    os.makedirs(out_dir, exist_ok=True)
    with open(id_file, "w") as f:
        f.write(run_id)
    return wandb.init(project=config.wandb_project, name=getattr(config, "wandb_run", "") or None, id=run_id,
                      resume="allow", dir=out_dir, config=asdict(config))


def checkpoints(out_dir, resumable=False):
    """[(step, path)] of the complete checkpoints in out_dir, oldest first."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted((int(n[5:]), os.path.join(out_dir, n)) for n in names if n.startswith("step_") and n[5:].isdigit()
                  and (not resumable or os.path.exists(os.path.join(out_dir, n, "train_state", "trainer.pt"))))


def latest_resumable(out_dir):
    """Rank 0's newest resumable checkpoint, the same on every rank (None when there is none).
    Every rank then reads its shard from it: with --nnodes > 1, out_dir must be on a shared filesystem."""
    found = [checkpoints(out_dir, resumable=True)[-1:] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    return found[0][0][1] if found[0] else None


def build_model(path, device, sharded):
    """A model to train. One CPU process: the checkpoint as is, in fp32. Under torchrun, and on CUDA always (one
    process too: fp32 GQA attention has no fused SDPA kernel, a 20k-token sequence would materialise [heads, T, T]
    scores): FSDP2 with each block one unit and the root (embeddings, final norm, tied head) another; on CUDA bf16
    compute with fp32 master weights and gradient reduction. Rank 0 alone reads the weights and broadcasts them
    into the sharded model, built on the meta device (no rank holds a full fp32 copy but rank 0)."""
    from model import ModelConfig, Transformer
    if not (sharded or device.type == "cuda"):
        return Transformer.from_pretrained(path, device=device, dtype=torch.float32)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    with open(os.path.join(path, "config.json")) as f:
        config = ModelConfig.from_dict(json.load(f))
    with torch.device("meta"):
        model = Transformer(config)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype(device), reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    register_fsdp_forward_method(model, "token_logprobs")  # not forward(): gather the root's weights around it
    # token_logprobs returns a view; FSDP warns about in-place use of it, and it is only used out of place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model.to_empty(device=device)
    full = Transformer.from_pretrained(path, dtype=torch.float32).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    model.tie_weights()
    # FSDP sets itself up on the first forward through the root; the sampler calls model.hidden
    # (no hooks), so one tiny forward (a collective) settles it, then the root gives back its weights
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long, device=device))
    model.reshard()
    return model


def start_sandbox(workers, require, rank):
    """Every rank starts its sandbox pool (workers 0: its share of the cores) and waits for it before any rollout:
    a sandbox that cannot start stops the run with its own error, instead of a dead tool for the whole run."""
    import sandbox
    sandbox.configure(workers or None, require)
    try:
        print0(sandbox.check())
    except RuntimeError as e:
        raise SystemExit(f"rank {rank}: {e}") from None


def compute_dtype(device):
    """The dtype a trained model computes (and samples) in: bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def clip_grads(model, max_norm):
    """Clip the gradients' global norm to max_norm (0: no clipping); returns the norm before, a float
    (under FSDP2 clip_grad_norm_ returns a DTensor)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def save_checkpoint(out_dir, step, model, optimizer, tokenizer, trainer, base_path=None, dtype=None, keep=1):
    """out_dir/step_NNNNNN: a Hugging Face directory (full weights gathered on rank 0's CPU) plus
    train_state/ (fp32 weights and optimizer sharded by torch.distributed.checkpoint, each rank's
    RNG, the trainer dict). Written into .tmp_step_NNNNNN and renamed once complete, so a kill
    leaves the previous checkpoint; out_dir/final then points at it. Only the newest `keep`
    checkpoints keep their train_state. A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from model import Transformer
    rank = dist.get_rank()
    name = f"step_{step:06d}"
    final, tmp = os.path.join(out_dir, name), os.path.join(out_dir, ".tmp_" + name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "train_state"))
    dist.barrier()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # the Hugging Face directory: the gathered weights assigned into a model built on meta
        with torch.device("meta"):
            hf = Transformer(model.config)
        hf.load_state_dict(full, assign=True, strict=False)
        hf.tie_weights()
        (hf.to(dtype) if dtype else hf).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if base_path and os.path.exists(os.path.join(base_path, "generation_config.json")):
            shutil.copy(os.path.join(base_path, "generation_config.json"), tmp)
    del full
    weights, optim = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optim": optim}, checkpoint_id=os.path.join(tmp, "train_state", "dcp"))
    torch.save(dict(python=random.getstate(), torch=torch.get_rng_state(),
                    cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None),
               os.path.join(tmp, "train_state", f"rng_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        torch.save(dict(trainer, step=step), os.path.join(tmp, "train_state", "trainer.pt"))  # last: marks it complete
        if os.path.exists(final):  # re-saving a step: move the old one aside first (renames are atomic)
            os.rename(final, final + ".old")
        os.rename(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        for _, old in checkpoints(out_dir, resumable=True)[:-max(1, keep)]:
            shutil.rmtree(os.path.join(old, "train_state"), ignore_errors=True)
        link = os.path.join(out_dir, ".final.tmp")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(name, link)
        os.replace(link, os.path.join(out_dir, "final"))
    dist.barrier()  # nobody reads or resumes before rank 0 has finished writing
    return final


def load_checkpoint(path, model, optimizer):
    """Restore what save_checkpoint wrote into the live (possibly sharded) model and optimizer
    and this rank's RNG; returns the trainer dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    weights, optim = get_state_dict(model, optimizer)
    state = {"model": weights, "optim": optim}
    dcp.load(state, checkpoint_id=os.path.join(path, "train_state", "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = os.path.join(path, "train_state", f"rng_rank{dist.get_rank()}.pt")
    if os.path.exists(rng):  # absent when resuming on more ranks than were saved
        rng = torch.load(rng, weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return torch.load(os.path.join(path, "train_state", "trainer.pt"), weights_only=False)

