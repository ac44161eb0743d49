"""machinery/memory_plan.py: one RL step's memory on a GPU, phase by phase, and the KV pool sized
beside its largest phase (docs/DESIGN.md). rl.make_engine measures it on CUDA; scripts/plan.py runs
it on fake tensors. `run_phases` runs rl.py's own functions (passed in: no stage imported) on dummy
tokens, so the plan cannot drift: generate, old_logprob, update (two micro-batches: a gradient held
between them shows in the second), optimizer. A sequence longer than a micro-batch goes alone
(rl.pack), so none is planned shorter than full length. Resident throughout: AdamW's fp32 moments,
with flash-attn the decode graphs' outputs, and the KV pool (usable memory less OUTSIDE less the
largest phase peak)."""

from types import SimpleNamespace

import torch

ROWS = 256  # rollout.Engine's max_num_seqs: the most rows one decode step samples
# outside torch's allocator (rollout.kv_budget measures it, the plan estimates it): the CUDA
# context with a run's kernels (0.5-1 GiB), NCCL's buffers (~1 GiB with NVLink SHARP on 8 H100s)
OUTSIDE = dict(cuda_context=1 << 30, nccl=1 << 30)


def outside_torch(gpus):
    return OUTSIDE["cuda_context"] + (OUTSIDE["nccl"] if gpus > 1 else 0)


def dummy_sample(tokens, device):
    """A sample of `tokens` + 1 ids, every token in the loss (the backward of a real one)."""
    return dict(ids=[0] * (tokens + 1), prompt_len=1, mask=[1] * tokens,
                sampler_logprobs=[0.0] * tokens, adv=0.0,
                old_logprobs=torch.zeros(tokens, device=device))


def run_phases(model, opt, cfg, device, world, mark, rl, flash):
    """One RL step's phases on dummy tokens, mark(name) before each, mark(None) after the last; a
    collective, as the step is. rl: the rl module; opt: an AdamW that may step; flash: flash-attn"""
    full = cfg.max_prompt_tokens + cfg.max_response_tokens
    with_moments(model, opt)
    graphs = torch.empty(2 * ROWS - 1, model.config.vocab_size, device=device) if flash else None
    mark("generate")
    model.eval()
    with rl.full_weights(model):
        generation(model, cfg, device, flash, rl.rollout.sample)
    mark("old_logprob")
    rl.score_tokens(model, [dummy_sample(max(cfg.logprob_micro_batch_tokens, full), device)],
                    "old_logprobs", cfg, device, entropy=True)
    mark("update")
    # each alone in its micro-batch: two of them, as a mini-batch of many runs
    n = max(cfg.micro_batch_tokens, full)
    rl.update(model, opt, [dummy_sample(n, device) for _ in range(2)], 2 * n, 2, cfg, device, world)
    mark("optimizer")
    opt.step()
    mark(None)
    opt.zero_grad(set_to_none=True)
    del graphs


@torch.no_grad()
def generation(model, cfg, device, flash, sample):
    """What a rollout adds beside its KV pool: a full-length prefill (a preempted sequence is
    computed again whole), then rollout.sample over ROWS rows sorted as eval's top-p. Without
    flash-attn the prefill also holds one layer's K/V scratch, a [q, k] mask and K/V expanded to the
    query heads (rollout.PagedKVCache, model.sdpa); with it run_phases holds the decode graphs' fp32
    logits [b, V] for each bucket b up to ROWS (fast_sampling.FlashKVCache)."""
    c, full = model.config, cfg.max_prompt_tokens + cfg.max_response_tokens
    kw = dict(dtype=model.lm_head.weight.dtype, device=device)
    scratch = [] if flash else [
        torch.empty(2, full, c.num_key_value_heads, c.head_dim, **kw),
        torch.empty(2, c.num_attention_heads, full, c.head_dim, **kw),
        torch.ones(full - cfg.max_prompt_tokens, full, dtype=torch.bool, device=device)]
    h = model.hidden(torch.zeros(1, full, dtype=torch.long, device=device))
    model.lm_head(h[:, -1]).float()
    del h, scratch

    def rows(value, dtype=torch.float32):
        return torch.full((ROWS,), value, dtype=dtype)
    logits = torch.zeros(ROWS, c.vocab_size, device=device)
    sample(logits, rows(cfg.temperature), rows(min(cfg.top_p, cfg.eval_top_p)),
           rows(cfg.top_k, torch.long), rows(0.5, torch.float64))


def with_moments(model, opt):
    """opt's moments allocated, as after a run's first step: one step on zero gradients."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def probe_optimizer(model, cfg, foreach=None):
    """An AdamW like the run's with lr 0: its step allocates what the run's does, moves no weight.
    foreach=None: torch's choice (CUDA: the multi-tensor step, whose temporaries are a shard)."""
    return torch.optim.AdamW(model.parameters(), lr=0.0, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay, foreach=foreach)


def cuda_peaks(model, cfg, device, world, rl, flash):
    """{phase: peak CUDA bytes allocated} of run_phases, measured (every rank runs it)."""
    peaks, current = {}, [None]

    def mark(name):
        if current[0]:
            peaks[current[0]] = torch.cuda.max_memory_allocated(device)
        current[0] = name
        torch.cuda.reset_peak_memory_stats(device)

    run_phases(model, probe_optimizer(model, cfg), cfg, device, world, mark, rl, flash)
    torch.cuda.empty_cache()
    return peaks


def kv_pool_tokens(config, budget, dtype, flash, block_size=None):
    """Token positions a KV pool of `budget` bytes holds, in whole blocks (256 with flash-attn, else
    16); without flash-attn half is left to the row buffers (fast_sampling.RowKVCache)."""
    block_size = block_size or (256 if flash else 16)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    per_block = per_token * block_size * torch.empty(0, dtype=dtype).element_size()
    return max(1, budget // per_block // (1 if flash else 2)) * block_size


def run_sft_phases(model, opt, cfg, device, world, mark, sft):
    """sft.py's step on dummy tokens: sft.forward_backward on two micro-batches, AdamW's step."""
    n = cfg.micro_batch_tokens
    seq = (torch.zeros(n, dtype=torch.int32), torch.ones(n, dtype=torch.bool))
    run = SimpleNamespace(train_seqs=[seq, seq], model=model, device=device, world=world, rank=0)
    model.train()
    with_moments(model, opt)
    mark("update")
    sft.forward_backward(run, [0, 1], [[[0], [1]]] * world)
    mark("optimizer")
    opt.step()
    mark(None)
    opt.zero_grad(set_to_none=True)
