"""rollout.py: a paged-KV batched sampler and the multi-turn agent loop with tools.

`generate` / `complete`: token-id prompts in, new ids (and log-probs) out, through an `Engine`
(continuous batching over PagedKVCache; keep one per process). The tokens do not depend on batching,
preemption or tool timing (`sample`); the logits do in their last bits (CUDA bf16: tokens may
differ with the batch shape). `rollout(model, tokenizer, problems, RolloutConfig(n=16))`: a turn
that ends with the end-of-turn token and holds `<tool_call>` blocks sends its calls to their tools
as Futures while the other trajectories keep decoding (docs/DESIGN.md, "The tool-call protocol").

A trajectory's ids and mask: prompt_ids + response_ids; loss_mask and logprobs one entry per
response token, written only by Sequence.append: 1 and the sampler's log-prob for each token
Engine.step samples, 0 and 0.0 for forced ones (Engine.resume: a tool reply, ChatFormat.forced_ids;
AgentLoop._answer: a reply cut at the budget). rl.py takes Trajectory.loss_mask as a sample's "mask"
and shifts it (rl.micro_tensors): mask entry i (response token i, at position prompt_len + i)
belongs to the target at position prompt_len - 1 + i. Only sampled tokens count in the loss.

Departures from the paper (vLLM inside verl's agent loop): plain PyTorch, no cache of freed prefix
blocks; a malformed call gets a short error reply (status bad_call) where verl drops it; a reply
that would cross the response budget is cut there.
"""

import concurrent.futures
import itertools
import json
import os
import re
from collections import deque, namedtuple
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from data.prompts import CODE_INTERPRETER
from machinery import fast_sampling
from machinery.fast_sampling import upload
from machinery.memory_plan import kv_pool_tokens
from model import sdpa, use_flash


@dataclass
class RolloutConfig:
    n: int = 1                         # trajectories per problem
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0: off
    max_prompt_tokens: int = 2560      # a longer prompt is an error (filter the data)
    max_response_tokens: int = 20480   # counts the forced tool-reply tokens too
    max_turns: int = 16                # assistant turns; a call in the last isn't run ("max_turns")
    tool_output_chars: int = 256       # tool output cut to this many characters (head + tail)
    tool_timeout: float = 10.0
    tool_memory_mb: int = 1024
    seed: int | None = None
    max_parallel_calls: int = 1        # calls run per turn (verl's default); the rest get no reply
    enable_thinking: str = "default"   # the template's switch (Qwen3 hybrid): default|true|false


@dataclass
class Trajectory:
    problem_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]       # 1 on sampled tokens, 0 on forced tool-reply tokens
    logprobs: list[float]      # sampler log-probs, 0.0 where mask is 0
    text: str                  # decoded response (tool replies included, special tokens kept)
    tool_calls: list[dict]     # {"name", "arguments", "status", "output", "turn"}: call_outcome
    num_turns: int             # assistant turns, the one cut by the budget included
    finish_reason: str         # "stop" | "eos" | "length" | "max_turns"

    def to_dict(self):
        return asdict(self)


SamplingParams = namedtuple("SamplingParams", "temperature top_p top_k max_tokens stop_token_ids")
# raw_logprobs: under the unmodified T=1 distribution, if asked for; finish_reason: stop | length
Completion = namedtuple("Completion", "token_ids logprobs raw_logprobs finish_reason")


class Sequence:
    def __init__(self, prompt_ids, params, seed):
        if not prompt_ids:
            raise ValueError("empty prompt")
        self.token_ids, self.num_prompt, self.params = list(prompt_ids), len(prompt_ids), params
        self.mask, self.logprobs, self.raw_logprobs = [], [], []   # per response token
        self.num_cached, self.block_table = 0, []  # leading tokens with cached K/V; their blocks
        self.finish_reason, self.uniforms = None, []
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_response(self):
        return len(self.token_ids) - self.num_prompt

    def next_uniform(self):
        if not self.uniforms:  # fixed-size chunks: the stream is the same however it is consumed
            draws = torch.rand(64, generator=self.generator, dtype=torch.float64)
            self.uniforms = draws.tolist()[::-1]
        return self.uniforms.pop()

    def append(self, ids, sampled, logprob=0.0, raw_logprob=0.0):
        """The one writer of the loss mask: 1 on sampled ids, 0 on forced ones."""
        self.token_ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += [logprob] * len(ids)
        self.raw_logprobs += [raw_logprob] * len(ids)


class BlockManager:
    """Hands out cache blocks and counts their holders. A full block is registered under (previous
    block id, its tokens): a fresh sequence reuses those of its prefix, but its last token's."""

    def __init__(self, num_blocks, block_size, share_prefix=True):
        self.block_size, self.share_prefix = block_size, share_prefix
        self.free, self.refcount = deque(range(num_blocks)), [0] * num_blocks
        self.key_of, self.block_of = {}, {}   # block id <-> key, for shareable full blocks

    def _key(self, seq, i, parent):
        return parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _shared_prefix(self, seq):
        hits, fresh = [], self.share_prefix and not seq.block_table  # only a fresh seq shares
        for i in range((len(seq) - 1) // self.block_size if fresh else 0):
            block = self.block_of.get(self._key(seq, i, hits[-1] if hits else -1))
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_missing(self, seq):
        needed = -(-len(seq) // self.block_size)
        return needed - len(seq.block_table) - len(self._shared_prefix(seq))

    def grow(self, seq):
        """Give seq slots for all its tokens: shared prefix blocks first, then free ones."""
        for block in self._shared_prefix(seq):
            self.refcount[block] += 1
            seq.block_table.append(block)
            seq.num_cached = len(seq.block_table) * self.block_size
        full_before = seq.num_cached // self.block_size
        while len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self.free.popleft())
            self.refcount[seq.block_table[-1]] = 1
        # shareable at once: a sibling in this step reads them after they are written (PagedKVCache)
        for i in range(full_before, len(seq) // self.block_size if self.share_prefix else 0):
            key, block = self._key(seq, i, seq.block_table[i - 1] if i else -1), seq.block_table[i]
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key], self.key_of[block] = block, key

    def release(self, seq):
        for block in seq.block_table:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.block_of.pop(self.key_of.pop(block, None), None)
                self.free.append(block)
        seq.block_table, seq.num_cached = [], 0


class PagedKVCache:
    """Every sequence's K/V in fixed-size blocks: per layer a pool [2, blocks + 1, block_size, Hkv,
    D] (K then V, flash-attn's paged layout; the last block a spare that padded rows write to), per
    sequence a block table. Prefix sharing (BlockManager) may hand a block that a sibling fills in
    the same prefill step: exact only as `attend` (model.py's seam) writes all of a layer's K/V
    before any sequence reads it. machinery/fast_sampling.py changes only where K/V is read."""

    def __init__(self, config, num_blocks, block_size, device, dtype):
        shape = (2, num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
        # zeros, not empty: padded reads get weight 0, and 0 * NaN garbage would still be NaN
        self.kv = [torch.zeros(shape, device=device, dtype=dtype)
                   for _ in range(config.num_hidden_layers)]
        self.v_offset = (num_blocks + 1) * block_size   # in a flat view of a pool: V's first slot
        self.spare_slot = num_blocks * block_size       # the spare block's first slot
        self.block_size, self.device, self.scratch = block_size, device, None

    def decode_order(self, batch):  # a fast path may run a decode step's rows in its own order
        return batch

    def begin(self, batch, decode):
        """Lay out one step (each sequence's uncached tail, packed) -> (input_ids, positions)."""
        bs, dev = self.block_size, self.device
        ids, positions, slots = [], [], []
        for seq in batch:  # list slices, not a Python step per token: prefills are long
            span = range(seq.num_cached, len(seq))
            ids += seq.token_ids[seq.num_cached:]
            positions += span
            slots += [seq.block_table[p // bs] * bs + p % bs for p in span]
        self.seqs, self.decode = batch, decode
        self.k_lens, self.q_lens = [len(s) for s in batch], [len(s) - s.num_cached for s in batch]
        self.cu_q = list(itertools.accumulate(self.q_lens, initial=0))
        width = max(len(s.block_table) for s in batch)
        self.block_tables = upload([s.block_table + [0] * (width - len(s.block_table))
                                    for s in batch], dev, torch.int32)
        self.context_lens = upload(self.k_lens, dev, torch.int32)
        # the K and the V slot of each token; each sequence's last token
        self.pool_index = upload([(s, s + self.v_offset) for s in slots], dev, torch.long)
        self.last_index = upload([c - 1 for c in self.cu_q[1:]], dev, torch.long)
        self.groups = None
        if decode:  # runs of rows, the longest under twice the shortest, padded to the longest
            lens, self.groups, start = self.k_lens, [], 0
            for i in range(1, len(lens) + 1):
                if i == len(lens) or 2 * lens[i] <= lens[start]:
                    mask = None
                    if lens[i - 1] < lens[start]:  # each row sees only its own key slots
                        keys = torch.arange(lens[start], device=dev)
                        mask = (keys < self.context_lens[start:i, None])[:, None, None]
                    self.groups.append((start, i, lens[start], mask))
                    start = i
        shape = (len(batch), 1) if decode else (1, len(ids))
        return tuple(upload(t, dev, torch.long).view(shape) for t in (ids, positions))

    def write(self, layer, q, k, v):
        """Writes the step's K/V (one index_copy_) -> packed q [N, Hq, D], kv [N, 2, Hkv, D]."""
        B, T, Hq, D = q.shape
        kv = torch.stack([k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)], 1)
        flat = self.kv[layer].view(-1, *kv.shape[2:])
        flat.index_copy_(0, self.pool_index.flatten(), kv.flatten(0, 1))
        return q.reshape(B * T, Hq, D), kv

    def attend(self, layer, q, k, v):
        """Write first, then read (see the class docstring on prefix sharing). A prefill: one causal
        attention per sequence, its cached tokens read from its blocks."""
        shape = q.shape
        q, kv = self.write(layer, q, k, v)
        if self.decode:
            return self._attend_decode(layer, q, kv).reshape(shape)
        outs = []
        for i, (q_len, k_len) in enumerate(zip(self.q_lens, self.k_lens)):
            s, e = self.cu_q[i], self.cu_q[i + 1]
            ki, vi, mask = kv[s:e, 0], kv[s:e, 1], None
            if q_len < k_len:
                blocks = self.block_tables[i, :-(-k_len // self.block_size)].long()
                ki, vi = self._gather(layer, blocks).flatten(1, 2)[:, :k_len]
                # query j sits at position k_len - q_len + j and sees keys up to there
                mask = torch.ones(q_len, k_len, dtype=bool, device=q.device).tril(k_len - q_len)
            qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[s:e], ki, vi))  # [1, H, T, D]
            outs.append(sdpa(qi, ki, vi, mask)[0].transpose(0, 1))  # never the math kernel on CUDA
        return torch.cat(outs).reshape(shape)

    def _gather(self, layer, blocks):
        """K and V of the given blocks, copied into a scratch buffer: [2, n, block_size, Hkv, D]."""
        n, pool = blocks.numel(), self.kv[layer]
        if self.scratch is None or self.scratch.shape[1] < n:
            self.scratch = pool.new_empty((2, max(n, 64), *pool.shape[2:]))
        return torch.index_select(pool, 1, blocks, out=self.scratch[:, :n])

    def _group_kv(self, layer, start, end, width):
        """Keys and values [n, Hkv, width, D] of decode rows start..end: their blocks, gathered."""
        blocks = self.block_tables[start:end, :-(-width // self.block_size)].flatten().long()
        kv = self._gather(layer, blocks).view(2, end - start, -1, *self.kv[layer].shape[3:])
        return kv[:, :, :width].transpose(2, 3)

    def _attend_decode(self, layer, q, kv):
        """One query per row, attended per group of similar lengths."""
        (_, Hq, D), hkv, outs = q.shape, kv.shape[2], []
        for start, end, width, mask in self.groups:
            keys, values = self._group_kv(layer, start, end, width)
            # kv head h answers query heads hG..hG+G-1: [n, Hkv, G, D] queries
            queries = q[start:end].view(end - start, hkv, Hq // hkv, D)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
            outs.append(out.reshape(end - start, Hq, D))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def sample(logits, temperature, top_p, top_k, uniform):
    """(tokens [S], log-probs [S]) by inverse CDF under softmax(logits / T), top-k, then top-p,
    renormalised (T 0: argmax; top_k 0: off). The [S] parameters on the host: no sync."""
    any_greedy, truncate = bool((temperature == 0).any()), bool(((top_p < 1) | (top_k > 0)).any())
    temperature, top_p, top_k, uniform = (upload(x, logits.device)
                                          for x in (temperature, top_p, top_k, uniform))
    greedy = temperature == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    rank = torch.arange(logits.shape[1], device=logits.device)
    logp_drawn, order = logp.sort(dim=-1, descending=True) if truncate else (logp, None)
    # float64: near 1 a float32 CDF moves in steps of 6e-8; a token of smaller mass got 0 or 6e-8
    p = logp_drawn.double().exp()
    if truncate:
        keep = rank < torch.where(top_k > 0, top_k, len(rank))[:, None]
        p_k = p * keep
        p_k = p_k / p_k.sum(-1, keepdim=True)
        keep &= ((p_k.cumsum(-1) - p_k) < top_p[:, None]) | (top_p[:, None] >= 1)
        p = p * keep
    cdf = p.cumsum(-1)
    mass = cdf[:, -1:]
    idx = torch.searchsorted(cdf, uniform[:, None].double() * mass, right=True)
    # u * mass may round up to mass: at most the last token of positive mass
    idx = torch.minimum(idx, torch.where(p > 0, rank, 0).amax(-1, keepdim=True))
    tokens = order.gather(1, idx)[:, 0] if truncate else idx[:, 0]
    token_logp = (logp_drawn.gather(1, idx).double() - mass.log())[:, 0].float()
    if any_greedy:
        best = logits.argmax(-1)
        tokens = torch.where(greedy, best, tokens)
        token_logp = torch.where(greedy, logp.gather(1, best[:, None])[:, 0], token_logp)
    return tokens, token_logp


def kv_budget(device, utilization=0.9, trainer_peak=0):
    """Bytes the KV pool may take, as nano-vllm sizes it: utilization x the device's memory, less
    what others and the CUDA context hold, less max(this process's peak, trainer_peak: rl.py's)."""
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    peak = max(torch.cuda.max_memory_allocated(device), trainer_peak)
    budget = int(total * utilization) - others - peak
    if budget <= 0:
        raise RuntimeError(f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB x "
                           f"{utilization} - {others / 2**30:.1f} GiB held outside torch - "
                           f"{peak / 2**30:.1f} GiB at this process's peak")
    return budget


class Engine:
    """Continuous batching over a paged KV cache. `step` -> the sequences that stopped in it; they
    keep their blocks until `release`d or `resume`d, unless preempted (recomputed later)."""

    def __init__(self, model, max_num_seqs=256, max_prefill_tokens=8192, num_blocks=None,
                 block_size=None, max_seq_lens=None, kv_cache_bytes=None, share_prefix=True,
                 compile=False, dtype=None):
        """The pool, sized once: num_blocks, else kv_cache_bytes (CUDA: kv_budget(), CPU: 4 GiB)
        capped by max_seq_lens. dtype: the K/V's (FSDP may not have gathered bf16 weights yet)."""
        self.model, cfg, param = model, model.config, next(model.parameters())
        self.device, self.dtype = param.device, dtype or param.dtype
        self.use_flash = use_flash(getattr(model, "attn_backend", "auto"), self.device, self.dtype)
        block_size = block_size or (256 if self.use_flash else 16)
        auto = num_blocks is None
        if auto:  # a memory budget, halved without flash-attn: the row buffers may take as much
            cuda = self.device.type == "cuda"
            budget = kv_cache_bytes or (kv_budget(self.device) if cuda else 4 << 30)
            num_blocks = kv_pool_tokens(cfg, budget, self.dtype, self.use_flash, block_size)
            num_blocks //= block_size
        row_budget = num_blocks * block_size   # fast_sampling.RowKVCache's token positions
        if auto and max_seq_lens is not None:  # no more than the workload could ever hold
            num_blocks = min(num_blocks, sum(-(-n // block_size) for n in max_seq_lens))
        self.num_blocks = num_blocks
        self.blocks = BlockManager(num_blocks, block_size, share_prefix)
        self.cache = fast_sampling.kv_cache(PagedKVCache, cfg, num_blocks, block_size, self.device,
                                            self.dtype, flash=self.use_flash, row_budget=row_budget,
                                            max_batch=max_num_seqs, max_seq_lens=max_seq_lens)
        self.forward = fast_sampling.CpuForward(model, compile=compile and not self.use_flash)
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.raw_logprobs = False
        self.waiting, self.running, self.held = deque(), deque(), []
        self.new_rollout()

    def new_rollout(self):  # before each use: fresh counters (flash: graphs dropped if stale)
        if self.use_flash:
            self.cache.new_rollout(self.model)
        self.stats = dict(prefill_tokens=0, decode_tokens=0, shared_tokens=0, preemptions=0,
                          kv_pool_tokens=self.num_blocks * self.blocks.block_size, kv_peak_tokens=0)

    def has_work(self):
        return bool(self.waiting or self.running)

    def release(self, seq):
        self.blocks.release(seq)
        if seq in self.held:
            self.held.remove(seq)

    def resume(self, seq, forced_ids):
        """Append forced tokens (mask 0) to a stopped sequence and queue it to continue sampling."""
        self.held.remove(seq)
        seq.append(forced_ids, sampled=False)
        seq.finish_reason = None
        self.waiting.append(seq)

    def _free(self, seq, requeue=False):
        """Preemption: seq loses its blocks, recomputed from its tokens when its turn comes."""
        self.blocks.release(seq)
        self.stats["preemptions"] += 1
        if requeue:
            self.waiting.appendleft(seq)

    def _reclaim(self):
        """Free the newest sequence waiting on a tool, else behind the queue head; False if none."""
        for seq in [*reversed(self.held), *reversed(list(self.waiting)[1:])]:
            if seq.block_table:
                self._free(seq)
                return True
        return False

    def _grow(self, seq):
        self.blocks.grow(seq)
        used = (self.num_blocks - len(self.blocks.free)) * self.blocks.block_size
        self.stats["kv_peak_tokens"] = max(self.stats["kv_peak_tokens"], used)

    def _schedule(self):
        """-> (batch, decode): the waiting sequences that fit (a prefill), else the running ones."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            missing = self.blocks.blocks_missing(seq)
            if missing > len(self.blocks.free):
                if batch or self.running:
                    break
                if self._reclaim():
                    continue
                raise RuntimeError(f"KV cache too small: a sequence of {len(seq)} tokens needs "
                                   f"{missing} blocks of {self.blocks.block_size}, the pool has "
                                   f"{self.num_blocks}")
            if batch and tokens + len(seq) - seq.num_cached > self.max_prefill_tokens:
                break
            before = seq.num_cached
            self._grow(seq)
            self.stats["shared_tokens"] += seq.num_cached - before
            tokens += len(seq) - seq.num_cached
            batch.append(self.waiting.popleft())
        if batch:
            return batch, False
        while self.running:
            seq = self.running.popleft()
            while self.blocks.blocks_missing(seq) > len(self.blocks.free):
                if self.running:  # the newest running sequence makes room
                    self._free(self.running.pop(), requeue=True)
                elif not self._reclaim():  # nothing else to free: seq itself waits
                    self._free(seq, requeue=True)
                    break
            else:  # it fits
                self._grow(seq)
                batch.append(seq)
        self.running = deque(batch)
        return (self.cache.decode_order(batch) if batch else []), True

    @torch.inference_mode()
    def step(self):
        batch, decode = self._schedule()
        if not batch:
            return []
        if decode and self.use_flash:  # bucketed, a CUDA graph replayed: fast_sampling.FlashKVCache
            logits = self.cache.decode_step(self.model, batch)
            self.stats["decode_tokens"] += len(batch)
        else:
            input_ids, positions = self.cache.begin(batch, decode)
            with self.forward(self.cache, decode) as hidden:  # model.hidden (fast on CPU)
                h = hidden(input_ids, positions=positions, kv_cache=self.cache)
                last = h[:, 0] if decode else h[0, self.cache.last_index]  # each sequence's last
                logits = self.model.lm_head(last).float()
            self.stats["decode_tokens" if decode else "prefill_tokens"] += input_ids.numel()
        self.running.extend([] if decode else batch)
        params = [s.params for s in batch]
        if all(p.temperature == 0 for p in params):  # the eval / test path: no sort, no uniforms
            tokens = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
        else:
            u = [s.next_uniform() if p.temperature > 0 else 0.0 for s, p in zip(batch, params)]
            columns = (torch.tensor([getattr(p, name) for p in params])
                       for name in ("temperature", "top_p", "top_k"))
            tokens, logp = sample(logits, *columns, torch.tensor(u, dtype=torch.float64))
        cols = [tokens.double(), logp.double()]
        if self.raw_logprobs:
            cols.append(torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0].double())
        rows = torch.stack(cols, 1).tolist()  # the step's one read back to the host
        for seq, (token, logp, *raw) in zip(batch, rows):
            seq.num_cached = len(seq)
            seq.append([int(token)], True, logp, raw[0] if raw else None)
            stop = int(token) in seq.params.stop_token_ids
            full = seq.num_response >= seq.params.max_tokens
            seq.finish_reason = "stop" if stop else "length" if full else None
        stopped = [seq for seq in batch if seq.finish_reason]
        if stopped:  # the running queue is rebuilt only when a sequence ends, not every step
            self.running = deque(s for s in self.running if s.finish_reason is None)
            self.held += stopped
        return stopped


def sequence_seed(seed, index):
    """Each sequence's generator seed: reproducible per (seed, index), random when seed is None."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 1
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def complete(model, prompts, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
             stop_token_ids=(), seed=None, raw_logprobs=False, engine=None, **engine_kwargs):
    """generate with log-probs and finish reasons; max_new_tokens: an int or one per prompt."""
    one_each = not isinstance(max_new_tokens, int)
    budgets = list(max_new_tokens) if one_each else [max_new_tokens] * len(prompts)
    if engine is None:
        max_seq_lens = [len(p) + b for p, b in zip(prompts, budgets)]
        engine = Engine(model, **{"max_seq_lens": max_seq_lens, **engine_kwargs})
    engine.new_rollout()
    engine.raw_logprobs = raw_logprobs
    stop = frozenset(stop_token_ids)
    seqs = [Sequence(p, SamplingParams(temperature, top_p, top_k, b, stop), sequence_seed(seed, i))
            for i, (p, b) in enumerate(zip(prompts, budgets))]
    engine.waiting += [s for s in seqs if s.params.max_tokens > 0]
    while engine.has_work():
        for seq in engine.step():
            engine.release(seq)
    return [Completion(s.token_ids[s.num_prompt:], s.logprobs,
                       s.raw_logprobs if raw_logprobs else None, s.finish_reason or "length")
            for s in seqs]


def generate(model, prompts, max_new_tokens, temperature=0.0, top_p=1.0, stop_token_ids=(),
             seed=None, **kwargs):
    """Token-id prompts -> the new ids of each, a stop token included; kwargs as complete."""
    return [c.token_ids for c in complete(model, prompts, max_new_tokens, temperature, top_p,
                                          stop_token_ids=stop_token_ids, seed=seed, **kwargs)]


class ChatFormat:
    """Token ids of the chat protocol. The one rule (docs/DESIGN.md): message text never becomes
    an added token. `mark` swaps added-token strings in message text for private-use characters;
    `encode` splits the rendering at the added tokens left (the template's), the rest plain text."""

    ASSISTANT, CONTENT = "ASSISTANT_PLACEHOLDER_5f1c", "CONTENT_PLACEHOLDER_{}_9d2e"
    PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ASSISTANT}]
    MARKS = 0xF0000  # the marks: U+F0000.. (Supplementary Private Use Area-A), one per added token

    def __init__(self, tokenizer, tools=None, enable_thinking="default"):
        from transformers import GenerationConfig
        if enable_thinking not in ("default", "true", "false"):
            raise ValueError("enable_thinking must be default, true or false, "
                             f"not {enable_thinking!r}")
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None
        on = {"enable_thinking": enable_thinking == "true"}  # the template's own switch (Qwen3)
        self.template_kwargs = {} if enable_thinking == "default" else on  # default: pass nothing
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        self.added_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in added}
        alternatives = "|".join(map(re.escape, added))
        self._added_re = re.compile(f"({alternatives})" if added else "(?!)")
        self.marks = {t: chr(self.MARKS + i) for i, t in enumerate(added)}
        self._unmark = {ord(m): t for t, m in self.marks.items()}
        self.end_of_turn = self.encode(self.render(self.PROBE).split(self.ASSISTANT)[1])[0]
        self.end_of_turn_text = tokenizer.decode([self.end_of_turn])
        try:  # a checkpoint's end ids, in generation_config.json (Qwen: <|im_end|>, <|endoftext|>)
            ends = GenerationConfig.from_pretrained(tokenizer.name_or_path,
                                                    local_files_only=True).eos_token_id
        except OSError:
            ends = None
        ends = tokenizer.eos_token_id if ends is None else ends
        ends = [ends] if isinstance(ends, int) else ends or []
        self.stop_ids = frozenset({self.end_of_turn, *ends})
        self._pieces = {}

    def render(self, messages, add_generation_prompt=False, tools=None):
        """The chat template's text (tools: this call's schemas instead of the format's)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or self.tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def mark(self, text, keep=()):
        """text with every added-token string in it (but those in `keep`) swapped for its mark."""
        if any(ord(c) in self._unmark for c in text):  # a mark's own character: made U+FFFD
            text = text.translate({c: "\ufffd" for c in self._unmark})
        return self._added_re.sub(
            lambda m: m.group(0) if m.group(0) in keep else self.marks[m.group(0)], text)

    def mark_messages(self, messages, keep=()):
        """A copy of the messages, the text of each (content, reasoning, tool-call args) marked."""
        def walk(x):
            if isinstance(x, str):
                return self.mark(x, keep)
            if isinstance(x, dict):
                return {k: walk(v) if k != "role" else v for k, v in x.items()}
            return [walk(v) for v in x] if isinstance(x, list) else x
        return [walk(m) for m in messages]

    def unmark(self, text):
        return text.translate(self._unmark)

    def encode(self, text):
        """Ids of a (marked) rendering: the template's added tokens, other text through normalizer,
        pre-tokenizer and model (split_special_tokens still matches non-special added tokens)."""
        ids, backend = [], self.tokenizer.backend_tokenizer
        norm, pre = backend.normalizer, backend.pre_tokenizer
        for j, part in enumerate(self._added_re.split(text)):
            if j % 2:
                ids.append(self.added_ids[part])
            elif part:
                part = norm.normalize_str(self.unmark(part)) if norm else self.unmark(part)
                words = pre.pre_tokenize_str(part) if pre else [(part, None)]
                ids += [t.id for word, _ in words for t in backend.model.tokenize(word)]
        return ids

    def prompt_ids(self, prompt, system=None):
        system = [{"role": "system", "content": system}] if system is not None else []
        messages = self.mark_messages(system + [{"role": "user", "content": prompt}])
        return self.encode(self.render(messages, True))

    def forced_ids(self, role, contents):
        """Ids after an assistant's end-of-turn, forced (mask 0): `role` messages of `contents`,
        then the next prompt. The n + 1 template strings around n messages are rendered once."""
        key = (role, len(contents))
        if key not in self._pieces:
            slots = [self.CONTENT.format(i) for i in range(len(contents))]
            text = self.render(self.PROBE + [{"role": role, "content": s} for s in slots], True)
            text = text.split(self.ASSISTANT, 1)[1]
            if not text.startswith(self.end_of_turn_text):
                raise ValueError("chat template: assistant turn does not end with "
                                 f"{self.end_of_turn_text!r}")
            text = text[len(self.end_of_turn_text):]
            self._pieces[key] = re.split("|".join(slots), text) if slots else [text]
        pieces = self._pieces[key]
        return self.encode("".join(p + self.mark(c) for p, c in zip(pieces, contents)) + pieces[-1])


# A tool the model may call: its schema (function.name names it) and `call(arguments, sandbox,
# config) -> Future` of (status, reply) or the reply; a ValueError from call refuses the call.
Tool = namedtuple("Tool", "schema call")


def call_outcome(refusal, future):
    """(status, reply) of one call, the one place a status is decided: a refusal "bad_call"; else
    from the Future: raised "error", a str "ok", (status, text) the tool's own (docs/SANDBOX.md)."""
    try:
        reply = ("bad_call", refusal) if refusal is not None else future.result()
        status, text = ("ok", reply) if isinstance(reply, str) else reply
    except Exception as e:  # a sandbox failure is the tool's answer, not a crash of the rollout
        status, text = "error", f"Error: the tool failed: {type(e).__name__}: {e}"[:200]
    # a lone surrogate (JSON's "\ud800" in the call, a tool's output) has no UTF-8 and no token
    return status, text.encode("utf-8", "backslashreplace").decode()


def run_code(arguments, sandbox, config):
    """The code interpreter (sandbox.prepare_code) -> Future of (status, output cut to length)."""
    import sandbox as sandbox_module
    code = arguments.get("code")
    if not isinstance(code, str):
        raise ValueError('Error: code_interpreter needs a string argument "code".')
    prepare, submit, fmt = (getattr(sandbox, name, None) or getattr(sandbox_module, name)
                            for name in ("prepare_code", "submit", "format_tool_output"))
    reply = concurrent.futures.Future()

    def done(run):
        try:
            result = run.result()
            reply.set_result((result.status, fmt(result, config.tool_output_chars)))
        except BaseException as e:  # failed or cancelled ("error"): the reply always resolves
            reply.set_exception(e)
    run = submit(prepare(code), timeout=config.tool_timeout, memory_mb=config.tool_memory_mb)
    run.add_done_callback(done)
    return reply


# The tools the rollout offers, by name. To add one: TOOLS["name"] = Tool(schema, call), or tools=
TOOLS = {"code_interpreter": Tool(CODE_INTERPRETER, run_code)}


def parse_json(text, max_depth=64):
    """json.loads of model text -> (value, None), else (None, why); nesting past max_depth too."""
    try:
        row = [value := json.loads(text)]
    except (ValueError, RecursionError) as e:  # bad JSON, a number past 4300 digits, too deep
        return None, f"{e.msg} at char {e.pos}" if hasattr(e, "pos") else "too large or too deep"
    for _ in range(max_depth):   # level by level: deeper would raise RecursionError wherever
        row = [x for v in row if type(v) in (dict, list)       # the call's record is copied
               for x in (v.values() if type(v) is dict else v)]
    return (None, f"nested deeper than {max_depth}") if row else (value, None)


def parse_tool_calls(text, max_calls=1):
    """[(name, arguments, refusal: None or the reply to a malformed call)] of the blocks verl's
    HermesToolParser finds: the first max_calls that parse, the first max_calls that do not (verl
    drops them), and a <tool_call> left open."""
    calls, parsed, bad, at = [], 0, 0, text.find("<tool_call>")
    while at >= 0 and (end := text.find("</tool_call>", at)) >= 0:
        body, at = text[at + len("<tool_call>"):end], text.find("<tool_call>", end)
        call, why = parse_json(body)
        if why or not isinstance(call, dict) or not isinstance(call.get("name"), str):
            if (bad := bad + 1) <= max_calls:     # a turn of them: bounded work, a short reply
                calls.append((None, None, f"Error: the tool call is not valid JSON ({why})." if why
                              else 'Error: a tool call is {"name": ..., "arguments": {...}}.'))
        elif (parsed := parsed + 1) <= max_calls:
            args = call.get("arguments")  # some models write the arguments as a JSON string
            args = parse_json(args)[0] if isinstance(args, str) else args
            calls.append((call["name"], args if isinstance(args, dict) else {}, None))
    if at >= 0:                        # a <tool_call> left open after the last block
        calls.append((None, None, "Error: the tool call is not closed with </tool_call>."))
    return calls


class Agent:
    """One trajectory's agent-loop state around its engine sequence."""
    def __init__(self, problem_index, sample_index, seq):
        self.problem_index, self.sample_index, self.seq = problem_index, sample_index, seq
        self.turn_start = len(seq)          # where the current assistant turn begins
        self.num_turns, self.tool_calls, self.finish_reason = 0, [], None
        self.pending = []   # [(call record, refusal, Future)] of the turn being answered

    def trajectory(self, tokenizer):
        seq, response = self.seq, self.seq.token_ids[self.seq.num_prompt:]
        text = tokenizer.decode(response, skip_special_tokens=False)
        return Trajectory(self.problem_index, self.sample_index, seq.token_ids[:seq.num_prompt],
                          response, list(seq.mask), list(seq.logprobs), text, self.tool_calls,
                          self.num_turns, self.finish_reason)


class AgentLoop:
    """Sample a turn, run its tool calls off the batch, force the reply, resume."""

    def __init__(self, engine, chat, config, sandbox=None, tools=None):
        self.engine, self.chat, self.config = engine, chat, config
        self.sandbox, self.tools = sandbox, tools or TOOLS

    def run(self, prompts, keys, seeds=None):
        """keys: (problem_index, sample_index) per prompt; seeds: one per prompt -> the Agents."""
        cfg = self.config
        params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_response_tokens,
                                self.chat.stop_ids)
        seeds = seeds or [sequence_seed(cfg.seed, k) for k in range(len(prompts))]
        agents = [Agent(i, j, Sequence(p, params, s)) for p, (i, j), s in zip(prompts, keys, seeds)]
        by_seq, waiting = {id(a.seq): a for a in agents}, []  # waiting: their tool calls are out
        self.engine.waiting += [a.seq for a in agents]
        while self.engine.has_work() or waiting:
            for a in [a for a in waiting if all(f.done() for _, _, f in a.pending)]:
                waiting.remove(a)
                self._answer(a)
            if self.engine.has_work():
                for seq in self.engine.step():
                    if self._end_turn(by_seq[id(seq)]):
                        waiting.append(by_seq[id(seq)])
            elif waiting:
                concurrent.futures.wait([f for a in waiting for _, _, f in a.pending],
                                        return_when=concurrent.futures.FIRST_COMPLETED)
        return agents

    def _finish(self, agent, reason):
        agent.finish_reason = reason
        self.engine.release(agent.seq)

    def _end_turn(self, agent):
        """An assistant turn ended; True if its tool calls were sent off."""
        seq, cfg, tokenizer = agent.seq, self.config, self.chat.tokenizer
        agent.num_turns += 1
        turn = tokenizer.decode(seq.token_ids[agent.turn_start:], skip_special_tokens=False)
        calls = parse_tool_calls(turn, cfg.max_parallel_calls)
        if seq.finish_reason == "length" or (calls and seq.num_response >= seq.params.max_tokens):
            reason = "length"     # the budget ran out in the turn, or left no room for a reply
        elif seq.token_ids[-1] != self.chat.end_of_turn:
            reason = "eos"        # another end id (<|endoftext|>): no template renders a reply
        elif not calls:
            reason = "stop"       # an answer without a call ends the trajectory
        elif agent.num_turns >= cfg.max_turns:
            reason = "max_turns"  # a call in the last allowed turn is not run
        else:
            agent.pending = [self._dispatch(agent, *call) for call in calls]
            return True
        return self._finish(agent, reason)

    def _dispatch(self, agent, name, arguments, refusal):
        """(call record, refusal, Future): sent to its tool unless refused, then resolved now."""
        turn = agent.num_turns - 1
        record = {"name": name, "arguments": arguments, "status": None, "output": "", "turn": turn}
        future = concurrent.futures.Future()
        if refusal is None and name not in self.tools:
            refusal = f"Error: unknown tool {name[:64]!r}; the tools are {', '.join(self.tools)}."
        if refusal is None:
            try:
                future = self.tools[name].call(arguments, self.sandbox, self.config)
            except ValueError as e:   # the tool refused the arguments
                refusal = str(e)
            except Exception as e:    # a closed or broken pool: a failure inside the Future
                future.set_exception(e)
        if refusal is not None:
            future.set_result(None)
        return record, refusal, future

    def _answer(self, agent):
        """A turn's calls are all back: force the tool reply and resume, or stop at the budget."""
        for record, refusal, future in agent.pending:
            record["status"], record["output"] = call_outcome(refusal, future)
            agent.tool_calls.append(record)
        seq, outputs, agent.pending = agent.seq, [r["output"] for r, _, _ in agent.pending], []
        forced = self.chat.forced_ids("tool", outputs)   # mask 0
        room = seq.params.max_tokens - seq.num_response
        if len(forced) >= room:  # no room to sample after the reply: cut it at the budget
            seq.append(forced[:room], sampled=False)
            return self._finish(agent, "length")
        self.engine.resume(seq, forced)
        agent.turn_start = len(seq)


def chat_format(tokenizer, config, tools=None):
    """The ChatFormat rollout() renders prompts and replies with: tool schemas, template switch."""
    schemas = [t.schema for t in (tools or TOOLS).values()]
    return ChatFormat(tokenizer, schemas, config.enable_thinking)


def rollout(model, tokenizer, problems, config, sandbox=None, seeds=None, engine=None, tools=None,
            **engine_kwargs):
    """config.n trajectories per problem, grouped by problem. sandbox: has submit(code, timeout,
    memory_mb) -> Future[Result] (maybe prepare_code, format_tool_output; default: the sandbox
    module). seeds: one per problem: sample j of problem i draws the same tokens in any batch."""
    chat = chat_format(tokenizer, config, tools)
    if seeds is not None and len(seeds) != len(problems):
        raise ValueError(f"{len(seeds)} seeds for {len(problems)} problems")
    prompts, keys = [], []
    for i, problem in enumerate(problems):
        ids = chat.prompt_ids(problem["prompt"], problem.get("system"))
        if len(ids) > config.max_prompt_tokens:
            raise ValueError(f"problem {i}: prompt is {len(ids)} tokens, "
                             f"over max_prompt_tokens={config.max_prompt_tokens}")
        prompts += [ids] * config.n
        keys += [(i, j) for j in range(config.n)]
    if engine is None:
        max_seq_lens = [len(p) + config.max_response_tokens for p in prompts]
        engine = Engine(model, **{"max_seq_lens": max_seq_lens, **engine_kwargs})
    engine.new_rollout()
    per_sequence = [sequence_seed(seeds[i], j) for i, j in keys] if seeds is not None else None
    agents = AgentLoop(engine, chat, config, sandbox, tools).run(prompts, keys, per_sequence)
    return [a.trajectory(tokenizer) for a in agents]
