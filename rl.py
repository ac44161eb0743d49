"""rl.py: GRPO-TCR, the paper's agentic RL stage, written out in one file.

What it does
  Each step: take a batch of problems (64 prompts), roll out n = 16 agentic trajectories per
  problem with the current policy (rollout.py: reasoning, code-tool calls run in the sandbox,
  tool replies fed back), grade them (evaluate.py's graders), shape the rewards (+1 / -1
  correctness, the fraction of tests passed for code, the capped tool bonus for wrong
  answers, DAPO's overlong penalty), normalise within each problem's group (GRPO),
  recompute the old log-probs with the training forward, then run PPO updates on
  mini-batches of 16 prompts (4 optimizer steps per batch) with the GRPO-TCR loss:
  clip-higher (eps_low 0.2, eps_high 0.315), dual clip c = 10, token-mean over every
  response token of the mini-batch. Logs one metrics line per step, checkpoints atomically,
  evaluates on a held-out set every few steps.

  The sampler and the trainer are the same `model.Transformer` object, so there is no
  weight synchronisation at all: rollouts always use the weights the optimizer just wrote.

Departures from the paper (verl + SGLang on 8 GPUs)
  - One module samples and trains. Under FSDP2 the blocks are all-gathered once for the
    whole rollout (`full_weights`) and freed afterwards; see MEMORY PLAN below.
  - The paper's sampler returns log-probs from a different engine; ours come from the same
    code with a KV cache, so the sampler/trainer mismatch we log is only numerics
    (batching, cache) and the truncated-IS correction (`tis_cap`) is off by default.
  - A problem's n samples are rolled out on one rank, so its group is normalised where it
    was sampled; ranks exchange only per-trajectory scalars (rewards, lengths, tool stats)
    with all_gather_object for the metrics, and the token count for the loss
    normalisation. verl gathers the whole batch and rebalances tokens across ranks; here a
    rank trains on what it sampled (simple, no token data moves), at the price of some
    load imbalance when lengths differ a lot.
  - The tool bonus is written per tool call: min(-0.6, r + 0.1 * calls) for r < 0. The
    repo writes -1 + 0.05 * (turns - 2) with verl's turn count, which is 2 + 2 * calls.
    Tool calls whose JSON could not be parsed (status "bad_call") do not count, as verl's
    parser does not detect them.
  - Code: the fraction of tests passed when the final answer holds a parseable program,
    -1 when it holds none (as the repo's code_math.compute_score).
  - Dynamic sampling, when switched on, drops all-equal groups without re-sampling
    (DAPO re-samples to refill the batch; the paper leaves it off as too expensive).
  - The data order is a pure function of (seed, step): seeded permutations laid end to
    end over epochs. Resuming needs only the step.

MEMORY PLAN (Qwen3-4B, 8 x 80 GB, one node)
  4.02e9 parameters. Per GPU, FSDP2 over 8 ranks, fp32 master weights and AdamW state:
    sharded fp32 params 2.0 GB + grads 2.0 GB + Adam m, v 4.0 GB            =  8 GB
  Rollout: `full_weights` all-gathers every block in bf16 (MixedPrecisionPolicy
    param_dtype=bf16) once per step and keeps them for the whole generation:   +8 GB
  KV cache: 36 layers x 8 kv heads x 128 dims x 2 (k, v) x 2 bytes = 144 KiB per token.
    rollout.py's Engine takes 70% of the memory still free (80 - 16 GB): ~45 GB, ~300k
    tokens, i.e. all 128 trajectories of a rank (8 prompts x 16 samples) at 2.3k tokens
    each, or 13 at the full 22.5k budget; the paged cache admits trajectories as blocks free
    up and preempts (recomputes) the newest when it runs out.
  Update: bf16 compute, activation checkpointing per block, micro-batches of at most
    micro_batch_tokens = 23040 tokens (one full-length trajectory): saved block inputs
    36 x 23040 x 2560 x 2 B = 4.2 GB, one block's recompute ~1.5 GB, log-probs chunked so
    no [T, 151936] fp32 logits exist (model.token_logprobs): peak ~8 + 7 = ~15 GB.
  No optimizer or parameter offload is needed: 8 GB of state per GPU. The full weights
    are freed (reshard) before the update, so rollout and update peaks do not add up.
  Checkpoints gather a full state dict on rank 0's host (16 GB weights in fp32 + 32 GB
    Adam state), so rank 0's host needs ~50 GB free RAM at save time.
  These figures are computed, not measured; the only run so far is on CPU (gloo).

Distributed
  torchrun sets RANK / WORLD_SIZE / LOCAL_RANK: device = cuda:LOCAL_RANK (CPU with gloo
  when there is no GPU), problems are dealt by global rank, so `torchrun --nnodes N`
  needs no change. Tested: CPU, 1 and 2 processes (gloo). Not tested: GPUs, NCCL, more
  than one node. Each rank uses sandbox.py's process pool on its own node. Without
  torchrun the model is a plain module in float32 (the CPU path); on one GPU use
  `torchrun --nproc_per_node 1 rl.py ...` to get FSDP2's bf16 compute.
  A rank's micro-batch count is padded to the largest over ranks with empty micro-batches,
  because every FSDP forward and backward is a collective.
  Each problem of a step has its own sampler seed (problem_seed), so 1 and N processes
  sample the same trajectories -- once rollout.rollout takes per-problem `seeds`; until
  then one seed per rank's call is used and samples depend on the rank's share.

Commands
  python rl.py                                   # the toy CPU demo (issue 8), all defaults
  python rl.py --model runs/tiny --data problems.jsonl --steps 10      # one process
  torchrun --standalone --nproc_per_node 8 rl.py \\
      --model Gen-Verse/Qwen3-4B-RA-SFT --data data/rl.jsonl \\
      --eval_data data/eval/aime25.jsonl --out_dir runs/grpo_tcr          # the paper's recipe
  Ablations: --clip_higher=false --overlong=false  (GRPO-T);  --loss_agg=seq-mean-token-mean
  (GRPO-SCR).  Every field of Config is an option: --name=value or --name value; after
  torchrun, `rl.py -- --name=value` keeps torchrun from reading abbreviations of its own.
  With --model toy (the default) the TOY values below replace the recipe's defaults, and the
  start is sft.py's toy checkpoint: <out_dir>/../sft/final when `python sft.py` made one, else
  the one shipped in data/toy_sft (made by that same command), else (or with --toy_sft=train)
  sft.py's toy run first, ~10 more minutes.
"""

import ast
import json
import math
import os
import random
import shutil
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist


# -----------------------------------------------------------------------------
# hyperparameters (defaults: the paper's recipe, DESIGN.md; TOY below for `python rl.py`)


@dataclass
class Config:
    # what, where
    model: str = "toy"            # HF checkpoint dir or hub id; "toy" = the CPU demo (TOY below)
    toy_sft: str = "shipped"      # toy start: "shipped" (data/toy_sft) or "train" (sft.py now)
    data: str = "data/rl.jsonl"   # training problems, project jsonl
    eval_data: str = ""           # held-out problems, project jsonl ("" = no evaluation)
    out_dir: str = "runs/rl"
    resume: bool = True           # continue from out_dir's latest checkpoint if there is one
    seed: int = 0
    # schedule
    epochs: int = 3               # used when steps is 0: epochs * len(data) // prompts_per_step
    steps: int = 0
    prompts_per_step: int = 64
    samples_per_prompt: int = 16  # GRPO group size n
    mini_batch_prompts: int = 16  # one optimizer step per 16 prompts: 4 updates per batch
    ppo_epochs: int = 1           # passes over the batch
    micro_batch_tokens: int = 23040   # packed tokens per forward/backward (prompt + response budget)
    logprob_micro_batch_tokens: int = 92160  # the same for the no-grad old/ref log-prob pass
    # optimizer
    lr: float = 1e-6              # constant
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    # loss
    clip_low: float = 0.2
    clip_high: float = 0.315
    clip_higher: bool = True      # False: eps_high = eps_low (GRPO-T)
    clip_c: float = 10.0          # dual clip for negative advantages
    loss_agg: str = "token-mean"  # or "seq-mean-token-mean" (GRPO-SCR)
    entropy_coef: float = 0.0     # entropy bonus (0: none, as the paper)
    kl_coef: float = 0.0          # KL to the frozen start policy (0: none, no reference model)
    tis_cap: float = 0.0          # truncated importance sampling trainer/sampler (0: off)
    adv_eps: float = 1e-6
    # reward
    tool_bonus: bool = True       # wrong answers: min(tool_bonus_cap, r + tool_bonus_per_call * calls)
    tool_bonus_per_call: float = 0.1
    tool_bonus_cap: float = -0.6
    overlong: bool = True         # DAPO soft overlong punishment
    overlong_buffer: int = 4096
    overlong_factor: float = 1.0
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    code_test_timeout: float = 6.0
    score_workers: int = 8        # threads grading code answers (each runs tests in the sandbox)
    # rollout
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_tokens: int = 2560
    max_response_tokens: int = 20480  # tool-reply tokens count too
    max_turns: int = 16
    tool_output_chars: int = 256
    tool_timeout: float = 10.0
    tool_memory_mb: int = 1024
    # evaluation
    eval_every: int = 10          # steps (0: only before and after training)
    eval_n: int = 32
    eval_temperature: float = 1.0
    eval_top_p: float = 0.6
    eval_limit: int = 0           # first N held-out problems (0: all)
    # checkpoints and logging
    save_every: int = 30
    keep_checkpoints: int = 2
    log_samples: int = 1          # print this many trajectories per step (rank 0)
    # machine
    dtype: str = ""               # "" = bf16 compute with fp32 master weights on CUDA, fp32 on CPU
    activation_checkpointing: bool = True
    attn_backend: str = "auto"


# `python rl.py` with no arguments: the toy tool-use task on a tiny model, on a laptop CPU.
# Applied when --model is "toy" (the default), before the command-line options.
# Issue 8 owns these values.
TOY = dict(
    data="runs/toy/data/train.jsonl", eval_data="runs/toy/data/heldout.jsonl", out_dir="runs/toy/rl",
    epochs=1, steps=20, prompts_per_step=8, samples_per_prompt=8, mini_batch_prompts=4,
    micro_batch_tokens=8192, logprob_micro_batch_tokens=16384, lr=1e-4,
    max_prompt_tokens=512, max_response_tokens=384, max_turns=3, overlong_buffer=96,
    eval_every=0, eval_n=1, save_every=10, activation_checkpointing=False,
)


def parse_args(argv):
    """--name=value / --name value for every Config field ('-' and '_' alike); a bare --flag
    sets a bool. The toy preset applies under the options when the model is 'toy'."""
    types = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(Config)}
    given, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # torchrun ... rl.py -- --name=value (keeps torchrun off the options)
            i += 1
            continue
        if arg in ("-h", "--help"):
            print(__doc__)
            for f in fields(Config):
                print(f"  --{f.name}={f.default!r}")
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise SystemExit(f"unexpected argument {arg!r} (options look like --name=value)")
        key, eq, val = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in types:
            raise SystemExit(f"unknown option --{key}")
        if not eq:
            if types[key] == "bool" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                val = "true"
            elif i + 1 < len(argv):
                i, val = i + 1, argv[i + 1]
            else:
                raise SystemExit(f"option --{key} needs a value")
        given[key] = convert(key, types[key], val)
        i += 1
    preset = TOY if given.get("model", Config.model) == "toy" else {}
    return Config(**{**preset, **given})


def convert(key, type_name, val):
    try:
        if type_name == "bool":
            if val.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return val.lower() in ("1", "true", "yes")
        return {"int": int, "float": float, "str": str}[type_name](val)
    except ValueError:
        raise SystemExit(f"option --{key}: {val!r} is not a {type_name}")


# -----------------------------------------------------------------------------
# the pieces: advantages, rewards, the loss


def group_advantages(rewards, group_size, eps=1e-6):
    """GRPO: (r - group mean) / (group std + eps), std unbiased, one group per consecutive
    `group_size` rewards. rewards [G * n] -> advantages [G * n] (float32)."""
    r = torch.as_tensor(rewards, dtype=torch.float64).view(-1, group_size)   # [G, n]
    if group_size == 1:
        return torch.zeros(r.numel())
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    # exactly 0 for groups with nothing to compare: (r - mean) of equal floats is rounding
    # noise, divided by a std of rounding noise it is not small
    same = r.max(1, keepdim=True).values == r.min(1, keepdim=True).values
    return torch.where(same, torch.zeros_like(adv), adv).view(-1).float()


def overlong_penalty(length, max_len=20480, buffer=4096, factor=1.0):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer tokens, then linearly down to
    -factor at max_len. length counts every response token, tool replies included."""
    if buffer <= 0:
        return 0.0
    return min(-(length - (max_len - buffer)) / buffer * factor, 0.0) + 0.0  # + 0.0: no -0.0


def correctness_reward(kind, score, has_program=True):
    """+1 / -1 for math and multiple choice; for code the fraction of tests passed when the
    answer holds a program, -1 when it holds none (the paper's repo)."""
    if kind == "code":
        return float(score) if has_program else -1.0
    return 1.0 if score >= 1.0 else -1.0


def shape_reward(correctness, num_tool_calls, length, cfg):
    """The training reward of one trajectory: correctness, the capped tool bonus for wrong
    answers (paper Eq. 8: rewards trying the tool without ever beating a right answer), and
    the overlong penalty."""
    r = correctness
    if cfg.tool_bonus and r < 0:
        r = min(cfg.tool_bonus_cap, r + cfg.tool_bonus_per_call * num_tool_calls)
    if cfg.overlong:
        r += overlong_penalty(length, cfg.max_response_tokens, cfg.overlong_buffer, cfg.overlong_factor)
    return r


def grpo_tcr_loss(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.315, clip_c=10.0,
                  num_tokens=None, *, agg="token-mean", seq_ids=None, num_seqs=None, is_weights=None,
                  entropy=None):
    """The GRPO-TCR policy loss.

    logprobs, old_logprobs, mask: [B, T] (packed input: [1, N]); advantages broadcast to
    them ([B, 1] or [B, T]). num_tokens: the mask count of the whole mini-batch across
    micro-batches and ranks (None: this mask's count), so summing the losses of any split
    gives the loss of the whole. agg "seq-mean-token-mean" averages tokens within each
    sequence, then sequences (seq_ids [B, T] maps tokens to sequences 0..S-1, default the
    rows; num_seqs is then the global sequence count). is_weights: per-token importance
    weights (truncated IS), entropy: per-token entropy for the stats.

    Returns (loss, stats). stats are sums divided by num_tokens, so they too add up over
    micro-batches and ranks: clip fractions (high, low, dual), approximate KL(old || new),
    entropy.
    """
    mask = mask.to(logprobs.dtype)
    if num_tokens is None:
        num_tokens = mask.sum()
    num_tokens = max(float(num_tokens), 1.0)
    A = advantages
    ratio = torch.exp(logprobs - old_logprobs)                                   # [B, T]
    unclipped = -A * ratio
    clipped = -A * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)      # PPO: the pessimistic of the two
    # dual clip: for A < 0 a huge ratio would make -A * r unbounded; cap it at -A * c
    per_token = torch.where(A < 0, torch.minimum(per_token, -A * clip_c), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights

    if agg == "token-mean":
        loss = (per_token * mask).sum() / num_tokens
    elif agg == "seq-mean-token-mean":
        if seq_ids is None:
            seq_ids = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
        S = int(seq_ids.max()) + 1
        tok_sum = torch.zeros(S, dtype=per_token.dtype, device=mask.device).index_add(
            0, seq_ids.reshape(-1), (per_token * mask).reshape(-1))
        tok_cnt = torch.zeros(S, dtype=mask.dtype, device=mask.device).index_add(0, seq_ids.reshape(-1), mask.reshape(-1))
        if num_seqs is None:
            num_seqs = int((tok_cnt > 0).sum())
        loss = (tok_sum / tok_cnt.clamp(min=1)).sum() / max(num_seqs, 1)
    else:
        raise ValueError(f"loss_agg {agg!r}: expected 'token-mean' or 'seq-mean-token-mean'")

    with torch.no_grad():
        A_b = A.expand_as(ratio)
        def share(x):
            return (x.to(mask.dtype) * mask).sum() / num_tokens
        stats = {
            "clip_high": share((A_b > 0) & (ratio > 1 + clip_high)),
            "clip_low": share((A_b < 0) & (ratio < 1 - clip_low)),
            "clip_dual": share((A_b < 0) & (ratio > clip_c)),
            "approx_kl": share((ratio - 1) - (logprobs - old_logprobs)),  # k3 estimator, >= 0
        }
        if entropy is not None:
            stats["entropy"] = share(entropy)
    return loss, stats


# -----------------------------------------------------------------------------
# data


def load_problems(path):
    """Project-format problems; a malformed record stops the run with file and line."""
    import evaluate
    if not os.path.exists(path):
        raise SystemExit(f"{path}: training data not found")
    problems = evaluate.load_jsonl(path)
    if not problems:
        raise SystemExit(f"{path}: no problems")
    return problems


def batch_indices(step, batch, num_problems, seed):
    """The problem indices of `step`: seeded permutations, one per epoch, laid end to end.
    A pure function of (seed, step), so a resumed run sees exactly the same batches."""
    out, pos = [], step * batch
    while len(out) < batch:
        epoch, offset = divmod(pos, num_problems)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        take = torch.randperm(num_problems, generator=g)[offset:offset + batch - len(out)].tolist()
        out += take
        pos += len(take)
    return out


# -----------------------------------------------------------------------------
# distributed: FSDP2 for training, full weights for generation


def setup_distributed():
    """(rank, world, device). Under torchrun: one process per GPU (NCCL), or gloo on CPU."""
    if "RANK" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, device
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def distributed():
    return dist.is_available() and dist.is_initialized()


def shard_model(model, device):
    """FSDP2: each block is its own unit (all-gathered just before it runs), the root holds
    embeddings, final norm and the (tied) head. On CUDA the master weights stay fp32 and
    compute runs in bf16 (gradients reduced in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    kw = {"mp_policy": mp} if mp else {}
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    # FSDP hooks only forward(); the trainer calls token_logprobs, which bypasses it
    register_fsdp_forward_method(model, "token_logprobs")
    # FSDP sets itself up on the first forward through the root; the sampler calls
    # model.hidden (no hooks), which would make each block a root of its own. One tiny
    # forward here (a collective: every rank at once) settles it.
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long, device=device))
    model.reshard()  # the root keeps its weights gathered after a forward; the optimizer needs the shards
    return model


@contextmanager
def full_weights(model):
    """Generation needs every weight on every rank. Under FSDP2, all-gather each unit once
    for the whole rollout (instead of once per generated token) and keep it until the end;
    a plain module is already whole."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for u in units:
        u.set_reshard_after_forward(False)
        u.unshard()
    try:
        yield model
    finally:
        for u in units:
            u.reshard()
            u.set_reshard_after_forward(True)


def all_sum(values, device):
    """Sum a list of floats over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if distributed():
        dist.all_reduce(t)
    return t.tolist()


def all_max(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather_list(items):
    """Concatenate a list of picklable items over ranks, in rank order."""
    if not distributed():
        return list(items)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(items))
    return [x for part in parts for x in part]


# -----------------------------------------------------------------------------
# rollout and grading


class TimedSandbox:
    """sandbox.py with the seconds of every run added up, for the time breakdown."""

    def __init__(self, module):
        self.module, self.seconds, self.lock = module, 0.0, threading.Lock()

    def __getattr__(self, name):
        return getattr(self.module, name)

    def _add(self, results):
        with self.lock:
            self.seconds += sum(getattr(r, "seconds", 0.0) or 0.0 for r in results)

    def run(self, *args, **kwargs):
        result = self.module.run(*args, **kwargs)
        self._add([result])
        return result

    def run_many(self, *args, **kwargs):
        results = self.module.run_many(*args, **kwargs)
        self._add(results)
        return results

    def submit(self, *args, **kwargs):
        future = self.module.submit(*args, **kwargs)
        future.add_done_callback(lambda f: f.exception() is None and self._add([f.result()]))
        return future


def rollout_config(cfg, seed):
    import rollout
    return rollout.RolloutConfig(
        n=cfg.samples_per_prompt, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        max_prompt_tokens=cfg.max_prompt_tokens, max_response_tokens=cfg.max_response_tokens,
        max_turns=cfg.max_turns, tool_output_chars=cfg.tool_output_chars, tool_timeout=cfg.tool_timeout,
        tool_memory_mb=cfg.tool_memory_mb, seed=seed)


def has_program(text):
    """Does the final answer hold a parseable Python program (code problems)?"""
    import evaluate
    program = evaluate.extract_program(text)
    if not program or not program.strip():
        return False
    try:
        ast.parse(program)
        return True
    except (SyntaxError, ValueError):
        return False


def grade(problems, trajs, cfg):
    """Score every trajectory (code answers run their tests in the sandbox, concurrently) and
    turn it into a training sample: token ids, masks, reward."""
    import evaluate

    def one(t):
        p = problems[t.problem_index]
        score = evaluate.score(p, t.text, code_timeout=cfg.code_test_timeout)
        prog = has_program(t.text) if p["kind"] == "code" else True
        return score, correctness_reward(p["kind"], score, prog)

    with ThreadPoolExecutor(max(1, cfg.score_workers)) as pool:
        graded = list(pool.map(one, trajs))
    samples = []
    for t, (score, correct_r) in zip(trajs, graded):
        calls = [c for c in t.tool_calls if c.get("status") != "bad_call"]
        samples.append(dict(
            problem=t.problem_index, sample=t.sample_index,
            ids=list(t.prompt_ids) + list(t.response_ids), prompt_len=len(t.prompt_ids),
            mask=list(t.loss_mask), sampler_logprobs=list(t.logprobs),
            score=score, correct=score >= 1.0,
            reward=shape_reward(correct_r, len(calls), len(t.response_ids), cfg),
            tool_calls=len(t.tool_calls), tool_ok=sum(c.get("status") == "ok" for c in t.tool_calls),
            length=len(t.response_ids), finish=t.finish_reason, text=t.text))
    return samples


# -----------------------------------------------------------------------------
# training forward: packed micro-batches


def pack(samples, budget):
    """Greedy packing in order: lists of samples whose tokens fit `budget` (a longer sample
    goes alone)."""
    batches, cur, size = [], [], 0
    for s in samples:
        n = len(s["ids"]) - 1
        if cur and size + n > budget:
            batches.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    if cur:
        batches.append(cur)
    return batches


def micro_tensors(batch, device):
    """One packed sequence [1, N] from a list of samples: inputs, targets, cu_seqlens, the loss
    mask (response tokens the model sampled), per-token advantages, sampler log-probs and the
    index of each token's sample."""
    from model import cu_seqlens_from_lengths
    ids, tgt, mask, adv, slp, seq, lengths = [], [], [], [], [], [], []
    for k, s in enumerate(batch):
        n = len(s["ids"]) - 1        # position t predicts token t + 1
        pad = s["prompt_len"] - 1    # targets that are still prompt
        ids += s["ids"][:-1]
        tgt += s["ids"][1:]
        mask += [0] * pad + s["mask"]
        slp += [0.0] * pad + s["sampler_logprobs"]
        adv += [s.get("adv", 0.0)] * n
        seq += [k] * n
        lengths.append(n)
    t = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device)[None]   # [1, N]
    return dict(input_ids=t(ids, torch.long), targets=t(tgt, torch.long), mask=t(mask, torch.float32),
                adv=t(adv, torch.float32), sampler_logprobs=t(slp, torch.float32), seq_ids=t(seq, torch.long),
                cu_seqlens=cu_seqlens_from_lengths(lengths, device=device), lengths=lengths)


def dummy_sample():
    """Two tokens with no loss: ranks with fewer micro-batches run these, because FSDP's
    all-gathers and reduce-scatters need every rank in every forward and backward."""
    return dict(ids=[0, 0], prompt_len=1, mask=[0], sampler_logprobs=[0.0], adv=0.0, dummy=True)


def equal_count(batches, device):
    """Pad a rank's list of micro-batches to the longest list over ranks."""
    most = int(all_max([len(batches)], device)[0])
    return batches + [[dummy_sample()] for _ in range(most - len(batches))]


@torch.no_grad()
def score_tokens(model, samples, key, cfg, device, entropy=False):
    """Per-token log-probs of `model` on each sample's targets, stored in sample[key] (and the
    entropy in sample['entropy'])."""
    model.eval()
    for batch in equal_count(pack(samples, cfg.logprob_micro_batch_tokens), device):
        mb = micro_tensors(batch, device)
        out = model.token_logprobs(mb["input_ids"], mb["targets"], cu_seqlens=mb["cu_seqlens"],
                                   return_entropy=entropy, temperature=cfg.temperature)
        logp, ent = out if entropy else (out, None)
        for s, lp in zip(batch, logp[0].split(mb["lengths"])):
            s[key] = lp.float()
        if entropy:
            for s, e in zip(batch, ent[0].split(mb["lengths"])):
                s["entropy"] = e.float()


def cat_key(batch, key, device):
    return torch.cat([s[key].to(device) for s in batch])[None]


def update(model, opt, samples, num_tokens, num_seqs, cfg, device, world):
    """One optimizer step on this rank's share of a mini-batch. The loss of each micro-batch
    is divided by the mini-batch's global token count, so the accumulated gradient is the
    token-mean over the whole mini-batch however it is split. Returns summed stats."""
    model.train()
    opt.zero_grad(set_to_none=True)
    clip_high = cfg.clip_high if cfg.clip_higher else cfg.clip_low
    totals = {}
    want_ent = cfg.entropy_coef > 0
    for batch in equal_count(pack(samples, cfg.micro_batch_tokens), device):
        mb = micro_tensors(batch, device)
        out = model.token_logprobs(mb["input_ids"], mb["targets"], cu_seqlens=mb["cu_seqlens"],
                                   return_entropy=want_ent, temperature=cfg.temperature)
        logp, ent = out if want_ent else (out, None)
        dummy = batch[0].get("dummy", False)
        old = logp.detach() if dummy else cat_key(batch, "old_logprobs", device)
        is_w = None
        if cfg.tis_cap > 0:  # the sampler drew these tokens; correct towards the trainer's numbers
            is_w = torch.exp(old - mb["sampler_logprobs"]).clamp(max=cfg.tis_cap) * mb["mask"]
        # seq_ids are local to the micro-batch; num_seqs is the mini-batch's global count
        loss, stats = grpo_tcr_loss(logp, old, mb["adv"], mb["mask"], cfg.clip_low, clip_high, cfg.clip_c,
                                    num_tokens, agg=cfg.loss_agg, seq_ids=mb["seq_ids"], num_seqs=num_seqs,
                                    is_weights=is_w, entropy=ent)
        if want_ent:
            loss = loss - cfg.entropy_coef * stats["entropy"]
        if cfg.kl_coef > 0:
            ref = logp.detach() if dummy else cat_key(batch, "ref_logprobs", device)
            kl = torch.exp(ref - logp) - (ref - logp) - 1          # k3 estimate of KL(new || ref)
            kl_term = (kl * mb["mask"]).sum() / max(num_tokens, 1)
            loss = loss + cfg.kl_coef * kl_term
            stats["ref_kl"] = kl_term.detach()
        # FSDP averages gradients over ranks; the loss is already normalised globally
        (loss * world).backward()
        stats["loss"] = loss.detach()
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    keys = sorted(totals)
    summed = dict(zip(keys, all_sum([totals[k] for k in keys], device)))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    summed["grad_norm"] = float(grad_norm)
    return summed


# -----------------------------------------------------------------------------
# checkpoints: <out_dir>/checkpoints/step_000030/{model/ (HF dir + tokenizer), optimizer.pt, state.pt}


def checkpoint_dir(cfg):
    return os.path.join(cfg.out_dir, "checkpoints")


def latest_checkpoint(cfg):
    path = os.path.join(checkpoint_dir(cfg), "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    full = os.path.join(checkpoint_dir(cfg), name)
    return full if os.path.exists(os.path.join(full, "state.pt")) else None


def full_state(model, opt):
    """Full (unsharded) model and optimizer state dicts on rank 0's CPU (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, opt, options=options)


def save_checkpoint(model, opt, tokenizer, cfg, step, rank, extra):
    """Atomic: everything is written into step_N.tmp, renamed to step_N, then `latest` is
    replaced. A kill at any point leaves the previous checkpoint intact."""
    from model import Transformer
    weights, optim = full_state(model, opt)
    if rank != 0:
        return None
    root = checkpoint_dir(cfg)
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with torch.device("meta"):  # a plain module around the gathered tensors, to write the HF dir
        plain = Transformer(model.config)
    plain.load_state_dict(weights, assign=True, strict=False)
    if model.config.tie_word_embeddings:
        plain.lm_head.weight = plain.model.embed_tokens.weight
    plain.save_pretrained(os.path.join(tmp, "model"))
    tokenizer.save_pretrained(os.path.join(tmp, "model"))
    torch.save(optim, os.path.join(tmp, "optimizer.pt"))  # big (2x the fp32 weights): rank 0 reads it
    torch.save(dict(step=step, config=asdict(cfg), rng=rng_state(), **extra), os.path.join(tmp, "state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(os.path.basename(final))
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    old = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    for d in old[:-cfg.keep_checkpoints] if cfg.keep_checkpoints > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    return final


def load_optimizer(model, opt, path, rank):
    """Rank 0 reads the full optimizer state and FSDP scatters each rank its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    full = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False) if rank == 0 else {}
    set_optimizer_state_dict(model, opt, full, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=distributed()))


def rng_state():
    return dict(python=random.getstate(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(s):
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def problem_seed(seed, step, position):
    """The sampler's seed for the problem at `position` of step `step`'s batch: fixed by the run's
    seed, so a resumed step samples exactly what the interrupted one would have, and independent
    of which rank rolls it out, so 1 and N processes sample the same trajectories."""
    return zlib.crc32(f"rl:{seed}:{step}:{position}".encode()) % 2**31


def run_rollout(model, tokenizer, problems, seeds, cfg, sandbox):
    """rollout.rollout with one sampler seed per problem. Until rollout.py takes `seeds`, the
    seed of the first problem seeds the whole call (then samples depend on the rank's share)."""
    import inspect
    import rollout
    rcfg = rollout_config(cfg, seeds[0] if seeds else None)
    if "seeds" in inspect.signature(rollout.rollout).parameters:
        return rollout.rollout(model, tokenizer, problems, rcfg, sandbox=sandbox, seeds=seeds)
    return rollout.rollout(model, tokenizer, problems, rcfg, sandbox=sandbox)


# -----------------------------------------------------------------------------
# evaluation


def run_eval(model, tokenizer, problems, cfg, step):
    """Held-out accuracy with evaluate.py's protocol (temperature 1.0, top-p 0.6, n samples)."""
    import evaluate
    ecfg = evaluate.EvalConfig(
        n=cfg.eval_n, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p, top_k=cfg.top_k,
        max_prompt_tokens=cfg.max_prompt_tokens, max_response_tokens=cfg.max_response_tokens,
        max_turns=cfg.max_turns, tool_output_chars=cfg.tool_output_chars, tool_timeout=cfg.tool_timeout,
        tool_memory_mb=cfg.tool_memory_mb, code_test_timeout=cfg.code_test_timeout, seed=cfg.seed)
    out = os.path.join(cfg.out_dir, "eval", f"step_{step:06d}")
    model.eval()
    with full_weights(model):
        _, summary = evaluate.evaluate(model, tokenizer, problems, ecfg, out_dir=out, progress=False)
    overall = summary["overall"]
    tools = overall.get("tools", {})
    result = {"step": step, "accuracy": overall.get("headline"),
              "tool_calls_per_response": tools.get("tool_calls_per_response"),
              "tool_call_success": tools.get("tool_call_success"),
              "response_tokens": tools.get("response_tokens"), "summary": summary}
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


# -----------------------------------------------------------------------------
# the loop


def log(rank, *args):
    if rank == 0:
        print(*args, flush=True)


def resolve_model(path):
    """A local HF dir as is; a hub id is downloaded (huggingface_hub) into the local cache."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download
    return snapshot_download(path)


SHIPPED_TOY_SFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "toy_sft")


def toy_sft_start(cfg):
    """The toy SFT start that exists now, or None: a cached `python sft.py` run
    (<out_dir>/../sft/final), else the shipped one (data/toy_sft) unless --toy_sft=train."""
    cached = os.path.join(os.path.dirname(os.path.normpath(cfg.out_dir)), "sft", "final")
    candidates = [cached] + ([SHIPPED_TOY_SFT] if cfg.toy_sft == "shipped" else [])
    return next((p for p in candidates if os.path.exists(os.path.join(p, "config.json"))), None)


def write_toy_problems(cfg):
    """The toy RL and held-out problems the TOY preset points at, written when missing."""
    from data import toy
    if not (os.path.exists(cfg.data) and os.path.exists(cfg.eval_data)):
        toy.build(os.path.dirname(cfg.data), sft=False)


def prepare_toy(cfg, rank):
    """The toy demo's start (issue 8): `toy_sft_start`, else sft.py's toy run now (a tiny model
    from scratch taught the tool-call format on data/toy.py's trajectories, ~10 minutes on 2
    cores). The toy problems are written when missing."""
    import sft
    if cfg.toy_sft not in ("shipped", "train"):
        raise SystemExit(f"--toy_sft {cfg.toy_sft!r}: expected shipped or train")
    start = toy_sft_start(cfg)
    if start is None:
        sft_dir = os.path.join(os.path.dirname(os.path.normpath(cfg.out_dir)), "sft")
        start = sft.train(sft.toy_config(out_dir=sft_dir, seed=cfg.seed, progress=False))
    if rank == 0:
        write_toy_problems(cfg)
    if distributed():
        dist.barrier()
    return replace(cfg, model=start)


def build(cfg, rank, world, device):
    """Tokenizer, policy (sharded when distributed), optimizer, optional reference model."""
    from transformers import AutoTokenizer
    from model import Transformer
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = {"": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]

    def load(p):
        m = Transformer.from_pretrained(p, device=device, dtype=dtype)
        m.attn_backend = cfg.attn_backend
        m.gradient_checkpointing = cfg.activation_checkpointing
        return shard_model(m, device) if distributed() else m

    resume_from = latest_checkpoint(cfg) if cfg.resume else None
    model = load(os.path.join(resume_from, "model") if resume_from else path)
    ref = None
    if cfg.kl_coef > 0:  # the frozen start policy (not the resumed weights)
        ref = load(path)
        ref.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    return tokenizer, model, ref, opt, resume_from


def check_config(cfg, world):
    if cfg.prompts_per_step % cfg.mini_batch_prompts:
        raise SystemExit("prompts_per_step must be a multiple of mini_batch_prompts")
    if cfg.mini_batch_prompts % world:
        raise SystemExit(f"mini_batch_prompts ({cfg.mini_batch_prompts}) must be a multiple of the number "
                         f"of processes ({world}), so every rank holds part of every mini-batch")
    if cfg.loss_agg not in ("token-mean", "seq-mean-token-mean"):
        raise SystemExit(f"--loss_agg {cfg.loss_agg!r}: expected token-mean or seq-mean-token-mean")


def train(cfg):
    """Run GRPO-TCR as configured; returns the summary dict (also in out_dir/summary.json)."""
    import sandbox

    rank, world, device = setup_distributed() if not distributed() else (dist.get_rank(), dist.get_world_size(),
                                                                          current_device())
    check_config(cfg, world)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if cfg.model == "toy":
        cfg = prepare_toy(cfg, rank)
    problems = load_problems(cfg.data)
    eval_problems = load_problems(cfg.eval_data) if cfg.eval_data else []
    if cfg.eval_limit:
        eval_problems = eval_problems[:cfg.eval_limit]
    steps = cfg.steps or max(1, cfg.epochs * len(problems) // cfg.prompts_per_step)
    tokenizer, model, ref, opt, resume_from = build(cfg, rank, world, device)

    start, evals = 0, {}
    if resume_from:
        state = torch.load(os.path.join(resume_from, "state.pt"), weights_only=False)
        load_optimizer(model, opt, resume_from, rank)
        set_rng_state(state["rng"])
        start, evals = state["step"], state.get("evals", {})
        log(rank, f"resumed from {resume_from} at step {start}")
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        start_metrics(metrics_path, cfg, start)
    log(rank, f"rl: {len(problems)} problems, {steps} steps of {cfg.prompts_per_step} x {cfg.samples_per_prompt}, "
              f"world {world}, device {device}")

    if eval_problems and start == 0 and "before" not in evals:
        evals["before"] = run_eval(model, tokenizer, eval_problems, cfg, 0)
        log(rank, f"eval before: accuracy {evals['before']['accuracy']:.3f}")

    tsandbox = TimedSandbox(sandbox)
    for step in range(start, steps):
        t_step = time.time()
        times = {}
        # 1. the batch: this rank rolls out every world-th problem, so each mini-batch has
        # mini_batch_prompts / world problems on every rank
        batch = [problems[i] for i in batch_indices(step, cfg.prompts_per_step, len(problems), cfg.seed)]
        mine = list(range(rank, len(batch), world))
        t0, tsandbox.seconds = time.time(), 0.0
        model.eval()
        with full_weights(model):
            trajs = run_rollout(model, tokenizer, [batch[i] for i in mine],
                                [problem_seed(cfg.seed, step, i) for i in mine], cfg, tsandbox)
        times["rollout"], times["sandbox"] = time.time() - t0, tsandbox.seconds

        # 2. rewards and advantages (a problem's group is all on this rank)
        t0 = time.time()
        samples = grade([batch[i] for i in mine], trajs, cfg)
        for s in samples:
            s["problem"] = mine[s["problem"]]         # index within the global batch
        samples.sort(key=lambda s: (s["problem"], s["sample"]))
        adv = group_advantages([s["reward"] for s in samples], cfg.samples_per_prompt, cfg.adv_eps)
        for s, a in zip(samples, adv.tolist()):
            s["adv"] = a
        times["score"] = time.time() - t0
        everyone = all_gather_list([{k: v for k, v in s.items() if k not in ("ids", "mask", "sampler_logprobs", "text")}
                                    for s in samples])
        if cfg.dynamic_sampling:  # keep only groups with a signal
            samples = [s for s in samples if not group_equal(everyone, s["problem"])]

        # 3. old log-probs (and reference log-probs) with the training forward
        t0 = time.time()
        score_tokens(model, samples, "old_logprobs", cfg, device, entropy=True)
        if ref is not None:
            score_tokens(ref, samples, "ref_logprobs", cfg, device)
        times["old_logprob"] = time.time() - t0
        mismatch = sampler_mismatch(samples, device)

        # 4. PPO updates: one optimizer step per mini-batch of mini_batch_prompts problems
        t0 = time.time()
        kept = {s["problem"] for s in everyone} if not cfg.dynamic_sampling else \
            {s["problem"] for s in everyone if not group_equal(everyone, s["problem"])}
        upd = []
        for _ in range(cfg.ppo_epochs):
            for first in range(0, cfg.prompts_per_step, cfg.mini_batch_prompts):
                ids = set(range(first, first + cfg.mini_batch_prompts)) & kept
                part = [s for s in samples if s["problem"] in ids]
                num_tokens, num_seqs = all_sum([sum(sum(s["mask"]) for s in part), len(part)], device)
                if num_seqs == 0:
                    continue
                stats = update(model, opt, part, num_tokens, int(num_seqs), cfg, device, world)
                if not all(math.isfinite(v) for v in (stats["loss"], stats["grad_norm"])):
                    raise SystemExit(f"step {step + 1}: loss {stats['loss']} / grad norm {stats['grad_norm']} is not "
                                     f"finite; stopping before the optimizer step (last checkpoint: "
                                     f"{latest_checkpoint(cfg) or 'none'})")
                opt.step()
                upd.append(stats)
        times["update"] = time.time() - t0

        # 5. log
        record = step_metrics(step + 1, everyone, upd, mismatch, samples, device)
        record["time"] = {k: round(v, 3) for k, v in times.items()}
        t_save = time.time()
        # 6. evaluate and save
        last = step + 1 == steps
        if eval_problems and (last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
            res = run_eval(model, tokenizer, eval_problems, cfg, step + 1)
            evals["last"] = {k: v for k, v in res.items() if k != "summary"}
            record["eval"] = evals["last"]
            if last:
                evals["after"] = res
        if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            save_checkpoint(model, opt, tokenizer, cfg, step + 1, rank, {"evals": evals})
        record["time"]["eval_save"] = round(time.time() - t_save, 3)
        record["time"]["step"] = round(time.time() - t_step, 3)
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            print_step(record, samples, cfg)

    summary = write_summary(cfg, evals, steps, rank)
    if rank == 0:
        print(learning_curve(cfg.out_dir), flush=True)
        if "before" in summary and "after" in summary:
            b, a = summary["before"], summary["after"]
            show = lambda k: " -> ".join("n/a" if x[k] is None else f"{x[k]:.3f}" for x in (b, a))
            print(f"held-out accuracy {show('accuracy')}, tool calls per response "
                  f"{show('tool_calls_per_response')} ({cfg.out_dir}/summary.json)", flush=True)
    return summary


def current_device():
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_equal(everyone, problem):
    rewards = [s["reward"] for s in everyone if s["problem"] == problem]
    return max(rewards) == min(rewards)


def sampler_mismatch(samples, device):
    """|sampler log p - trainer log p| over the sampled tokens: mean, max, and the share of
    tokens whose ratio exp(trainer - sampler) is outside [0.9, 1.1]."""
    total = worst = outside = count = 0.0
    for s in samples:
        m = torch.tensor(s["mask"], dtype=torch.bool)
        trainer = s["old_logprobs"][s["prompt_len"] - 1:].cpu()[m]
        sampler = torch.tensor(s["sampler_logprobs"], dtype=torch.float32)[m]
        d = (trainer - sampler).abs()
        total += float(d.sum())
        worst = max(worst, float(d.max())) if d.numel() else worst
        ratio = torch.exp(trainer - sampler)
        outside += float(((ratio < 0.9) | (ratio > 1.1)).sum())
        count += d.numel()
    total, outside, count = all_sum([total, outside, count], device)
    worst = all_max([worst], device)[0]
    return {"mean": total / max(count, 1), "max": worst, "outside_0.9_1.1": outside / max(count, 1)}


def step_metrics(step, everyone, updates, mismatch, samples, device):
    n = len(everyone)
    calls = sum(s["tool_calls"] for s in everyone)
    ent_sum, ent_cnt = 0.0, 0.0
    for s in samples:
        m = torch.tensor(s["mask"], dtype=torch.float32)
        ent_sum += float((s["entropy"][s["prompt_len"] - 1:].cpu() * m).sum())
        ent_cnt += float(m.sum())
    ent_sum, ent_cnt = all_sum([ent_sum, ent_cnt], device)
    rec = {
        "step": step,
        "reward": sum(s["reward"] for s in everyone) / n,
        "accuracy": sum(s["correct"] for s in everyone) / n,
        "score": sum(s["score"] for s in everyone) / n,
        "tool_calls_per_traj": calls / n,
        "tool_call_success": sum(s["tool_ok"] for s in everyone) / calls if calls else None,
        "response_length": sum(s["length"] for s in everyone) / n,
        "response_length_max": max(s["length"] for s in everyone),
        "truncated": sum(s["finish"] == "length" for s in everyone) / n,
        "max_turns_hit": sum(s["finish"] == "max_turns" for s in everyone) / n,
        "groups_all_equal": group_share(everyone),
        "entropy": ent_sum / max(ent_cnt, 1),
        "mismatch_mean": mismatch["mean"], "mismatch_max": mismatch["max"],
        "mismatch_outside": mismatch["outside_0.9_1.1"],
        "updates": len(updates),
    }
    for k in ("loss", "clip_high", "clip_low", "clip_dual", "approx_kl", "ref_kl", "grad_norm"):
        vals = [u[k] for u in updates if k in u]
        if vals:
            rec[k] = sum(vals) / len(vals)
    if updates:
        rec["grad_norm_max"] = max(u["grad_norm"] for u in updates)
    return rec


def group_share(everyone):
    problems = sorted({s["problem"] for s in everyone})
    return sum(group_equal(everyone, p) for p in problems) / max(len(problems), 1)


def start_metrics(path, cfg, start):
    """A fresh run starts the file with its config; a resumed run drops lines past its step
    (written after the checkpoint it resumes from) and notes the resume."""
    lines = []
    if start and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line
                if "step" not in rec or rec["step"] <= start:
                    lines.append(json.dumps(rec) + "\n")
    else:
        lines.append(json.dumps({"config": asdict(cfg)}) + "\n")
    if start:
        lines.append(json.dumps({"resumed_at": start, "config": asdict(cfg)}) + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)


def print_step(rec, samples, cfg):
    t = rec["time"]
    print(f"step {rec['step']}: reward {rec['reward']:+.3f} acc {rec['accuracy']:.3f} "
          f"calls/traj {rec['tool_calls_per_traj']:.2f} len {rec['response_length']:.0f} "
          f"loss {rec.get('loss', 0):+.4f} gnorm {rec.get('grad_norm', 0):.3f} "
          f"clip h/l/d {rec.get('clip_high', 0):.3f}/{rec.get('clip_low', 0):.3f}/{rec.get('clip_dual', 0):.3f} "
          f"mismatch {rec['mismatch_mean']:.2e} | rollout {t['rollout']:.1f}s (sandbox {t['sandbox']:.1f}) "
          f"score {t['score']:.1f}s old-lp {t['old_logprob']:.1f}s update {t['update']:.1f}s "
          f"step {t['step']:.1f}s", flush=True)
    for s in samples[:cfg.log_samples]:
        print(f"  sample (reward {s['reward']:+.2f}): {s['text'][:300]!r}", flush=True)


def learning_curve(out_dir):
    """Reward, training accuracy and tool calls per trajectory by step, from metrics.jsonl:
    out_dir/learning_curve.png when matplotlib is installed (optional), and always as a table."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "step" in r]
    keys = ("reward", "accuracy", "tool_calls_per_traj")
    table = ["step  " + "  ".join(f"{k:>19}" for k in keys)]
    table += [f"{r['step']:>4}  " + "  ".join(f"{r[k]:>19.3f}" for k in keys) for r in rows]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n".join(table)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    titles = ("mean reward", "accuracy of the step's samples", "tool calls per trajectory")
    for ax, k, title in zip(axes, keys, titles):
        ax.plot([r["step"] for r in rows], [r[k] for r in rows])
        ax.set_xlabel("step")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "learning_curve.png"), dpi=100)
    plt.close(fig)
    return "\n".join(table)


def write_summary(cfg, evals, steps, rank):
    summary = {"steps": steps, "config": asdict(cfg)}
    for k in ("before", "after"):
        if k in evals:
            summary[k] = {key: v for key, v in evals[k].items() if key != "summary"}
    if rank == 0:
        with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        train(cfg)
    finally:
        if distributed():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
