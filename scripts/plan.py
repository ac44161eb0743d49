"""Whether an RL recipe fits the GPUs, answered on a CPU before the node is rented:

    python scripts/plan.py [--gpus 8] [--gpu_memory_gib 80] [--model data/configs/qwen3-4b.json]
                           [--attn flash|sdpa] [--outside_gib G] [--every_rank] [--sft]
                           [rl.py's (sft.py's) flags]

Builds the real model (from a Hugging Face dir or just its config.json; no weights are read) on the
meta device, shards it with FSDP2 as distributed.build_model does, and runs memory_plan.run_phases
(rl.py's own full_weights, a full-length prefill and the sampler, score_tokens, update with its
micro-batch and sync pattern, AdamW's step) for a simulated rank under torch's FakeTensorMode with
the "fake" process-group backend: nothing is allocated, FSDPMemTracker counts what would be. FSDP2
pads every shard to the same size, so rank 0's table is every rank's (--every_rank runs each).
Prints each phase's peak by kind (GiB), the KV pool that fits beside the largest phase as rl.py
sizes it (kv_memory_utilization x the GPU, less what torch does not hold: the CUDA context and
NCCL's buffers, memory_plan.OUTSIDE) in tokens and full-length sequences, then "fits" or what does
not; exits 1 when something does not fit. The defaults are the paper's recipe (rl.Config) on 8 x 80
GB. --sft plans sft.py's step instead (memory_plan.run_sft_phases: sft.forward_backward over two
packed micro-batches of micro_batch_tokens, AdamW's step; no KV pool).

Fake tensors carry shapes, not values: small host tensors (cu_seqlens, counts) keep theirs, every
other value the code reads back is 1. The plan counts tensors torch allocates; cuBLAS workspaces and
allocator fragmentation are outside it (utilization leaves them 10%).
"""
import argparse
import contextlib
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery import memory_plan  # noqa: E402
import rl  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

CONFIGS = os.path.join(ROOT, "data", "configs")
GIB = 2**30
# the tracker's kinds -> the table's columns
KINDS = {"Sharded Param": "params", "Unsharded Param": "params", "Buffer": "params",
         "All Gather": "params", "Sharded Grad": "grads", "Unsharded Grad": "grads",
         "Reduce Scatter": "grads", "OptState": "optimizer", "Activation": "activations",
         "Inputs": "activations", "Temp": "temporaries"}
COLUMNS = ("params", "grads", "optimizer", "activations", "temporaries")


def load_config(path):
    """ModelConfig from a Hugging Face dir or its config.json."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise SystemExit(f"--model {path}: no config.json there (a Hugging Face dir or the file)")
    with open(file) as f:
        return ModelConfig.from_dict(json.load(f), source=file)


def shard(config, dtype):
    """The model on the meta device, sharded as distributed.build_model shards it (each block one
    unit, the root another; compute in dtype, fp32 gradient reduction)."""
    from torch.distributed.fsdp import (MixedPrecisionPolicy, fully_shard,
                                        register_fsdp_forward_method)
    import warnings
    # as distributed.build_model: token_logprobs returns a view, only ever used out of place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    with torch.device("meta"):
        model = Transformer(config)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    register_fsdp_forward_method(model, "token_logprobs")
    return model


@contextlib.contextmanager
def fake_values():
    """FakeTensorMode where small host tensors keep their values (so cu_seqlens.tolist() works)
    and any other value read back is 1 (a step count, a norm, a loss: never a divisor of 0).
    DTensor finds an op's output shape by running it on global-shape fakes (the first call of
    each op and shape: clip_grad_norm_'s norms build an fp32 copy of every gradient) in the
    active fake mode, which would be this one, whose tensors the tracker counts; it gets a fake
    mode of its own here, as on a GPU, where nothing is allocated for it."""
    from torch._subclasses import fake_impls, fake_tensor
    from torch.distributed.tensor import _sharding_prop
    ops = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
    saved = {op: fake_impls.op_implementations_dict[op] for op in ops}
    limit, detect = fake_tensor.CONSTANT_NUMEL_LIMIT, _sharding_prop.detect_fake_mode

    def one(mode, func, arg):
        if arg.constant is not None:
            return arg.constant.item()
        return True if arg.dtype == torch.bool else 1.0 if arg.dtype.is_floating_point else 1

    fake_tensor.CONSTANT_NUMEL_LIMIT = 1 << 12
    fake_impls.op_implementations_dict.update({op: one for op in ops})
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        with fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = limit
        fake_impls.op_implementations_dict.update(saved)
        _sharding_prop.detect_fake_mode = detect


def track_phases(model, cfg, device, world, flash, opt=None):
    """{phase: {kind: peak bytes}} of memory_plan.run_phases (memory_plan.run_sft_phases for an
    sft.Config) under FSDPMemTracker (fake or real tensors alike: the test runs it both ways)."""
    import sft
    if isinstance(cfg, sft.Config):
        phases_of = functools.partial(memory_plan.run_sft_phases, sft=sft)
    else:
        phases_of = functools.partial(memory_plan.run_phases, rl=rl, flash=flash)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    opt = opt or memory_plan.probe_optimizer(model, cfg, foreach=True)   # AdamW's step on CUDA
    tracker, peaks, current = FSDPMemTracker(model, opt), {}, [None]

    def mark(name):
        if current[0]:
            snap = tracker.get_tracker_snapshot("peak")
            peaks[current[0]] = next(iter(snap.values())) if snap else {}
        current[0] = name
        tracker._peak_mem_snap = tracker.get_tracker_snapshot()   # the peak restarts here
        tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}

    def each_forward_anew(*args, **kwargs):
        # the tracker follows one forward per module, and only through the module hooks, which
        # FSDP's token_logprobs method skips: it runs as the root's forward here
        tracker.reset_mod_stats()
        return model(*args, **kwargs)

    fsdp_method = model.token_logprobs
    model.forward = Transformer.token_logprobs.__get__(model)
    model.token_logprobs = each_forward_anew
    try:
        with tracker:
            phases_of(model, opt, cfg, device, world, mark)
    finally:
        del model.forward
        model.token_logprobs = fsdp_method
    return {name: by_kind(snap) for name, snap in peaks.items()}


def by_kind(snap):
    out = dict.fromkeys(COLUMNS, 0)
    for kind, n in snap.items():
        name = getattr(kind, "value", kind)   # the tracker's enum, or "Total"
        if name in KINDS:
            out[KINDS[name]] += n
    out["total"] = snap.get("Total", sum(out.values()))
    return out


def plan_rank(config, cfg, rank, world, dtype, fake=True, flash=True):
    """One simulated rank's phases (a fresh fake process group for it). fake=False: the same on
    real CPU tensors (random weights), which tests/test_plan.py compares with the plan. flash:
    the GPU's rollout runs flash-attn (CUDA graphs), else SDPA."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        model = shard(config, dtype)   # on the meta device, outside the fake mode
        with fake_values() if fake else contextlib.nullcontext():   # one mode for both
            materialize(model, cfg, fake)
            phases = track_phases(model, cfg, torch.device("cpu"), world, flash)
    finally:
        dist.destroy_process_group()
    # the tracker files the weights rl.full_weights gathers (outside a module's forward) as
    # activations: every weight, in the compute dtype
    if gen := phases.get("generate"):
        gathered = min(gen["activations"], model.num_params() * dtype.itemsize)
        gen["params"], gen["activations"] = gen["params"] + gathered, gen["activations"] - gathered
    return phases


def materialize(model, cfg, fake, device="cpu"):
    """shard()'s model on the CPU (gpu_check.py: on CUDA): fake tensors, or real ones with random
    weights."""
    model.gradient_checkpointing = getattr(cfg, "activation_checkpointing",    # rl.Config
                                           getattr(cfg, "gradient_checkpointing", True))  # sft
    with torch.no_grad():
        model.to_empty(device=device)
        model.tie_weights()
        if not fake:
            for p in model.parameters():
                p.to_local().normal_(0.0, 0.02)
    return model


def verdict(phases, config, cfg, gpu_bytes, flash, dtype, outside):
    """(lines, fits): what is usable and the largest phase's need; for rl.py the KV pool beside
    it as rl.py sizes it (rollout.kv_budget: utilization x the GPU, less what torch does not hold,
    less the peak) and whether it holds a full-length sequence (sft.py: no pool, the same 0.9)."""
    share, rl_step = getattr(cfg, "kv_memory_utilization", 0.9), hasattr(cfg, "max_response_tokens")
    usable = int(gpu_bytes * share) - outside
    peak_name = max(phases, key=lambda k: phases[k]["total"])
    need = phases[peak_name]["total"]
    fits = need <= usable
    lines = [f"usable: {usable / GIB:.1f} GiB ({share} x {gpu_bytes / GIB:g} less "
             f"{outside / GIB:.1f} outside torch: the CUDA context, NCCL's buffers)",
             f"{'' if fits else 'does not fit: '}{peak_name} needs {need / GIB:.1f} GiB"
             + ("" if fits or not rl_step else ": no room for the KV pool")]
    if not (fits and rl_step):
        return lines, fits
    budget, full = usable - need, cfg.max_prompt_tokens + cfg.max_response_tokens
    tokens = memory_plan.kv_pool_tokens(config, budget, dtype, flash)
    lines.append(f"KV pool: {budget / GIB:.1f} GiB = {tokens} tokens = {tokens / full:.1f} "
                 f"full-length sequences ({full} tokens) beside {peak_name}'s peak")
    if tokens < full:
        lines.append(f"does not fit: the KV pool holds {tokens} tokens, less than one "
                     f"full-length sequence ({full}: max_prompt_tokens + max_response_tokens)")
    return lines, tokens >= full


def table(label, phases):
    """One row per phase: its peak by kind, GiB."""
    head = f"{'GiB':<12}" + "".join(f"{c:>12}" for c in COLUMNS + ("total",))
    rows = [label, head, "-" * len(head)]
    for name, kinds in phases.items():
        rows.append(f"{name:<12}" + "".join(f"{kinds[c] / GIB:>12.2f}"
                                            for c in COLUMNS + ("total",)))
    return "\n".join(rows)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--gpus", type=int, default=8, help="simulated ranks (one GPU each)")
    p.add_argument("--gpu_memory_gib", type=float, default=80.0, help="each GPU's memory")
    p.add_argument("--model", default=os.path.join(CONFIGS, "qwen3-4b.json"),
                   help="a Hugging Face dir or its config.json")
    p.add_argument("--attn", choices=("flash", "sdpa"), default="flash",
                   help="the GPU's rollout attention: flash-attn installed, or SDPA")
    p.add_argument("--sft", action="store_true",
                   help="plan sft.py's step (its flags; default the SFT recipe) instead of rl.py's")
    p.add_argument("--every_rank", action="store_true",
                   help="plan each rank in turn (default: rank 0, whose shards equal the others')")
    p.add_argument("--outside_gib", type=float, default=None,
                   help="what a GPU holds outside torch (CUDA context, NCCL; gpu_check.py "
                        "measures it); default: memory_plan.OUTSIDE's estimate")
    args, rest = p.parse_known_args(argv)
    if args.gpus < 1 or args.gpu_memory_gib <= 0 or (args.outside_gib or 0) < 0:
        raise SystemExit(f"--gpus {args.gpus} / --gpu_memory_gib {args.gpu_memory_gib} / "
                         f"--outside_gib {args.outside_gib}: expected at least 1 GPU, memory > 0 "
                         f"and outside >= 0")
    if args.sft:
        import sft
        return args, sft.parse_args(rest)
    return args, rl.parse_args(rest)


def main(argv=None):
    args, cfg = parse(sys.argv[1:] if argv is None else argv)
    t0, dtype = time.time(), torch.bfloat16
    config = load_config(args.model)
    full = 0 if args.sft else cfg.max_prompt_tokens + cfg.max_response_tokens
    alone = f" (a full-length sequence, {full}, alone in one)" * (full > cfg.micro_batch_tokens)
    print(f"plan: {args.model} ({config.num_hidden_layers} layers, hidden {config.hidden_size}) "
          f"on {args.gpus} x {args.gpu_memory_gib:g} GiB, {'sft.py' if args.sft else 'rl.py'}, "
          f"micro-batches {cfg.micro_batch_tokens} tokens{alone}, attention {args.attn}")
    fits, ranks = True, range(args.gpus if args.every_rank else 1)
    outside = memory_plan.outside_torch(args.gpus) if args.outside_gib is None else \
        int(args.outside_gib * GIB)
    for rank in ranks:
        phases = plan_rank(config, cfg, rank, args.gpus, dtype, flash=args.attn == "flash")
        lines, ok = verdict(phases, config, cfg, args.gpu_memory_gib * GIB, args.attn == "flash",
                            dtype, outside)
        label = f"rank {rank}"
        if args.gpus > 1 and not args.every_rank:
            label = f"ranks 0-{args.gpus - 1} (each alike)"
        print(table(label, phases) + "\n" + "\n".join(lines) + "\n", flush=True)
        fits = fits and ok
    print(f"{'fits' if fits else 'does NOT fit'} ({time.time() - t0:.0f} s)")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
