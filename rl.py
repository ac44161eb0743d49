"""rl.py: GRPO-TCR, the paper's agentic RL stage, in one file.

Each step: 64 problems x 16 agentic trajectories with the current policy (rollout.py), graded by
evaluate.py, rewarded (shape_reward), normalised per group (GRPO), old log-probs from the training
forward, then PPO updates on mini-batches of 16 problems with the GRPO-TCR loss (grpo_tcr_loss).
The sampler runs the trained module itself (docs/DESIGN.md). Writes out_dir/metrics.jsonl (and
wandb), trajectories/, eval/ and checkpoints (HF dirs plus exact resume state) step_NNNNNN/.

    python rl.py                                     # the toy preset: the CPU demo
    python rl.py --model DIR --data problems.jsonl --steps 10
    torchrun --standalone --nproc_per_node 8 rl.py -- --model Gen-Verse/Qwen3-4B-RA-SFT \\
        --data data/rl.jsonl --eval_data data/eval/aime25.jsonl --out_dir runs/grpo_tcr
    Ablations: --clip_higher=false --overlong=false (GRPO-T); --loss_agg=seq-mean-token-mean.

Departures from the paper's run (verl + SGLang):
- exact global token-mean over the mini-batch (verl weights each micro-batch's mean by its size);
- a problem's group is rolled out, normalised and trained on one rank (no token rebalancing);
- a bad tool call (bad JSON, unknown tool, no code) is answered with an error text; verl drops it;
- tool runs 10 s / 1024 MB and tests 6 s (the recipe: 30 s / 2048 MB and 30 s);
- clip_high 0.315 as the paper's text; the released script has 0.28;
- the reward's tool-call term (paper Eq. 8) is applied; upstream's runs never did (no num_turns: a
  flat -1.1 for every wrong answer, Open-AgentRL issue 13); --tool_bonus=false is closest (-1);
- dynamic sampling (off by default) drops all-equal groups without re-sampling to refill.
"""

import ast
import json
import math
import os
import random
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import evaluate
import rollout
import sandbox
from data import toy
from machinery import flags, memory_plan
from machinery.checkpoints import (check_resume, claim, latest_resumable, load_checkpoint,
                                   save_checkpoint)
from machinery.distributed import (all_gather_list, all_reduce, allocator_defaults,
                                   broadcast_object, build_model, check_shared, clip_grads,
                                   compute_dtype, distributed, gather_group, gather_objects,
                                   print0, resolve_model, start_sandbox, world_advice)
from machinery.exits import exit_worker, quiet_interrupt, resume_line
from machinery.run_log import Metrics, learning_curve, print_step, step_metrics, write_trajectories
from model import DTYPES, attention_path, cu_seqlens_from_lengths


@dataclass
class Config:  # defaults: the paper's recipe (docs/DESIGN.md: the source of each)
    model: str = "Gen-Verse/Qwen3-4B-RA-SFT"  # HF dir or hub id; "toy": the toy SFT start
    data: str = "data/rl.jsonl"
    eval_data: str = ""            # held-out problems ("": no evaluation)
    out_dir: str = "runs/rl"
    resume: bool = True            # continue from out_dir's newest checkpoint if there is one
    resume_override: bool = False  # resume even if the data order / batch fields changed
    seed: int = 0
    epochs: int = 3                # used when steps is 0
    steps: int = 0
    prompts_per_step: int = 64
    samples_per_prompt: int = 16   # the GRPO group size
    mini_batch_prompts: int = 16   # one optimizer step per 16 problems: 4 per batch
    ppo_epochs: int = 1
    micro_batch_tokens: int = 23040          # packed tokens per forward/backward
    logprob_micro_batch_tokens: int = 92160  # the same for the no-grad log-prob passes
    lr: float = 1e-6               # constant
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0         # 0: no clipping (the norm is still logged)
    clip_low: float = 0.2
    clip_high: float = 0.315
    clip_higher: bool = True       # False: clip_high = clip_low (GRPO-T)
    clip_c: float = 10.0           # dual clip for negative advantages
    loss_agg: str = "token-mean"   # or "seq-mean-token-mean"
    entropy_coef: float = 0.0      # entropy bonus (none in the recipe)
    kl_coef: float = 0.0           # KL to the frozen start policy (none in the recipe)
    tis_cap: float = 0.0           # truncated importance sampling towards the sampler (0: off)
    adv_eps: float = 1e-6
    tool_bonus: bool = True        # wrong answers: min(cap, r + per_turn x tool turns)
    tool_bonus_per_turn: float = 0.1
    tool_bonus_cap: float = -0.6
    overlong: bool = True          # DAPO's soft overlong punishment
    overlong_buffer: int = 4096
    overlong_factor: float = 1.0
    dynamic_sampling: bool = False
    code_test_timeout: float = 6.0
    score_workers: int = 8         # threads grading answers (code runs its tests in the sandbox)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_tokens: int = 2560  # longer prompts are filtered out at load time
    max_response_tokens: int = 20480  # tool-reply tokens count too
    max_turns: int = 16
    max_parallel_calls: int = 1    # tool calls run per assistant turn (verl drops the rest)
    tool_output_chars: int = 256
    tool_timeout: float = 10.0
    tool_memory_mb: int = 1024
    sandbox_workers: int = 0       # this rank's sandbox processes (0: its share of the cores)
    sandbox_require: str = "default"  # default: a uid of the run's own or Landlock | floor | all
    enable_thinking: str = "default"  # the template's switch (Qwen3 hybrid): default|true|false
    eval_every: int = 10           # steps (0: only before and after training)
    eval_n: int = 32
    eval_temperature: float = 1.0
    eval_top_p: float = 0.6
    eval_limit: int = 0            # first N held-out problems (0: all)
    save_every: int = 30
    keep_checkpoints: int = 1      # newest checkpoints that keep their resume state
    log_samples: int = 1           # trajectories printed per step
    activation_checkpointing: bool = True
    attn_backend: str = "auto"     # auto (flash-attn if it imports, CUDA) | sdpa | flash
    kv_memory_utilization: float = 0.9  # CUDA: share of the GPU the KV pool and trainer may fill
    save_dtype: str = "auto"       # saved HF weights: auto (the base's) | float32 | bfloat16
    save_trajectories: int = 1     # whole groups kept per step in out_dir/trajectories (0: none)
    wandb_project: str = ""        # log to Weights & Biases under this project ("": off)
    wandb_run: str = ""            # the wandb run's name ("": wandb's own)
    dist_timeout: float = 30.0     # minutes a rank waits in a collective (a stuck node)


# `python rl.py`: the toy tool-use task (data/toy.py) from the shipped SFT start, on a laptop CPU
TOY = dict(model="toy", data=toy.TRAIN, eval_data=toy.HELDOUT, out_dir=os.path.join(toy.ROOT, "rl"),
           epochs=1, steps=20, prompts_per_step=8, samples_per_prompt=8, mini_batch_prompts=4,
           micro_batch_tokens=8192, logprob_micro_batch_tokens=16384, lr=1e-4, overlong_buffer=96,
           eval_every=0, save_every=10, activation_checkpointing=False, eval_n=toy.EVAL["n"],
           eval_temperature=toy.EVAL["temperature"], eval_top_p=toy.EVAL["top_p"], **toy.LIMITS)
RESUME_FIELDS = ("data", "seed", "epochs", "steps", "prompts_per_step", "samples_per_prompt",
                 "mini_batch_prompts")


def parse_args(argv):
    cfg = flags.parse_config(Config, argv, __doc__, presets={"toy": TOY})
    named = flags.named(argv)
    if "epochs" in named:  # the toy preset counts in steps: an explicit --epochs is obeyed
        flags.rule("steps" not in named or cfg.steps == 0, "epochs", cfg.epochs,
                   "counts only when --steps is 0; pass one of the two")
        cfg.steps = 0
    return cfg


def check(cfg):  # every flag before anything is loaded or written: one line on a bad value
    flags.ranges(cfg, {
        ">= 0": "seed steps weight_decay grad_clip clip_high entropy_coef kl_coef tis_cap adv_eps "
                "tool_bonus_per_turn overlong_buffer overlong_factor eval_every eval_temperature "
                "eval_limit save_every log_samples save_trajectories",
        ">= 1": "epochs prompts_per_step mini_batch_prompts ppo_epochs micro_batch_tokens "
                "logprob_micro_batch_tokens score_workers eval_n keep_checkpoints",
        ">= 2": "samples_per_prompt", "> 1": "clip_c",  # GRPO compares the samples of a group
        "> 0": "lr temperature code_test_timeout dist_timeout",  # log-probs divide by T
        "[0, 1)": "clip_low beta1 beta2", "[-1, 1)": "tool_bonus_cap",
        "(0, 1]": "eval_top_p kv_memory_utilization"})
    flags.rollout(cfg)
    flags.choices(cfg, loss_agg=("token-mean", "seq-mean-token-mean"),
                   attn_backend=("auto", "sdpa", "flash"), save_dtype=("auto", *DTYPES))
    flags.rule(cfg.prompts_per_step % cfg.mini_batch_prompts == 0, "prompts_per_step",
                cfg.prompts_per_step, "allowed: a multiple of --mini_batch_prompts")
    if cfg.mini_batch_prompts % flags.world():  # every rank holds part of every mini-batch
        raise SystemExit(world_advice(cfg.mini_batch_prompts, cfg.prompts_per_step, flags.world()))
    flags.rule(cfg.overlong_buffer <= cfg.max_response_tokens, "overlong_buffer",
                cfg.overlong_buffer, "allowed: at most --max_response_tokens")
    flags.output_dir(cfg, "out_dir")
    flags.model_dir(cfg)
    toy_files = (toy.TRAIN, toy.HELDOUT) if cfg.model == "toy" else ()  # toy.ensure writes them
    flags.input_file(cfg, "data", skip=toy_files, hint=" (data/prepare.py rl; or --preset toy)")
    flags.input_file(cfg, "eval_data", optional=True, skip=toy_files)


# ---------------------------------------------------------------- advantages, rewards, the loss
def group_advantages(rewards, group_size, eps=1e-6):
    """GRPO per group_size rewards: (r - mean) / (unbiased std + eps); exactly 0 where all equal."""
    r = torch.as_tensor(rewards, dtype=torch.float64).view(-1, group_size)    # [G, n]
    if group_size == 1:
        return torch.zeros(r.numel())
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    # equal rewards: (r - mean) is rounding noise, and so is the std it would be divided by
    same = r.max(1, keepdim=True).values == r.min(1, keepdim=True).values
    return torch.where(same, torch.zeros_like(adv), adv).view(-1).float()


def overlong_penalty(length, max_len=20480, buffer=4096, factor=1.0):
    """DAPO: 0 up to max_len - buffer response tokens, then linearly down to -factor at max_len."""
    if buffer <= 0:
        return 0.0
    over = length - (max_len - buffer)
    return min(-over / buffer * factor, 0.0) + 0.0  # + 0.0: never -0.0


def correctness_reward(kind, score, has_program=True):
    """+1 / -1 for math and choice; for code the fraction of tests passed, -1 without a program."""
    if kind == "code":
        return float(score) if has_program else -1.0
    return 1.0 if score >= 1.0 else -1.0


def tool_turns(calls):
    """Assistant turns with a call that ran (a bad_call does not); a turn counts once."""
    return len({c["turn"] for c in calls if c["status"] != "bad_call"})


def shape_reward(correctness, turns, length, cfg):
    """Paper Eq. 8 (upstream recipe/demystify/reward.py), then DAPO's overlong penalty:
        if score < 0: score = min(-0.6, score + (num_turns - 2) / 2 * 0.1)
    verl's num_turns counts messages, so (num_turns - 2) / 2 is tool_turns. Partial code credit is
    not wrong; trying the tool pays, never as much as a right answer."""
    r = correctness
    if cfg.tool_bonus and r < 0:
        r = min(cfg.tool_bonus_cap, r + cfg.tool_bonus_per_turn * turns)
    if cfg.overlong:
        r += overlong_penalty(length, cfg.max_response_tokens, cfg.overlong_buffer,
                              cfg.overlong_factor)
    return r


def aggregate(per_token, mask, agg, num_tokens, seq_ids=None, num_seqs=None):
    """token-mean: the masked sum / num_tokens (the whole mini-batch's count: the parts add up);
    seq-mean-token-mean: the sum of each sequence's token mean (seq_ids [B, T]; rows) / num_seqs."""
    if agg == "token-mean":
        return (per_token * mask).sum() / num_tokens
    if seq_ids is None:
        seq_ids = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    S, flat = int(seq_ids.max()) + 1, seq_ids.reshape(-1)
    tok_sum = per_token.new_zeros(S).index_add(0, flat, (per_token * mask).reshape(-1))   # [S]
    tok_cnt = mask.new_zeros(S).index_add(0, flat, mask.reshape(-1))                      # [S]
    num_seqs = int((tok_cnt > 0).sum()) if num_seqs is None else num_seqs
    return (tok_sum / tok_cnt.clamp(min=1)).sum() / max(num_seqs, 1)


def grpo_tcr_loss(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.315,
                  clip_c=10.0, num_tokens=None, *, agg="token-mean", seq_ids=None, num_seqs=None,
                  is_weights=None, entropy=None):
    """logprobs, old_logprobs, mask [B, T] (packed: [1, N]); advantages broadcast to them;
    num_tokens: the whole mini-batch's mask count (None: this mask's); is_weights: truncated IS.
    Returns (loss, stats); stats are shares of num_tokens, so they add up over micro-batches."""
    mask = mask.to(logprobs.dtype)
    num_tokens = max(float(mask.sum() if num_tokens is None else num_tokens), 1.0)
    A = advantages
    # clamped as verl: exp never overflows, 0 * inf never NaN
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)                                                       # [B, T]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(-A * ratio, -A * clipped)           # the pessimistic of the two
    per_token = torch.where(A < 0, torch.minimum(per_token, -A * clip_c), per_token)  # dual clip
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = aggregate(per_token, mask, agg, num_tokens, seq_ids, num_seqs)
    with torch.no_grad():
        A_b = A.expand_as(ratio)
        share = lambda x: (x.to(mask.dtype) * mask).sum() / num_tokens
        stats = {"clip_high": share((A_b > 0) & (ratio > 1 + clip_high)),
                 "clip_low": share((A_b < 0) & (ratio < 1 - clip_low)),
                 "clip_dual": share((A_b < 0) & (ratio > clip_c)),
                 "approx_kl": share((ratio - 1) - log_ratio)}   # k3 of KL(old || new), >= 0
        if entropy is not None:
            stats["entropy"] = share(entropy)
    return loss, stats


# ---------------------------------------------------------------- data
def drop_overlong(problems, tokenizer, rcfg, path):
    """The recipe's filter_overlong_prompts (template and tool schema included), at load time."""
    chat = rollout.chat_format(tokenizer, rcfg)  # the prompt exactly as the rollout renders it
    max_tokens = rcfg.max_prompt_tokens
    kept = [p for p in problems if len(chat.prompt_ids(p["prompt"], p.get("system"))) <= max_tokens]
    if len(kept) < len(problems):
        print0(f"{path}: dropped {len(problems) - len(kept)} of {len(problems)} problems with "
               f"prompts over {max_tokens} tokens")
    if not kept:
        raise SystemExit(f"{path}: every prompt is over max_prompt_tokens={max_tokens}")
    return kept


def batch_indices(step, batch, num_problems, seed):
    """Per-epoch seeded permutations end to end: a function of (seed, step), so resumes match."""
    out, pos = [], step * batch
    while len(out) < batch:
        epoch, offset = divmod(pos, num_problems)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(num_problems, generator=generator)
        take = perm[offset:offset + batch - len(out)].tolist()
        out, pos = out + take, pos + len(take)
    return out


# ---------------------------------------------------------------- the loop
@dataclass
class Run:
    """What the loop works with, built once by setup()."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    path: str                  # the starting model's directory
    tokenizer: object
    rcfg: rollout.RolloutConfig
    problems: list
    eval_problems: list
    steps: int
    start: int                 # the first step to run (> 0 after a resume)
    evals: dict                # held-out results: "before", "last", "after"
    model: torch.nn.Module
    ref: torch.nn.Module       # the frozen start policy (kl_coef > 0), else None
    opt: torch.optim.Optimizer
    engine: rollout.Engine
    metrics: Metrics
    sandbox: "TimedSandbox"


def train(cfg):
    """Run GRPO-TCR as configured; returns the summary dict (also out_dir/summary.json)."""
    check(cfg)
    with (distributed(timeout_minutes=cfg.dist_timeout) as (rank, world, device, sharded),
          claim(cfg.out_dir, "rl.py", cfg.resume)):
        if cfg.model == "toy":  # the toy preset: its problem files, and the SFT start
            if rank == 0:
                toy.ensure()
            cfg.model = broadcast_object(toy.sft_start())  # rank 0's: one start for every rank
        check_shared(cfg.out_dir, [cfg.data, cfg.eval_data, cfg.model])
        if world > 1:  # what follows rank-local rollouts gathers on it: made while together
            gather_group()
        return _train(cfg, rank, world, device, sharded)


def _train(cfg, rank, world, device, sharded):
    run = setup(cfg, rank, world, device, sharded)
    model, engine = run.model, run.engine
    for step in range(run.start, run.steps):
        t_step, times, memory = time.time(), {}, {}
        done = step + 1  # the step's number in logs and checkpoints
        last = done == run.steps
        batch_ids = batch_indices(step, cfg.prompts_per_step, len(run.problems), cfg.seed)
        batch = [run.problems[i] for i in batch_ids]
        mine = list(range(rank, len(batch), world))  # this rank's problems: every world-th
        with phase("rollout", times, memory, device):
            # a problem's seed is (run seed, step, place in the batch): a resumed step samples what
            # the interrupted one would have, and 1 or N ranks sample alike
            seeds = [zlib.crc32(f"rl:{cfg.seed}:{step}:{i}".encode()) % 2**31 for i in mine]
            run.sandbox.seconds = 0.0
            model.eval()
            with full_weights(model):
                trajs = rollout.rollout(model, run.tokenizer, [batch[i] for i in mine], run.rcfg,
                                        sandbox=run.sandbox, seeds=seeds, engine=engine)
        times["sandbox"] = run.sandbox.seconds
        with phase("score", times, memory, device):  # rewards, then GRPO's advantages
            samples = grade([batch[i] for i in mine], trajs, cfg)
            for s in samples:  # problems numbered by their place in the whole batch
                s["problem"] = mine[s["problem"]]
            samples.sort(key=lambda s: (s["problem"], s["sample"]))
            adv = group_advantages([s["reward"] for s in samples], cfg.samples_per_prompt,
                                   cfg.adv_eps)  # a problem's whole group is on this rank
            for s, a in zip(samples, adv.tolist()):
                s["adv"] = a
        everyone, groups, kept = share_rewards(samples, cfg)
        with phase("old_logprob", times, memory, device):  # with the training forward
            score_tokens(model, samples, "old_logprobs", cfg, device, entropy=True)
            if run.ref is not None:
                score_tokens(run.ref, samples, "ref_logprobs", cfg, device)
        with phase("update", times, memory, device):  # PPO: an optimizer step per mini-batch
            updates, firsts = [], range(0, cfg.prompts_per_step, cfg.mini_batch_prompts)
            for first in list(firsts) * cfg.ppo_epochs:
                part = [s for s in samples if s["problem"] in kept
                        and first <= s["problem"] < first + cfg.mini_batch_prompts]
                num_tokens, num_seqs = all_reduce([sum(sum(s["mask"]) for s in part), len(part)],
                                                  device)
                if num_seqs == 0:
                    continue
                stats = update(model, run.opt, part, num_tokens, int(num_seqs), cfg, device, world)
                if not (math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])):
                    raise SystemExit(f"step {done}: loss {stats['loss']} / grad norm "
                                     f"{stats['grad_norm']} is not finite; stopping before the "
                                     f"optimizer step (checkpoints: {cfg.out_dir})")
                run.opt.step()
                run.opt.zero_grad(set_to_none=True)  # the gradients' memory goes back to the pool
                updates.append(stats)
        record = step_metrics(done, everyone, groups, updates, sampler_mismatch(samples, device),
                              device, engine.stats)
        keep_trajectories(cfg, done, batch_ids, batch, samples, run.tokenizer)
        if run.eval_problems and (last or (cfg.eval_every and done % cfg.eval_every == 0)):
            with phase("eval", times, memory, device):
                record["eval"] = run.evals["last"] = run_eval(run, done)
            if last:
                run.evals["after"] = run.evals["last"]
        times["step"] = time.time() - t_step
        record["time"] = {k: round(v, 3) for k, v in times.items()}
        if memory:
            record["memory_gib"] = memory
        # logged before the checkpoint: a run killed between the two redoes the step, not its line
        run.metrics.log(**record)
        print_step(record, samples, cfg)
        if last or (cfg.save_every and done % cfg.save_every == 0):  # a collective: every rank
            t0 = time.time()
            save_checkpoint(cfg.out_dir, done, model, run.opt, run.tokenizer,
                            dict(config=asdict(cfg), evals=run.evals), run.path,
                            dtype=cfg.save_dtype, keep=cfg.keep_checkpoints, last=last)
            run.metrics.log(event="save", step=done, seconds=round(time.time() - t0, 3))
    return finish(run)


def setup(cfg, rank, world, device, sharded):
    """Everything the loop needs (resumed if out_dir holds a checkpoint); the evaluation before."""
    from transformers import AutoTokenizer
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    problems = evaluate.load_jsonl(cfg.data)
    eval_problems = evaluate.load_jsonl(cfg.eval_data) if cfg.eval_data else []
    eval_problems = eval_problems[:cfg.eval_limit or None]
    start_sandbox(cfg.sandbox_workers, cfg.sandbox_require, rank)
    if cfg.top_p < 1 or cfg.top_k > 0:
        print0(f"warning: top_p {cfg.top_p} / top_k {cfg.top_k}: the sampler draws from a "
               f"truncated distribution, the trainer's log-probs are the full softmax's; "
               f"mismatch_* then measures the truncation too")
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rcfg = rollout.RolloutConfig(n=cfg.samples_per_prompt, temperature=cfg.temperature,
                                 top_p=cfg.top_p, **{k: getattr(cfg, k) for k in SHARED})
    problems = drop_overlong(problems, tokenizer, rcfg, cfg.data)
    if eval_problems:
        eval_problems = drop_overlong(eval_problems, tokenizer, rcfg, cfg.eval_data)
    if cfg.prompts_per_step > len(problems):  # verl's dataloader would be empty: it refuses too
        flags.refuse("prompts_per_step", cfg.prompts_per_step, f"allowed: at most the "
                     f"{len(problems)} problems of {cfg.data} (a step would repeat problems)")
    steps = cfg.steps or max(1, cfg.epochs * len(problems) // cfg.prompts_per_step)

    model = build_model(path, device, sharded)
    model.attn_backend = cfg.attn_backend
    model.gradient_checkpointing = cfg.activation_checkpointing
    if device.type == "cuda" or cfg.attn_backend == "flash":
        print0(attention_path(cfg.attn_backend, device, compute_dtype(device)))
    ref = build_model(path, device, sharded).requires_grad_(False) if cfg.kl_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    engine, probe = make_engine(model, cfg, device, world, bool(eval_problems))
    start, evals = 0, {}
    resume_from = latest_resumable(cfg.out_dir) if cfg.resume else None
    if resume_from:
        trainer = load_checkpoint(resume_from, model, opt)
        check_resume(trainer, asdict(cfg), RESUME_FIELDS, steps, resume_from)
        start, evals = trainer["step"], trainer["evals"]
        print0(f"resumed from {resume_from} at step {start}")
    metrics = Metrics(os.path.join(cfg.out_dir, "metrics.jsonl"), cfg, start)
    if probe:  # what each phase may take beside the pool (scripts/gpu_check.py reads it)
        metrics.log(event="memory", step=start, probe_gib=probe)
    print0(f"rl: {len(problems)} problems, {steps} steps of {cfg.prompts_per_step} x "
           f"{cfg.samples_per_prompt}, world {world}, device {device}, KV pool "
           f"{engine.stats['kv_pool_tokens']} tokens per rank")
    run = Run(cfg, rank, world, device, path, tokenizer, rcfg, problems, eval_problems, steps,
              start, evals, model, ref, opt, engine, metrics, TimedSandbox())
    if eval_problems and start == 0:
        evals["before"] = run_eval(run, 0)
        print0(f"eval before: accuracy {evals['before']['accuracy']:.3f}")
    return run


def share_rewards(samples, cfg):
    """Every rank's numbers, each group's rewards, the groups to train on (dynamic sampling: unequal
    ones). The first collective after the rollout: it waits on the long-timeout group."""
    keys = ("problem", "reward", "score", "correct", "tool_calls", "tool_ok", "length", "finish")
    mine = [{k: s[k] for k in keys} for s in samples]
    everyone = [x for part in gather_objects(mine) for x in part]
    groups = {}
    for s in everyone:
        groups.setdefault(s["problem"], []).append(s["reward"])
    kept = {p for p, g in groups.items() if max(g) > min(g) or not cfg.dynamic_sampling}
    return everyone, groups, kept


def sampler_mismatch(samples, device):
    """Sampler vs trainer log-probs on the step's sampled tokens, all ranks: mean and max |diff|,
    the share whose ratio leaves [0.9, 1.1]; the mean entropy. They agree up to kernel rounding only
    at top_p 1, top_k 0 (the sampler's are of the cut it drew from); the loss uses the trainer's."""
    ent = total = worst = outside = count = 0.0
    for s in samples:
        m, start = torch.tensor(s["mask"], dtype=torch.bool), s["prompt_len"] - 1
        d = s["old_logprobs"][start:].cpu()[m] - torch.tensor(s["sampler_logprobs"])[m]  # [tokens]
        ent += float(s["entropy"][start:].cpu()[m].sum())
        total, count = total + float(d.abs().sum()), count + d.numel()
        worst = max([worst] + d.abs().tolist())
        outside += float(((d.exp() < 0.9) | (d.exp() > 1.1)).sum())
    ent, total, outside, count = all_reduce([ent, total, outside, count], device)
    worst = all_reduce([worst], device, dist.ReduceOp.MAX)[0]
    return {"entropy": ent / max(count, 1), "mismatch_mean": total / max(count, 1),
            "mismatch_max": worst, "mismatch_outside": outside / max(count, 1)}


def finish(run):
    """The summary (out_dir/summary.json), the learning curve, the held-out change."""
    cfg, evals = run.cfg, run.evals
    summary = {"steps": run.steps, "config": asdict(cfg),
               **{k: evals[k] for k in ("before", "after") if k in evals}}
    run.metrics.finish({k: v for k, v in summary.items() if k != "config"})
    if run.rank == 0:
        with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(learning_curve(cfg.out_dir), flush=True)
        if "before" in summary and "after" in summary:
            def show(k):
                return " -> ".join("n/a" if x[k] is None else f"{x[k]:.3f}"
                                   for x in (summary["before"], summary["after"]))
            print(f"held-out accuracy {show('accuracy')}, tool calls per response "
                  f"{show('tool_calls_per_response')} ({cfg.out_dir}/summary.json)", flush=True)
    return summary


# ---------------------------------------------------------------- rollout and grading
@contextmanager
def full_weights(model):
    """Under FSDP2 all-gather each unit once for the whole rollout (not once per token), then free
    it. Afterwards the blocks reshard after forward again, the root not (FSDP's own default)."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if units:
        model.set_reshard_after_forward(False)  # every unit
    for u in units:
        u.unshard()
    # no FSDP hooks on the blocks: nothing to do, and outside the root they'd rerun its set-up
    model.bare_blocks = bool(units)
    try:
        yield model
    finally:
        model.bare_blocks = False
        for u in units:
            u.reshard()
        if units:
            model.set_reshard_after_forward(True)
            model.set_reshard_after_forward(False, recurse=False)


@contextmanager
def phase(name, times, memory, device):
    """times[name]: the block's seconds; on CUDA memory[name] (and name_reserved): its peak GiB."""
    t0 = time.time()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    yield
    times[name] = time.time() - t0
    if device.type == "cuda":
        memory[name] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        memory[name + "_reserved"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)


def make_engine(model, cfg, device, world, evaluating):
    """The one Engine for every rollout and eval, and on CUDA what sized it ({phase: GiB}): capped
    by what the largest measured phase peak leaves (machinery/memory_plan.py). Built before a
    resume loads AdamW's moments: the measured step allocates its own."""
    seqs = -(-cfg.prompts_per_step // world) * cfg.samples_per_prompt
    if evaluating:
        seqs = max(seqs, evaluate.batch_problems(cfg.eval_n, 0) * cfg.eval_n)
    budget, peaks, dtype = None, {}, compute_dtype(device)
    if device.type == "cuda":
        this = sys.modules[__name__]  # its full_weights, score_tokens, update: the step's own
        flash = rollout.use_flash(model.attn_backend, device, dtype)
        peaks = memory_plan.cuda_peaks(model, cfg, device, world, this, flash)
        budget = rollout.kv_budget(device, cfg.kv_memory_utilization, max(peaks.values()))
    lengths = [cfg.max_prompt_tokens + cfg.max_response_tokens] * seqs
    engine = rollout.Engine(model, max_seq_lens=lengths, kv_cache_bytes=budget, dtype=dtype)
    if not peaks:
        return engine, {}
    print0("memory: " + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in peaks.items())
           + f" GiB at peak; KV budget {budget / 2**30:.1f} GiB, pool "
           f"{engine.num_blocks * engine.blocks.block_size} tokens per rank")
    # without flash-attn the row buffers may take as much as the pool
    pool = sum(t.nbytes for t in engine.cache.kv) * (1 if engine.use_flash else 2)
    return engine, {k: round(v / 2**30, 3) for k, v in dict(peaks, kv_pool=pool).items()}


class TimedSandbox:
    """sandbox.submit, its runs' seconds added up for the step's time breakdown."""

    def __init__(self):
        self.seconds, self.lock = 0.0, threading.Lock()

    def submit(self, *args, **kwargs):
        future = sandbox.submit(*args, **kwargs)
        future.add_done_callback(self.add)
        return future

    def add(self, future):
        # a cancelled run (Ctrl-C, a stopped pool) has no result: future.exception() would raise
        if not future.cancelled() and future.exception() is None:
            with self.lock:
                self.seconds += future.result().seconds or 0.0


# the rollout settings that rollouts and evaluations share
SHARED = ("top_k", "max_prompt_tokens", "max_response_tokens", "max_turns", "max_parallel_calls",
          "tool_output_chars", "tool_timeout", "tool_memory_mb", "enable_thinking")


def has_program(text):
    program = evaluate.extract_program(text)
    try:    # no program: what ast cannot parse (NUL bytes, a few thousand `+1`, `not not ...`)
        return bool(program and program.strip()) and ast.parse(program) is not None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def grade(problems, trajs, cfg):
    """Every trajectory scored (concurrently: code runs its tests) into a training sample."""
    def one(t):
        p = problems[t.problem_index]
        score = evaluate.score(p, t.text, code_timeout=cfg.code_test_timeout)
        correct_r = correctness_reward(p["kind"], score, p["kind"] != "code" or has_program(t.text))
        reward = shape_reward(correct_r, tool_turns(t.tool_calls), len(t.response_ids), cfg)
        return dict(problem=t.problem_index, sample=t.sample_index,
            ids=list(t.prompt_ids) + list(t.response_ids), prompt_len=len(t.prompt_ids),
            mask=list(t.loss_mask), sampler_logprobs=list(t.logprobs),
            score=score, correct=score >= 1.0, reward=reward,
            tool_calls=len(t.tool_calls), tool_ok=sum(c["status"] == "ok" for c in t.tool_calls),
            length=len(t.response_ids), finish=t.finish_reason, text=t.text, traj=t)

    with ThreadPoolExecutor(max(1, cfg.score_workers)) as pool:
        return list(pool.map(one, trajs))


# ---------------------------------------------------------------- training forward: packed
def pack(samples, budget, device):
    """Greedy packing in order within `budget` tokens (a longer one alone), padded to the most over
    ranks with loss-free samples: every FSDP forward and backward needs every rank."""
    batches, size = [[]], 0
    for s in samples:
        if batches[-1] and size + len(s["ids"]) - 1 > budget:
            batches.append([])
            size = 0
        batches[-1].append(s)
        size += len(s["ids"]) - 1
    batches = batches if batches[0] else []
    most = int(all_reduce([len(batches)], device, dist.ReduceOp.MAX)[0])
    # mask 0: whatever these are, the token adds 0 to loss and gradient
    dummy = dict(ids=[0, 0], prompt_len=1, mask=[0], sampler_logprobs=[0.0], adv=0.0,
                 old_logprobs=torch.zeros(1), ref_logprobs=torch.zeros(1))
    return batches + [[dummy] for _ in range(most - len(batches))]


def micro_tensors(batch, device):
    """One packed sequence [1, N] and its per-token columns. Position t predicts token t + 1, so a
    sample's response mask starts at prompt_len - 1 (rollout.py: a trajectory's ids and mask)."""
    cols = {k: [] for k in ("input_ids", "targets", "mask", "adv", "sampler_logprobs", "seq_ids")}
    lengths = []
    for k, s in enumerate(batch):
        n, pad = len(s["ids"]) - 1, s["prompt_len"] - 1
        cols["input_ids"] += s["ids"][:-1]
        cols["targets"] += s["ids"][1:]
        cols["mask"] += [0] * pad + s["mask"]
        cols["sampler_logprobs"] += [0.0] * pad + s["sampler_logprobs"]
        cols["adv"] += [s["adv"]] * n
        cols["seq_ids"] += [k] * n
        lengths.append(n)
    kinds = dict(input_ids=torch.long, targets=torch.long, seq_ids=torch.long)
    mb = {k: torch.tensor(v, dtype=kinds.get(k, torch.float32), device=device)[None]
          for k, v in cols.items()}
    return dict(mb, cu_seqlens=cu_seqlens_from_lengths(lengths, device=device), lengths=lengths)


@torch.no_grad()
def score_tokens(model, samples, key, cfg, device, entropy=False):
    """Per-token log-probs of each sample's targets -> sample[key] (and sample['entropy'])."""
    model.eval()
    for batch in pack(samples, cfg.logprob_micro_batch_tokens, device):
        mb = micro_tensors(batch, device)
        out = model.token_logprobs(mb["input_ids"], mb["targets"], cu_seqlens=mb["cu_seqlens"],
                                   return_entropy=entropy, temperature=cfg.temperature)
        logp, ent = out if entropy else (out, out)
        for s, lp, e in zip(batch, logp[0].split(mb["lengths"]), ent[0].split(mb["lengths"])):
            s[key] = lp.float()
            if entropy:
                s["entropy"] = e.float()


def update(model, opt, samples, num_tokens, num_seqs, cfg, device, world):
    """This rank's share of a mini-batch's gradient (summed stats): each micro-batch's loss is its
    sum / num_tokens (all ranks'), so with FSDP2's mean, loss x world gives the exact token mean."""
    model.train()
    opt.zero_grad(set_to_none=True)
    clip_high = cfg.clip_high if cfg.clip_higher else cfg.clip_low
    totals, want_entropy = {}, cfg.entropy_coef > 0
    # FSDP2 reduce-scatters each micro-batch's gradient (as verl): unsharded it'd be fp32, whole
    for batch in pack(samples, cfg.micro_batch_tokens, device):
        mb = micro_tensors(batch, device)
        out = model.token_logprobs(mb["input_ids"], mb["targets"], cu_seqlens=mb["cu_seqlens"],
                                   return_entropy=want_entropy, temperature=cfg.temperature)
        logp, ent = out if want_entropy else (out, None)                      # [1, N] each
        old = torch.cat([s["old_logprobs"] for s in batch]).to(device)[None]
        is_w = None
        if cfg.tis_cap > 0:  # TIS: the sampler drew these tokens; weight them towards the trainer
            is_w = torch.exp(old - mb["sampler_logprobs"]).clamp(max=cfg.tis_cap) * mb["mask"]
        agg = dict(agg=cfg.loss_agg, num_tokens=num_tokens, seq_ids=mb["seq_ids"],
                   num_seqs=num_seqs)
        loss, stats = grpo_tcr_loss(logp, old, mb["adv"], mb["mask"], cfg.clip_low, clip_high,
                                    cfg.clip_c, is_weights=is_w, **agg)
        if want_entropy:  # the entropy of the differentiable forward, aggregated like the loss
            loss = loss - cfg.entropy_coef * aggregate(ent, mb["mask"], **agg)
        if cfg.kl_coef > 0:  # verl's low_var_kl (k3) to the frozen start policy, clamped as there
            ref = torch.cat([s["ref_logprobs"] for s in batch]).to(device)[None]
            d = (ref - logp).clamp(-20.0, 20.0)
            kl = aggregate((d.exp() - d - 1).clamp(-10.0, 10.0), mb["mask"], **agg)
            loss, stats["ref_kl"] = loss + cfg.kl_coef * kl, kl.detach()
        (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already global
        stats["loss"] = loss.detach()
        for name, v in stats.items():
            totals[name] = totals.get(name, 0.0) + float(v)
    summed = dict(zip(sorted(totals), all_reduce([totals[k] for k in sorted(totals)], device)))
    summed["grad_norm"] = clip_grads(model, cfg.grad_clip)
    return summed


# ---------------------------------------------------------------- evaluation and metrics
def run_eval(run, step):
    """Held-out accuracy by evaluate.py's protocol, written to out_dir/eval/step_NNNNNN."""
    cfg = run.cfg
    ecfg = evaluate.EvalConfig(n=cfg.eval_n, temperature=cfg.eval_temperature,
                               top_p=cfg.eval_top_p, code_test_timeout=cfg.code_test_timeout,
                               seed=cfg.seed, **{k: getattr(cfg, k) for k in SHARED})
    out = os.path.join(cfg.out_dir, "eval", f"step_{step:06d}")
    run.model.eval()
    with full_weights(run.model):
        _, summary = evaluate.evaluate(run.model, run.tokenizer, run.eval_problems, ecfg,
                                       out_dir=out, progress=False, engine=run.engine)
    keys = ("tool_calls_per_response", "tool_call_success", "response_tokens")
    tools = summary["overall"].get("tools", {})
    result = {"step": step, "accuracy": summary["overall"].get("headline"),
              **{k: tools.get(k) for k in keys}}
    if run.rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(dict(result, summary=summary), f, indent=2)
    return result


def keep_trajectories(cfg, step, batch_ids, batch, samples, tokenizer):
    """The step's first save_trajectories groups, with reward, advantage, trainer log-probs."""
    def digits4(values):   # 4 significant digits
        return [float(f"{x:.4g}") for x in values]

    mine = []
    for s in samples:
        if s["problem"] < cfg.save_trajectories:
            t, p, start = s["traj"], batch[s["problem"]], s["prompt_len"] - 1
            mine.append(dict(t.to_dict(), step=step, problem_index=s["problem"],
                             uid=str(batch_ids[s["problem"]]), kind=p["kind"],
                             source=p.get("source"), prompt=tokenizer.decode(t.prompt_ids),
                             reward=s["reward"], advantage=s["adv"], score=s["score"],
                             correct=s["correct"], logprobs=digits4(t.logprobs),
                             trainer_logprobs=digits4(s["old_logprobs"][start:].tolist())))
    everyone = all_gather_list(mine)
    if dist.get_rank() == 0 and everyone:
        write_trajectories(cfg.out_dir, step, everyone)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    allocator_defaults()  # before CUDA starts
    cfg = parse_args(argv or ["--preset=toy"])  # no arguments: the toy preset
    with quiet_interrupt(lambda why: resume_line("rl.py", cfg.out_dir, why), cfg.out_dir):
        train(cfg)


if __name__ == "__main__":
    main()
    exit_worker()
