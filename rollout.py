"""rollout.py: the KV-cached batched sampler and the multi-turn agent loop with tool calls.

What it does
- `generate(model, prompts, max_new_tokens, ...)`: batched sampling from token-id prompts, the
  way vLLM does it but in one readable file (see nano-vllm / gpt-fast for the style):
  * Paged KV cache: one preallocated pool of fixed-size blocks per layer and a block table per
    sequence, so KV memory follows the tokens actually held, not slots x max length. The pool
    size comes from a memory budget (a fraction of free memory on CUDA, a byte count on CPU),
    capped at what the workload could ever use.
  * Continuous batching: a sequence that finishes frees its slot and blocks at once and a waiting
    one is admitted. When blocks run out, the newest running sequence is preempted: its blocks
    are freed and it is recomputed later from its tokens, so the result does not change.
  * Shared prompts: full blocks are keyed by (previous block, their tokens), so the n samples of
    one prompt prefill it once and share its blocks (reference-counted).
  * A step either prefills the new / resumed sequences as one packed variable-length batch or
    decodes one token for every running sequence. On CUDA with flash-attn installed, attention
    reads the paged cache directly (`flash_attn_varlen_func` / `flash_attn_with_kvcache` with a
    block table). Elsewhere prefill uses torch SDPA, and decode keeps the running sequences' K/V
    in contiguous row buffers between steps: each step writes one token per row instead of
    gathering every block again, and the buffers are refilled from the pool only when the batch
    changes or outgrows them (or, past a memory budget, each group's blocks are gathered per
    step). Rows are sorted by length and attended in groups, so a ragged batch is not padded to
    its longest row.
  * Sampling: greedy at temperature 0; temperature, top-k, then top-p (the smallest set of most
    probable tokens whose mass reaches top_p, computed on the top-k distribution), by inverse-CDF
    from one uniform per token drawn from the sequence's own seeded `torch.Generator`, so a seeded
    run gives the same tokens whatever the batching, preemption or tool timing. Each token comes
    with its log-prob under the distribution it was drawn from (renormalised after top-k/top-p;
    at temperature 0, under the unmodified distribution) and optionally under the unmodified
    temperature-1 distribution (`complete(..., raw_logprobs=True)`), to measure the mismatch with
    the trainer. One host sync per step (the sampled tokens), none per token.
- `rollout(model, tokenizer, problems, config, sandbox=...)`: the agent loop (DESIGN.md, tool-call
  protocol). Each problem's prompt is rendered with the chat template and the code_interpreter
  schema; n trajectories per problem. When an assistant turn ends (end-of-turn token or EOS) and
  holds `<tool_call>` blocks, each call is parsed (bad JSON, unknown tool, missing code: a short
  error text, status bad_call), its code goes to the sandbox asynchronously (a Future) and the
  trajectory leaves the decode batch, keeping its KV blocks, while the others keep decoding. When
  the results are back, the forced tool-reply tokens (loss mask 0) are prefilled and it resumes.
  The reply tokens come from the chat template itself: the template is rendered once with
  placeholder messages and split there, and tool output is encoded as plain text
  (split_special_tokens) so a special-token string in program output stays text. Token in, token
  out: nothing already held as ids is re-tokenised. `seeds=` (one per problem) makes a problem's
  samples independent of which other problems share the call, so 1 and N ranks sample alike.
- CLI: a chat REPL with the code tool, and a benchmark against transformers' generate.

Departures from the paper (which samples with vLLM inside verl's agent loop)
- Plain PyTorch engine; no CUDA graphs yet (the decode step is the seam: fixed-shape buffers
  padded to batch buckets would let it be captured).
- Prefix sharing lasts while some sequence holds the blocks (no cache of freed blocks).
- Every `<tool_call>` in a turn is run; the replies share one user turn, as the template renders
  consecutive tool messages. A tool call in the last allowed turn (max_turns) is not run: the
  trajectory ends there with finish_reason "max_turns" (verl's agent loop does the same).
- A tool reply that would cross the response budget is cut at the budget ("length").
- A prompt longer than max_prompt_tokens is an error (filter the data; nothing is truncated).
- Trajectory.tool_calls lists the calls that ran (or failed to parse); num_turns counts
  assistant turns, the one cut by the budget included.

Usage
    python rollout.py --model DIR [--device=cuda] [--temperature=0.7] [--max_turns=8] ...
        # chat REPL with the code tool; any RolloutConfig field as --name=value; /reset, /quit
    python rollout.py --bench [--quick] [--threads=1]
        # random Qwen3 on CPU (or --device=cuda): tokens/s of generate vs transformers.generate at
        # batch 32, equal prompts (128 and 512 new tokens) and ragged prompts (greedy tokens checked
        # identical), continuous vs static batching on long-tailed lengths, tool latency overlapped
        # vs blocking; wall and CPU time (on a shared machine prefer --threads=1). --bench4b adds
        # decode tokens/s of a random Qwen3-4B-shaped model at batch 64 and 256 (meant for a GPU)
No torchrun form: the sampler runs inside each rl.py / evaluate.py rank on its own GPU.
"""

import argparse
import concurrent.futures
import json
import os
import re
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # optional GPU kernels (paged KV)
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except Exception:  # ImportError, or a broken CUDA build
    flash_attn_varlen_func = flash_attn_with_kvcache = None


# -----------------------------------------------------------------------------
# configuration and results


@dataclass
class RolloutConfig:
    n: int = 1                         # trajectories per problem
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0: off
    max_prompt_tokens: int = 2560
    max_response_tokens: int = 20480   # counts the forced tool-reply tokens too
    max_turns: int = 16                # assistant turns
    tool_output_chars: int = 256       # tool output cut to this many characters (head + tail)
    tool_timeout: float = 10.0
    tool_memory_mb: int = 1024
    seed: int | None = None


@dataclass
class Trajectory:
    problem_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]       # 1 on sampled tokens, 0 on forced tool-reply tokens
    logprobs: list[float]      # sampler log-probs, 0.0 where mask is 0
    text: str                  # decoded response (tool replies included, special tokens kept)
    tool_calls: list[dict]     # {"code": str | None, "status": ok|error|timeout|memory|killed|bad_call, "output": str}
    num_turns: int
    finish_reason: str         # "stop" | "length" | "max_turns"

    def to_dict(self):
        return asdict(self)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256              # response tokens, sampled and forced
    stop_token_ids: frozenset = frozenset()


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    raw_logprobs: list[float] | None   # under the unmodified T=1 distribution, if asked for
    finish_reason: str                 # "stop" | "length"


# -----------------------------------------------------------------------------
# sequences and the paged KV cache


class Sequence:
    """One sequence's tokens, sampling state and place in the KV cache."""

    def __init__(self, prompt_ids, params, seed):
        if not prompt_ids:
            raise ValueError("empty prompt")
        self.token_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.params = params
        self.mask, self.logprobs, self.raw_logprobs = [], [], []   # per response token
        self.num_cached = 0      # leading tokens whose K/V sit in the cache
        self.block_table = []    # cache block ids, in order
        self.finish_reason = None
        self.generator = torch.Generator().manual_seed(seed)
        self.uniforms = []       # pre-drawn from generator, consumed one per sampled token

    def __len__(self):
        return len(self.token_ids)

    @property
    def response_ids(self):
        return self.token_ids[self.num_prompt:]

    @property
    def num_response(self):
        return len(self.token_ids) - self.num_prompt

    def next_uniform(self):
        if not self.uniforms:  # drawn in fixed-size chunks: the stream is the same however it is consumed
            self.uniforms = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self.uniforms.pop()

    def append_sampled(self, token, logprob, raw_logprob):
        self.token_ids.append(token)
        self.mask.append(1)
        self.logprobs.append(logprob)
        self.raw_logprobs.append(raw_logprob)

    def append_forced(self, ids):
        self.token_ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.raw_logprobs.extend([0.0] * len(ids))


class BlockManager:
    """Hands out the fixed-size cache blocks and counts their holders.

    A full block is registered under (previous block id, its tokens): the previous block id stands
    for the whole prefix, so the key is exact. A fresh sequence whose first blocks are registered
    takes them instead of recomputing: the n samples of a prompt pay for one prefill. The block
    holding a sequence's last token is never shared, since that token is recomputed for its logits.
    """

    def __init__(self, num_blocks, block_size, share_prefix=True):
        self.block_size = block_size
        self.share_prefix = share_prefix
        self.free = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.key_of, self.block_of = {}, {}   # block id <-> key, for shareable full blocks

    @property
    def num_free(self):
        return len(self.free)

    def _key(self, seq, i):
        bs = self.block_size
        parent = seq.block_table[i - 1] if i else -1
        return parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])

    def _shared_prefix(self, seq):
        """Registered blocks that can stand for seq's leading tokens (fresh sequences only)."""
        if seq.block_table or not self.share_prefix:
            return []
        hits, parent, bs = [], -1, self.block_size
        for i in range((len(seq) - 1) // bs):
            block = self.block_of.get((parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits

    def blocks_missing(self, seq):
        """New blocks seq needs so that all its tokens have a slot."""
        needed = -(-len(seq) // self.block_size)
        return needed - len(seq.block_table) - len(self._shared_prefix(seq))

    def grow(self, seq):
        """Give seq slots for all its tokens: shared prefix blocks first, then new ones."""
        for block in self._shared_prefix(seq):
            self.refcount[block] += 1
            seq.block_table.append(block)
            seq.num_cached = len(seq.block_table) * self.block_size
        full_before = seq.num_cached // self.block_size
        while len(seq.block_table) * self.block_size < len(seq):
            block = self.free.popleft()
            self.refcount[block] = 1
            seq.block_table.append(block)
        # Blocks this step fills completely can be shared from now on: within each layer every new
        # K/V is written before anything is read, so a sibling prefilled in the same step sees them.
        if self.share_prefix:
            for i in range(full_before, len(seq) // self.block_size):
                key, block = self._key(seq, i), seq.block_table[i]
                if key not in self.block_of and block not in self.key_of:
                    self.block_of[key], self.key_of[block] = block, key

    def release(self, seq):
        for block in seq.block_table:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                key = self.key_of.pop(block, None)
                if key is not None:
                    del self.block_of[key]
                self.free.append(block)
        seq.block_table, seq.num_cached = [], 0


class PagedKVCache:
    """The K/V block pools and the per-step layout of the batch; `attend` is model.py's seam.

    Pools are [num_blocks, block_size, kv_heads, head_dim] per layer (flash-attn's paged layout).
    Without flash-attn, decode reads row buffers instead: see decode_order.
    `begin(batch, decode)` lays out one step: the tokens to compute (each sequence's uncached
    tail, packed), their positions and cache slots, and each sequence's block table and length.
    """

    row_headroom = 128   # decode row buffers: free positions past the longest row when (re)built

    def __init__(self, config, num_blocks, block_size, device, dtype, use_flash, row_budget=0):
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # zeros, not empty: padded reads get weight 0, and 0 * NaN garbage would still be NaN
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.block_size, self.device, self.use_flash = block_size, device, use_flash
        self.scratch = None  # gathered k, v of one layer (prefill after a cached prefix), reused
        # CPU/SDPA decode: the running sequences' K/V, copied out of the pool once and then extended
        # by one token per step, contiguous per row so attention reads them without a gather
        self.rows, self.row_cached = [], []          # sequences in row order; positions each row holds
        self.rows_k, self.rows_v, self.row_capacity = [], [], 0
        self.rows_stale = []                         # per layer: rows must be refilled from the pool
        self.row_budget, self.use_rows = row_budget, False   # rows x capacity may not pass row_budget tokens

    def _tensor(self, values, dtype):
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":  # async copy from pinned memory: no sync with the GPU queue
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def begin(self, batch, decode):
        """Lay out one step; returns (input_ids, positions) shaped for model.hidden."""
        bs = self.block_size
        ids, positions, slots, q_lens, k_lens = [], [], [], [], []
        for seq in batch:
            start, end = seq.num_cached, len(seq)
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            q_lens.append(end - start)
            k_lens.append(end)
        max_blocks = max(len(s.block_table) for s in batch)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch]
        self.seqs, self.decode = batch, decode
        self.q_lens, self.k_lens = q_lens, k_lens
        self.slots = self._tensor(slots, torch.long)
        self.block_tables = self._tensor(tables, torch.int32)
        self.context_lens = self._tensor(k_lens, torch.int32)
        cu_q = [0]
        for n in q_lens:
            cu_q.append(cu_q[-1] + n)
        self.cu_q = cu_q
        self.last_index = self._tensor([c - 1 for c in cu_q[1:]], torch.long)  # each sequence's last token
        if self.use_flash and not decode:
            self.cu_q_t = self._tensor(cu_q, torch.int32)
            self.cu_k_t = self._tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), torch.int32)
        if decode and not self.use_flash:
            self._layout_decode(batch)
        shape = (len(batch), 1) if decode else (1, len(ids))
        return self._tensor(ids, torch.long).view(shape), self._tensor(positions, torch.long).view(shape)

    # -- CPU decode rows ------------------------------------------------------

    def decode_order(self, batch):
        """The decode batch in the order of the row buffers. While the same sequences keep decoding,
        each step writes one token's k/v per row and layer instead of gathering every block again;
        when the set changes, or a row outgrows the buffers, the rows are laid out again, longest
        first, and refilled from the pool once. Rows are padded to the longest, so when
        rows x capacity would pass row_budget tokens, decode gathers each group's blocks from the
        pool instead, every step. flash-attn reads the pool: any order does."""
        if self.use_flash:
            return batch
        same = (self.use_rows and len(batch) == len(self.rows) and {id(s) for s in batch} == {id(s) for s in self.rows}
                and all(s.num_cached == n for s, n in zip(self.rows, self.row_cached))
                and max(map(len, batch)) <= self.row_capacity)
        if same:
            return self.rows
        rows = sorted(batch, key=len, reverse=True)  # similar lengths side by side (see _layout_decode)
        step = self.row_headroom  # rebuilt every row_headroom steps at most (less as capacity doubles)
        capacity = -(-(len(rows[0]) + step) // step) * step
        self.use_rows = len(rows) * capacity <= self.row_budget
        self.rows = rows if self.use_rows else []
        if self.use_rows:
            self._alloc_rows(len(rows), capacity)
            self.rows_stale = [True] * len(self.k)
        return rows

    def _alloc_rows(self, num_rows, capacity):
        have_rows, have_capacity = (self.rows_k[0].shape[0], self.rows_k[0].shape[2]) if self.rows_k else (0, 0)
        if num_rows <= have_rows and capacity <= have_capacity:
            self.row_capacity = have_capacity
            return
        if capacity > have_capacity:  # geometric growth: a long decode reallocates and refills log(n) times
            capacity = max(capacity, min(2 * have_capacity, self.row_budget // num_rows))
        _, _, hkv, d = self.k[0].shape
        self.rows_k = self.rows_v = None  # free the old buffers first
        # zeros: a masked slot gets weight 0, and 0 * NaN garbage would still be NaN
        self.rows_k = [torch.zeros(num_rows, hkv, capacity, d, device=self.device, dtype=self.k[0].dtype) for _ in self.k]
        self.rows_v = [torch.zeros_like(t) for t in self.rows_k]
        self.row_capacity = capacity

    def forget(self, seq):
        """seq lost its blocks (finished, preempted): its row can no longer be extended."""
        if any(s is seq for s in self.rows):
            self.rows = []

    def _layout_decode(self, batch):
        """The row groups attended together: runs of rows (longest first) whose longest is under twice
        their shortest, each padded to its longest and masked, so a ragged batch is not padded to its
        longest row; with row buffers, also where this step's k/v go."""
        lengths = [len(s) for s in batch]
        if self.use_rows:
            self.row_cached = lengths
            self.row_index = torch.arange(len(batch), device=self.device)
            self.row_pos = self._tensor([n - 1 for n in lengths], torch.long)
        self.decode_groups, start = [], 0
        for i in range(1, len(batch) + 1):
            if i == len(batch) or 2 * lengths[i] <= lengths[start]:
                width, bias = lengths[start], None
                if lengths[i - 1] < width:  # -inf on each row's key slots past its length
                    pad = torch.arange(width, device=self.device) >= self.context_lens[start:i, None].long()
                    bias = torch.zeros(pad.shape, device=self.device).masked_fill_(pad, float("-inf"))[:, None, None, :]
                self.decode_groups.append((start, i, width, bias))
                start = i

    def _fill_rows(self, layer):
        """Copy every row's cached K/V (positions < num_cached) out of the pool, head-major."""
        n_blocks = max(-(-s.num_cached // self.block_size) for s in self.rows)
        blocks = self.block_tables[:, :n_blocks].flatten().long()
        width = min(n_blocks * self.block_size, self.row_capacity)  # the last block may overhang the buffer
        for pool, rows in ((self.k[layer], self.rows_k[layer]), (self.v[layer], self.rows_v[layer])):
            gathered = torch.index_select(pool, 0, blocks).view(len(self.rows), -1, *pool.shape[2:])
            rows[:len(self.rows), :, :width].copy_(gathered[:, :width].transpose(1, 2))
        self.rows_stale[layer] = False

    def attend(self, layer, q, k, v):
        """Store this step's k/v in their slots, then attend over everything each sequence holds."""
        B, T, Hq, D = q.shape
        q, k, v = q.reshape(B * T, Hq, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)
        k_pool, v_pool = self.k[layer], self.v[layer]
        k_pool.view(-1, *k.shape[1:]).index_copy_(0, self.slots, k.to(k_pool.dtype))
        v_pool.view(-1, *v.shape[1:]).index_copy_(0, self.slots, v.to(v_pool.dtype))
        if self.use_flash:
            out = self._attend_flash(q, k_pool, v_pool)
        elif self.decode:
            out = self._attend_decode(layer, q, k, v)
        else:
            out = self._attend_prefill(q, k, v, k_pool, v_pool)
        return out.reshape(B, T, Hq, D)

    def _gather(self, k_pool, v_pool, blocks):
        """k, v of the given blocks, copied into the scratch buffer: [n, block_size, Hkv, D] each."""
        n = blocks.numel()
        if self.scratch is None or self.scratch.shape[1] < n:
            self.scratch = k_pool.new_empty((2, max(n, 64), *k_pool.shape[1:]))
        k = torch.index_select(k_pool, 0, blocks, out=self.scratch[0, :n])  # much faster than pool[blocks]
        v = torch.index_select(v_pool, 0, blocks, out=self.scratch[1, :n])
        return k, v

    def _attend_decode(self, layer, q, k, v):
        # one query per row, attended per group of similar lengths over [rows, Hkv, width, D] keys
        if self.use_rows:
            if self.rows_stale[layer]:
                self._fill_rows(layer)
            rows_k, rows_v = self.rows_k[layer], self.rows_v[layer]
            rows_k[self.row_index, :, self.row_pos] = k.to(rows_k.dtype)      # k, v [B, Hkv, D]
            rows_v[self.row_index, :, self.row_pos] = v.to(rows_v.dtype)
        B, Hq, D = q.shape
        hkv = k.shape[1]
        outs = []
        for start, end, width, bias in self.decode_groups:
            n = end - start
            if self.use_rows:
                keys, values = rows_k[start:end, :, :width], rows_v[start:end, :, :width]
            else:  # copy the group's blocks out of the pool (this step's k/v are already there)
                blocks = self.block_tables[start:end, :-(-width // self.block_size)].flatten().long()
                keys, values = self._gather(self.k[layer], self.v[layer], blocks)
                keys, values = (t.view(n, -1, hkv, D)[:, :width].transpose(1, 2).contiguous() for t in (keys, values))
            qg = q[start:end].view(n, hkv, Hq // hkv, D)                 # query head h reads kv head h // G
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * D ** -0.5  # [n, Hkv, G, width]
            if bias is not None:
                scores = scores + bias
            probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
            outs.append(torch.matmul(probs, values).view(n, Hq, D))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend_prefill(self, q, k, v, k_pool, v_pool):
        # one causal attention per sequence; a sequence with cached tokens reads them from its blocks
        outs = []
        for i, (q_len, k_len) in enumerate(zip(self.q_lens, self.k_lens)):
            s, e = self.cu_q[i], self.cu_q[i + 1]
            qi = q[s:e].transpose(0, 1)[None]                              # [1, Hq, q_len, D]
            if q_len == k_len:
                ki, vi, mask = k[s:e], v[s:e], None
            else:
                ki, vi = self._gather(k_pool, v_pool, self.block_tables[i, :-(-k_len // self.block_size)].long())
                ki, vi = ki.flatten(0, 1)[:k_len], vi.flatten(0, 1)[:k_len]
                # query j sits at position k_len - q_len + j and sees keys up to there
                mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
            ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    def _attend_flash(self, q, k_pool, v_pool):
        # flash-attn reads the paged pools through the block table (block size a multiple of 256)
        if self.decode:
            out = flash_attn_with_kvcache(q[:, None], k_pool, v_pool, cache_seqlens=self.context_lens,
                                          block_table=self.block_tables, causal=True)
            return out[:, 0]
        return flash_attn_varlen_func(q, k_pool, v_pool, self.cu_q_t, self.cu_k_t, max(self.q_lens),
                                      max(self.k_lens), causal=True, block_table=self.block_tables)


# -----------------------------------------------------------------------------
# sampling


def sample(logits, temperature, top_p, top_k, uniform):
    """Draw one token per row by inverse CDF. logits [S, V] fp32; temperature, top_p, uniform [S]
    float tensors, top_k [S] long (0: off). Returns (tokens [S], log-probs [S]): the log-prob under
    the distribution drawn from, softmax(logits / T) cut to the top-k, then to the top-p nucleus of
    that, renormalised. Rows with temperature 0 take the argmax and its T=1 log-prob."""
    S, V = logits.shape
    greedy = temperature == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    if bool(((top_p < 1) | (top_k > 0)).any()):
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        p = sorted_logp.exp()
        rank = torch.arange(V, device=logits.device)
        keep = rank < torch.where(top_k > 0, top_k, V)[:, None]
        p_k = p * keep
        p_k = p_k / p_k.sum(-1, keepdim=True)
        keep &= ((p_k.cumsum(-1) - p_k) < top_p[:, None]) | (top_p[:, None] >= 1)  # mass before < top_p
        p = p * keep
        cdf = p.cumsum(-1)
        idx = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
        idx = torch.minimum(idx, (p > 0).sum(-1, keepdim=True) - 1)  # u * mass may round up to the mass
        tokens = order.gather(1, idx)[:, 0]
        token_logp = sorted_logp.gather(1, idx)[:, 0] - cdf[:, -1].log()
    else:
        p = logp.exp()
        cdf = p.cumsum(-1)
        idx = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
        last = torch.where(p > 0, torch.arange(V, device=p.device), 0).amax(-1, keepdim=True)
        tokens = torch.minimum(idx, last)[:, 0]  # u * mass may round up to the mass
        token_logp = logp.gather(1, tokens[:, None])[:, 0]
    if bool(greedy.any()):
        best = logits.argmax(-1)
        tokens = torch.where(greedy, best, tokens)
        token_logp = torch.where(greedy, logp.gather(1, best[:, None])[:, 0], token_logp)
    return tokens, token_logp


# -----------------------------------------------------------------------------
# the engine: scheduler and model runner


def kv_bytes_per_token(config, dtype):
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * torch.finfo(dtype).bits // 8


class Engine:
    """Continuous batching over a paged KV cache.

    `add` queues a sequence; `step` runs one prefill or decode step and returns the sequences that
    stopped in it (a stop token or the token budget). A stopped sequence keeps its blocks until the
    caller either `release`s it or `resume`s it with forced tokens appended (a tool reply); under
    memory pressure a stopped-but-held sequence may lose its blocks and is then recomputed on resume.
    """

    def __init__(self, model, max_num_seqs=256, max_prefill_tokens=8192, num_blocks=None, block_size=None,
                 max_seq_lens=None, kv_memory_fraction=0.7, kv_cache_bytes=4 << 30, share_prefix=True,
                 raw_logprobs=False):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        backend = getattr(model, "attn_backend", "auto")  # model.py's switch: "auto" | "sdpa" | "flash"
        self.use_flash = backend == "flash" or (backend == "auto" and flash_attn_with_kvcache is not None
                                                and self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16))
        if self.use_flash and flash_attn_with_kvcache is None:
            raise RuntimeError("attn_backend='flash' but flash_attn is not installed")
        block_size = block_size or (256 if self.use_flash else 16)
        budgeted = num_blocks is None
        if budgeted:
            # without flash-attn, decode row buffers (PagedKVCache.decode_order) may take as much
            # memory again as the pool: the budget covers both
            share = 1 if self.use_flash else 2
            num_blocks = self._blocks_from_budget(block_size, kv_memory_fraction / share, kv_cache_bytes // share)
        row_budget = num_blocks * block_size  # the row buffers' share, before the workload cap below
        if budgeted and max_seq_lens is not None:  # no point holding more than the workload could ever use
            num_blocks = min(num_blocks, sum(-(-n // block_size) for n in max_seq_lens))
        self.num_blocks = num_blocks
        self.blocks = BlockManager(num_blocks, block_size, share_prefix)
        self.cache = PagedKVCache(cfg, num_blocks, block_size, self.device, self.dtype, self.use_flash, row_budget)
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.raw_logprobs = raw_logprobs
        self.waiting, self.running, self.held = deque(), deque(), []
        self.stats = dict(steps=0, prefill_steps=0, prefill_tokens=0, decode_tokens=0, shared_tokens=0, preemptions=0)

    def _blocks_from_budget(self, block_size, fraction, cpu_bytes):
        per_block = kv_bytes_per_token(self.model.config, self.dtype) * block_size
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * fraction) // per_block)
        return max(1, cpu_bytes // per_block)

    # -- queue ----------------------------------------------------------------

    def add(self, seq):
        self.waiting.append(seq)

    def has_work(self):
        return bool(self.waiting or self.running)

    def release(self, seq):
        self._free(seq)
        if seq in self.held:
            self.held.remove(seq)

    def _free(self, seq):
        self.blocks.release(seq)
        self.cache.forget(seq)

    def resume(self, seq, forced_ids):
        """Append forced tokens (mask 0) to a stopped sequence and queue it to continue sampling."""
        self.held.remove(seq)
        seq.append_forced(forced_ids)
        seq.finish_reason = None
        self.waiting.append(seq)

    # -- scheduling -----------------------------------------------------------

    def _reclaim(self):
        """Nothing is running and the queue head does not fit: take the blocks of the newest sequence
        that is waiting on a tool, else of the newest one queued behind the head (both are recomputed
        when their turn comes). False if no such sequence holds any."""
        for seq in [*reversed(self.held), *reversed(list(self.waiting)[1:])]:
            if seq.block_table:
                self._free(seq)
                self.stats["preemptions"] += 1
                return True
        return False

    def _preempt(self, seq):
        self._free(seq)
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1

    def _schedule_prefill(self):
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            missing = self.blocks.blocks_missing(seq)
            if missing > self.blocks.num_free:
                if batch or self.running:
                    break
                if self._reclaim():
                    continue
                raise RuntimeError(f"KV cache too small: a sequence of {len(seq)} tokens needs {missing} blocks "
                                   f"of {self.blocks.block_size}, the pool has {self.num_blocks}")
            pending = len(seq) - seq.num_cached
            if batch and tokens + pending > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            before = seq.num_cached
            self.blocks.grow(seq)
            self.stats["shared_tokens"] += seq.num_cached - before
            tokens += len(seq) - seq.num_cached
            batch.append(seq)
        return batch

    def _schedule_decode(self):
        batch = []
        while self.running:
            seq = self.running.popleft()
            while self.blocks.blocks_missing(seq) > self.blocks.num_free:
                if self.running:        # the newest running sequence makes room
                    self._preempt(self.running.pop())
                elif not self._reclaim():
                    self._preempt(seq)
                    seq = None
                    break
            if seq is not None:
                self.blocks.grow(seq)
                batch.append(seq)
        self.running = deque(batch)
        return batch

    # -- one step -------------------------------------------------------------

    @torch.inference_mode()
    def step(self):
        batch = self._schedule_prefill()
        decode = not batch
        if decode:
            batch = self._schedule_decode()
            if not batch:
                return []
            batch = self.cache.decode_order(batch)
        input_ids, positions = self.cache.begin(batch, decode)
        h = self.model.hidden(input_ids, positions=positions, kv_cache=self.cache)
        logits = self.model.lm_head(h.reshape(-1, h.shape[-1])[self.cache.last_index]).float()
        key = "decode_tokens" if decode else "prefill_tokens"
        self.stats[key] += input_ids.numel()
        self.stats["steps"] += 1
        self.stats["prefill_steps"] += not decode
        for seq in batch:
            seq.num_cached = len(seq)
        if not decode:
            self.running.extend(batch)
        return self._append_samples(batch, self._sample(batch, logits))

    def _sample(self, batch, logits):
        params = [s.params for s in batch]
        if all(p.temperature == 0 for p in params):  # the common eval / test path: no sort, no uniforms
            tokens = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
        else:
            t = torch.tensor([p.temperature for p in params])
            u = torch.tensor([s.next_uniform() if p.temperature > 0 else 0.0 for s, p in zip(batch, params)])
            top_p = torch.tensor([p.top_p for p in params])
            top_k = torch.tensor([p.top_k for p in params])
            tokens, logp = sample(logits, *(x.to(self.device) for x in (t, top_p, top_k, u)))
        cols = [tokens.double(), logp.double()]
        if self.raw_logprobs:
            cols.append(torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0].double())
        return torch.stack(cols, 1).tolist()  # the one host sync of the step

    def _append_samples(self, batch, rows):
        stopped = []
        for seq, row in zip(batch, rows):
            token = int(row[0])
            seq.append_sampled(token, row[1], row[2] if len(row) > 2 else None)
            if token in seq.params.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_response >= seq.params.max_tokens:
                seq.finish_reason = "length"
            else:
                continue
            stopped.append(seq)
        if stopped:
            gone = set(map(id, stopped))
            self.running = deque(s for s in self.running if id(s) not in gone)
            self.held.extend(stopped)
        return stopped


# -----------------------------------------------------------------------------
# generate


def sequence_seed(seed, index):
    """Each sequence's generator seed: reproducible per (seed, index), random when seed is None."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 1
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def complete(model, prompts, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, stop_token_ids=(), seed=None,
             raw_logprobs=False, engine=None, **engine_kwargs):
    """Like generate, with per-token log-probs and finish reasons. max_new_tokens: int or one per
    prompt. engine: an Engine to reuse (its pool and options; engine_kwargs are then ignored)."""
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if engine is None:
        engine_kwargs.setdefault("max_seq_lens", [len(p) + b for p, b in zip(prompts, budgets)])
        engine = Engine(model, **engine_kwargs)
    engine.raw_logprobs = raw_logprobs
    stops = frozenset(stop_token_ids)
    seqs = [Sequence(p, SamplingParams(temperature, top_p, top_k, b, stops), sequence_seed(seed, i))
            for i, (p, b) in enumerate(zip(prompts, budgets))]
    for seq in seqs:
        if seq.params.max_tokens > 0:
            engine.add(seq)
    while engine.has_work():
        for seq in engine.step():
            engine.release(seq)
    return [Completion(s.response_ids, s.logprobs, s.raw_logprobs if raw_logprobs else None, s.finish_reason or "length")
            for s in seqs]


def generate(model, prompts, max_new_tokens, temperature=0.0, top_p=1.0, stop_token_ids=(), seed=None, **kwargs):
    """prompts: list of token-id lists -> the new ids of each, a stop token included. temperature 0 is
    greedy. kwargs: top_k, and Engine options (max_num_seqs, num_blocks, block_size, ...)."""
    return [c.token_ids for c in complete(model, prompts, max_new_tokens, temperature, top_p,
                                          stop_token_ids=stop_token_ids, seed=seed, **kwargs)]


# -----------------------------------------------------------------------------
# the chat protocol at the token level

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"   # the Hermes markers the template describes


class ChatFormat:
    """Token ids of the chat protocol, learned from the tokenizer's chat template.

    Forced turns (tool replies, user turns in the REPL) are found by rendering a conversation with
    placeholder contents and cutting at the placeholders, so the ids are what the template renders
    for any tokenizer, with no format strings written here. The template text is split at added
    tokens (<|im_start|>, <tool_response>, ...); the plain text between them, the message content
    included, is encoded as one run with split_special_tokens, as a full rendering would be, except
    that a special-token string inside a message stays text.
    """

    ASSISTANT, CONTENT = "ASSISTANT_PLACEHOLDER_5f1c", "CONTENT_PLACEHOLDER_{}_9d2e"

    def __init__(self, tokenizer, tool_schema):
        self.tokenizer, self.tools = tokenizer, [tool_schema]
        self.tool_name = tool_schema["function"]["name"]
        text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": self.ASSISTANT}])
        after = text[text.index(self.ASSISTANT) + len(self.ASSISTANT):]
        self.end_of_turn = tokenizer.encode(after, add_special_tokens=False)[0]
        self.end_of_turn_text = tokenizer.decode([self.end_of_turn])
        self.stop_ids = frozenset(i for i in (self.end_of_turn, tokenizer.eos_token_id) if i is not None)
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        self._added_re = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else re.compile("(?!)")
        self._pieces = {}

    def _render(self, messages, add_generation_prompt=False):
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, prompt):
        messages = [{"role": "user", "content": prompt}]
        return list(self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def pieces(self, role, n):
        """The template text around n consecutive `role` messages that follow an assistant turn,
        from just after its end-of-turn token to the next generation prompt: n + 1 strings."""
        if (role, n) not in self._pieces:
            slots = [self.CONTENT.format(i) for i in range(n)]
            messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": self.ASSISTANT}]
            messages += [{"role": role, "content": s} for s in slots]
            text = self._render(messages, add_generation_prompt=True)
            text = text[text.index(self.ASSISTANT) + len(self.ASSISTANT):]
            if not text.startswith(self.end_of_turn_text):
                raise ValueError(f"chat template: assistant turn does not end with {self.end_of_turn_text!r}")
            text = text[len(self.end_of_turn_text):]
            out = []
            for s in slots:
                head, text = text.split(s, 1)
                out.append(head)
            self._pieces[(role, n)] = out + [text]
        return self._pieces[(role, n)]

    def forced_ids(self, role, contents):
        """Ids that follow an assistant's end-of-turn token: `role` messages with these contents,
        then the generation prompt."""
        pieces = self.pieces(role, len(contents))
        atoms = []  # (text, is_added_token)
        for i, piece in enumerate(pieces):
            atoms += [(part, j % 2 == 1) for j, part in enumerate(self._added_re.split(piece)) if part]
            if i < len(contents):
                atoms.append((contents[i], False))
        ids, plain = [], ""
        for text, is_added in atoms + [("", True)]:
            if not is_added:
                plain += text
                continue
            if plain:
                ids += self.tokenizer.encode(plain, add_special_tokens=False, split_special_tokens=True)
                plain = ""
            if text:
                ids.append(self.tokenizer.convert_tokens_to_ids(text))
        return ids


def parse_tool_calls(text, tool_name):
    """The calls in one assistant turn: a list of (code, error); exactly one of them is None."""
    calls = []
    for chunk in text.split(TOOL_CALL_OPEN)[1:]:
        if TOOL_CALL_CLOSE not in chunk:
            calls.append((None, f"Error: the tool call is not closed with {TOOL_CALL_CLOSE}."))
            continue
        body = chunk.split(TOOL_CALL_CLOSE, 1)[0].strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append((None, f"Error: the tool call is not valid JSON ({e.msg} at char {e.pos})."))
            continue
        if not isinstance(call, dict) or "name" not in call:
            calls.append((None, 'Error: a tool call is {"name": ..., "arguments": {...}}.'))
            continue
        if call["name"] != tool_name:
            calls.append((None, f"Error: unknown tool {str(call['name'])[:64]!r}; the tool is {tool_name}."))
            continue
        args = call.get("arguments")
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        code = args.get("code") if isinstance(args, dict) else None
        if not isinstance(code, str):
            calls.append((None, f'Error: {tool_name} needs a string argument "code".'))
            continue
        calls.append((code, None))
    return calls


# -----------------------------------------------------------------------------
# tools


def _sandbox_functions(sandbox):
    """submit, prepare_code and format_tool_output: from the given object, else the sandbox module."""
    import sandbox as sandbox_module
    found = {}
    for name in ("submit", "prepare_code", "format_tool_output"):
        fn = getattr(sandbox, name, None) or getattr(sandbox_module, name, None)
        if fn is None:
            raise RuntimeError(f"the sandbox has no {name}() (sandbox.py not built yet?)")
        found[name] = fn
    return found


def _done_future(value):
    f = concurrent.futures.Future()
    f.set_result(value)
    return f


class Agent:
    """One trajectory's agent-loop state around its engine sequence."""

    def __init__(self, problem_index, sample_index, seq):
        self.problem_index, self.sample_index, self.seq = problem_index, sample_index, seq
        self.turn_start = len(seq)          # where the current assistant turn begins
        self.num_turns = 0
        self.tool_calls = []
        self.pending = []                   # [(call record, Future)] of the turn being answered
        self.finish_reason = None

    def trajectory(self, tokenizer):
        seq = self.seq
        return Trajectory(self.problem_index, self.sample_index, seq.token_ids[:seq.num_prompt], seq.response_ids,
                          list(seq.mask), list(seq.logprobs), tokenizer.decode(seq.response_ids, skip_special_tokens=False),
                          self.tool_calls, self.num_turns, self.finish_reason)


class AgentLoop:
    """Drives agents through the engine: sample a turn, run its tool calls off the batch, force the
    reply, resume; the engine keeps decoding the other trajectories while tools run."""

    def __init__(self, engine, chat, config, sandbox=None):
        self.engine, self.chat, self.config = engine, chat, config
        fns = _sandbox_functions(sandbox)
        self.submit, self.prepare_code, self.format_output = fns["submit"], fns["prepare_code"], fns["format_tool_output"]

    def run(self, prompts, keys, seeds=None):
        """prompts: token-id lists; keys: (problem_index, sample_index) per prompt; seeds: one
        generator seed per prompt (default: from config.seed and the position). Returns Agents."""
        cfg = self.config
        params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_response_tokens, self.chat.stop_ids)
        seeds = seeds or [sequence_seed(cfg.seed, k) for k in range(len(prompts))]
        agents = [Agent(i, j, Sequence(p, params, s)) for p, (i, j), s in zip(prompts, keys, seeds)]
        by_seq = {id(a.seq): a for a in agents}
        for a in agents:
            self.engine.add(a.seq)
        waiting = []  # agents whose tool calls are running
        while self.engine.has_work() or waiting:
            for a in [a for a in waiting if all(f.done() for _, f in a.pending)]:
                waiting.remove(a)
                self._answer(a)
            if self.engine.has_work():
                for seq in self.engine.step():
                    a = by_seq[id(seq)]
                    if self._end_turn(a):
                        waiting.append(a)
            elif waiting:
                concurrent.futures.wait([f for a in waiting for _, f in a.pending],
                                        return_when=concurrent.futures.FIRST_COMPLETED)
        return agents

    def _finish(self, agent, reason):
        agent.finish_reason = reason
        self.engine.release(agent.seq)

    def _end_turn(self, agent):
        """An assistant turn ended; True if its tool calls were sent off."""
        seq = agent.seq
        agent.num_turns += 1
        if seq.finish_reason == "length":
            self._finish(agent, "length")
            return False
        text = self.chat.tokenizer.decode(seq.token_ids[agent.turn_start:], skip_special_tokens=False)
        calls = parse_tool_calls(text, self.chat.tool_name)
        if not calls:
            self._finish(agent, "stop")
        elif agent.num_turns >= self.config.max_turns:
            self._finish(agent, "max_turns")
        elif seq.num_response >= seq.params.max_tokens:  # no room for a reply: do not run the calls
            self._finish(agent, "length")
        else:
            for code, error in calls:
                record = {"code": code, "status": "bad_call" if error else None, "output": error or ""}
                future = _done_future(None) if error else self.submit(
                    self.prepare_code(code), timeout=self.config.tool_timeout, memory_mb=self.config.tool_memory_mb)
                agent.pending.append((record, future))
            return True
        return False

    def _answer(self, agent):
        """All of a turn's calls are back: force the tool reply and resume, or stop at the budget."""
        outputs = []
        for record, future in agent.pending:
            if record["status"] is None:
                try:
                    result = future.result()
                    record["status"], record["output"] = result.status, self.format_output(result, self.config.tool_output_chars)
                except Exception as e:  # a sandbox failure is the tool's answer, not a crash of the rollout
                    record["status"], record["output"] = "error", f"Error: the sandbox failed: {type(e).__name__}: {e}"[:200]
            agent.tool_calls.append(record)
            outputs.append(record["output"])
        agent.pending = []
        seq = agent.seq
        forced = self.chat.forced_ids("tool", outputs)
        room = seq.params.max_tokens - seq.num_response
        if len(forced) >= room:  # no room left to sample after the reply: cut it at the budget
            seq.append_forced(forced[:room])
            self._finish(agent, "length")
            return
        self.engine.resume(seq, forced)
        agent.turn_start = len(seq)


def rollout(model, tokenizer, problems, config, sandbox=None, seeds=None, engine=None, **engine_kwargs):
    """config.n trajectories per problem, grouped by problem. sandbox: an object with submit(code,
    timeout, memory_mb) -> Future[Result] (and optionally prepare_code, format_tool_output); the
    sandbox module by default. seeds: one per problem, instead of config.seed: sample j of problem
    i then draws the same tokens whichever other problems share the call (so 1 and N ranks agree).
    engine: an Engine to reuse; else engine_kwargs go to a new one."""
    from sandbox import TOOL_SCHEMA
    chat = ChatFormat(tokenizer, TOOL_SCHEMA)
    if seeds is not None and len(seeds) != len(problems):
        raise ValueError(f"{len(seeds)} seeds for {len(problems)} problems")
    prompts, keys = [], []
    for i, problem in enumerate(problems):
        ids = chat.prompt_ids(problem["prompt"])
        if len(ids) > config.max_prompt_tokens:
            raise ValueError(f"problem {i}: prompt is {len(ids)} tokens, over max_prompt_tokens={config.max_prompt_tokens}")
        for j in range(config.n):
            prompts.append(ids)
            keys.append((i, j))
    if engine is None:
        engine_kwargs.setdefault("max_seq_lens", [len(p) + config.max_response_tokens for p in prompts])
        engine = Engine(model, **engine_kwargs)
    per_sequence = [sequence_seed(seeds[i], j) for i, j in keys] if seeds is not None else None
    agents = AgentLoop(engine, chat, config, sandbox).run(prompts, keys, per_sequence)
    return [a.trajectory(tokenizer) for a in agents]


# -----------------------------------------------------------------------------
# a scripted policy, for the tests and the tool-overlap bench


class ScriptedModel(nn.Module):
    """Stands in for the model: each sequence samples `script(seq)` (a token id) at every step, with
    probability 1. With `model` given, the real forward still runs on the same cache, so timings are
    real; only the logits are replaced. Reads the step's sequences from the cache (kv_cache.seqs)."""

    def __init__(self, config, script, model=None):
        super().__init__()
        self.config, self.script, self.model = config, script, model
        self.anchor = nn.Parameter(torch.zeros(1)) if model is None else None  # device and dtype
        self.lm_head = nn.Identity()  # hidden already holds the logits

    def hidden(self, input_ids, positions=None, cu_seqlens=None, kv_cache=None):
        if self.model is not None:
            self.model.hidden(input_ids, positions=positions, kv_cache=kv_cache)
        B, T = input_ids.shape
        logits = torch.full((B * T, self.config.vocab_size), -1e4, device=input_ids.device)
        for row, seq in zip(kv_cache.last_index.tolist(), kv_cache.seqs):
            logits[row, self.script(seq)] = 0.0
        return logits.view(B, T, -1)


# -----------------------------------------------------------------------------
# CLI: chat REPL


def parse_overrides(argv, config):
    """--name=value for every dataclass field; returns the leftover arguments."""
    rest, types = [], {f.name: f.type for f in fields(config)}
    for arg in argv:
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if eq and name in types:
            current = getattr(config, name)
            if value.lower() == "none":
                setattr(config, name, None)
            elif isinstance(current, bool):
                setattr(config, name, value.lower() in ("1", "true", "yes"))
            else:
                kind = type(current) if current is not None else int
                setattr(config, name, kind(value))
        else:
            rest.append(arg)
    return rest


def chat_repl(model_dir, config, device):
    from transformers import AutoTokenizer
    from model import Transformer
    from sandbox import TOOL_SCHEMA
    model = Transformer.from_pretrained(model_dir, device=device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = ChatFormat(tokenizer, TOOL_SCHEMA)
    print(f"loaded {model_dir} on {device}; /reset starts over, /quit (or ctrl-d) leaves")
    ids = None
    while True:
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            break
        if line in ("/quit", "/exit"):
            break
        if line == "/reset" or not line:
            ids = None if line == "/reset" else ids
            continue
        if ids is None:
            ids = chat.prompt_ids(line)
        else:  # token in, token out: the conversation so far stays as ids
            if ids[-1] not in chat.stop_ids:
                ids.append(chat.end_of_turn)
            ids += chat.forced_ids("user", [line])
        engine = Engine(model, max_num_seqs=1, max_seq_lens=[len(ids) + config.max_response_tokens])
        t0 = time.time()
        agent = AgentLoop(engine, chat, config).run([ids], [(0, 0)])[0]
        traj = agent.trajectory(tokenizer)
        print(f"\nassistant> {traj.text}")
        n = len(traj.response_ids)
        print(f"[{n} tokens, {len(traj.tool_calls)} tool calls, {traj.finish_reason}, {n / (time.time() - t0):.1f} tok/s]")
        ids = ids + traj.response_ids


# -----------------------------------------------------------------------------
# CLI: benchmark


def _timed(fn):
    """(result, wall seconds, process CPU seconds): CPU time too, since a shared machine's wall
    clock also counts the time other processes hold the cores."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def bench_vs_transformers(model, hf, vocab, prompt_lens, new_tokens, label, repeats=3):
    """Greedy, same prompts, same new-token count, no stop tokens; transformers gets the prompts
    left-padded with an attention mask (how it batches ragged prompts)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    width = max(prompt_lens)
    padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    hf.generation_config.eos_token_id = None  # run the full length, as generate() does without stop ids
    hf.generation_config.pad_token_id = 0

    def run_hf():
        with torch.inference_mode():
            return hf.generate(padded, attention_mask=attn, max_new_tokens=new_tokens, do_sample=False,
                               temperature=None, top_p=None, top_k=None)[:, width:].tolist()

    generate(model, prompts[:2], 4)  # warm-up both
    hf.generate(padded[:2, -8:], attention_mask=attn[:2, -8:], max_new_tokens=4, do_sample=False)
    best = {"ours": (1e9, 1e9), "hf": (1e9, 1e9)}
    for _ in range(repeats):  # interleaved, best of each: this machine's speed drifts by +-20% between runs
        ours, wall, cpu = _timed(lambda: generate(model, prompts, new_tokens))
        best["ours"] = min(best["ours"], (wall, cpu))
        theirs, wall, cpu = _timed(run_hf)
        best["hf"] = min(best["hf"], (wall, cpu))
    n = len(prompts) * new_tokens
    same = sum(a == b for a, b in zip(ours, theirs))
    (w_ours, c_ours), (w_hf, c_hf) = best["ours"], best["hf"]
    print(f"  {label}: batch {len(prompts)}, prompt lengths {min(prompt_lens)}..{width}, {new_tokens} new tokens each (greedy)")
    print(f"    rollout.generate      {n / w_ours:8.1f} tok/s wall ({w_ours:.2f} s), {n / c_ours:8.1f} tok/s CPU time")
    print(f"    transformers.generate {n / w_hf:8.1f} tok/s wall ({w_hf:.2f} s), {n / c_hf:8.1f} tok/s CPU time")
    print(f"    ratio {w_hf / w_ours:.2f}x wall, {c_hf / c_ours:.2f}x CPU time; identical greedy tokens in {same}/{len(prompts)} rows")
    return c_hf / c_ours, same == len(prompts)


def long_tail(n, low, high, scale, generator):
    """Pareto-like lengths: most short, a few long, as in agentic rollouts."""
    return [int(min(high, low + scale * (1 / (1 - u) - 1))) for u in torch.rand(n, generator=generator).tolist()]


def bench_continuous_batching(model, vocab, num_requests, slots, max_len):
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, vocab, (num_requests, 32), generator=g).tolist()
    lengths = long_tail(num_requests, 8, max_len, 16, g)
    total = sum(lengths)

    def static():  # slots are refilled only when the whole group has finished
        for s in range(0, num_requests, slots):
            generate(model, prompts[s:s + slots], lengths[s:s + slots], max_num_seqs=slots)

    _, t_static, _ = _timed(static)
    _, t_cont, _ = _timed(lambda: generate(model, prompts, lengths, max_num_seqs=slots))
    print(f"  {num_requests} requests, {slots} slots, lengths {min(lengths)}..{max(lengths)} (mean {total / num_requests:.0f})")
    print(f"  static batches      {total / t_static:8.1f} tok/s  ({t_static:.2f} s)")
    print(f"  continuous batching {total / t_cont:8.1f} tok/s  ({t_cont:.2f} s)")
    print(f"  gain {t_static / t_cont:.2f}x")
    return t_static / t_cont


class DelayedSandbox:
    """A stand-in sandbox whose every run takes `delay` seconds; blocking=True waits inside submit,
    which is what a rollout without overlap would do."""

    def __init__(self, delay, blocking=False):
        self.delay, self.blocking = delay, blocking
        self.pool = concurrent.futures.ThreadPoolExecutor(64)
        self.calls = 0

    def _run(self, code):
        time.sleep(self.delay)
        from types import SimpleNamespace
        return SimpleNamespace(status="ok", stdout="42\n", stderr="", returncode=0, seconds=self.delay)

    def submit(self, code, timeout=10.0, memory_mb=1024, stdin=""):
        self.calls += 1
        future = self.pool.submit(self._run, code)
        if self.blocking:
            future.result()
        return future

    prepare_code = staticmethod(lambda code: code)
    format_tool_output = staticmethod(lambda result, max_chars=256: (result.stdout + result.stderr)[:max_chars])


def bench_tool_overlap(model, tokenizer, num_traj, delay):
    from sandbox import TOOL_SCHEMA
    chat = ChatFormat(tokenizer, TOOL_SCHEMA)
    call = tokenizer.encode('Let me compute.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}\n</tool_call>',
                            add_special_tokens=False)
    filler = tokenizer.encode(" the sum of the digits", add_special_tokens=False)
    # half the trajectories: two tool turns then an answer; the others: one long answer
    scripts = {}
    for i in range(num_traj):
        if i % 2 == 0:
            turns = [call + [chat.end_of_turn]] * 2 + [filler * 4 + [chat.end_of_turn]]
        else:
            turns = [filler * 24 + [chat.end_of_turn]]
        scripts[i] = [t for turn in turns for t in turn]
    problems = [{"prompt": f"Problem {i}: what is 6 times 7?"} for i in range(num_traj)]
    prompt_key = {tuple(chat.prompt_ids(p["prompt"])): i for i, p in enumerate(problems)}

    def script(seq):
        s = scripts[prompt_key[tuple(seq.token_ids[:seq.num_prompt])]]
        k = sum(seq.mask)
        return s[k] if k < len(s) else chat.end_of_turn

    policy = ScriptedModel(model.config, script, model)
    cfg = RolloutConfig(temperature=0.0, max_response_tokens=1024)
    results = {}
    for name, blocking in (("blocking", True), ("overlapped", False)):
        box = DelayedSandbox(delay, blocking)
        trajs, t, _ = _timed(lambda: rollout(policy, tokenizer, problems, cfg, sandbox=box))
        results[name] = t
        tokens = sum(len(x.response_ids) for x in trajs)
        print(f"  {name:10s}: {t:6.2f} s for {num_traj} trajectories, {tokens} tokens, {box.calls} tool calls of {delay} s "
              f"(serial tool time {box.calls * delay:.1f} s)")
    print(f"  overlap saves {results['blocking'] - results['overlapped']:.2f} s ({results['blocking'] / results['overlapped']:.2f}x)")
    return results


def bench_4b(device, batches=(64, 256), new_tokens=64):
    """Decode tokens/s of a random Qwen3-4B-shaped model (meant for a GPU)."""
    from model import ModelConfig, Transformer
    cfg = ModelConfig()  # defaults are Qwen3-4B's shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Transformer.from_config(cfg, device=device, dtype=dtype).eval()
    for batch in batches:
        prompts = torch.randint(0, cfg.vocab_size, (batch, 128)).tolist()
        generate(model, prompts[:4], 4)
        if device.type == "cuda":
            torch.cuda.synchronize()
        _, t, _ = _timed(lambda: generate(model, prompts, new_tokens))
        print(f"  Qwen3-4B shape, {dtype}, batch {batch}: {batch * new_tokens / t:8.1f} tok/s end to end "
              f"(prompt 128, {new_tokens} new; flash-attn {'on' if flash_attn_with_kvcache and device.type == 'cuda' else 'off'})")


def bench(device, quick=False, with_4b=False):
    import tempfile
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data.tiny import build_tiny_checkpoint
    from model import Transformer
    torch.manual_seed(0)
    path = build_tiny_checkpoint(tempfile.mkdtemp(prefix="rollout-bench-"), seed=0, hidden_size=256,
                                 intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64)
    model = Transformer.from_pretrained(path, device=device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = model.config.vocab_size
    print(f"bench model: random Qwen3, {model.num_params() / 1e6:.1f}M parameters, {model.config.num_hidden_layers} layers, "
          f"hidden {model.config.hidden_size}, vocab {vocab}, {device}, {torch.get_num_threads()} threads")
    print("1. generate vs transformers.generate")
    hf = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    new = 32 if quick else 128
    bench_vs_transformers(model, hf, vocab, [64] * 32, new, "equal prompts")
    bench_vs_transformers(model, hf, vocab, [64] * 32, 4 * new, "equal prompts, decode-heavy")
    bench_vs_transformers(model, hf, vocab, long_tail(32, 16, 512, 24, torch.Generator().manual_seed(3)), new,
                          "ragged prompts")
    del hf
    print("2. continuous batching on long-tailed lengths")
    bench_continuous_batching(model, vocab, num_requests=32 if quick else 64, slots=8 if quick else 16,
                              max_len=128 if quick else 512)
    print("3. tool latency overlap")
    bench_tool_overlap(model, tokenizer, num_traj=8 if quick else 16, delay=0.5)
    if with_4b:
        print("4. Qwen3-4B-shaped decode")
        bench_4b(device)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    config = RolloutConfig()
    rest = parse_overrides(argv, config)
    p = argparse.ArgumentParser(description="chat REPL with the code tool, or the sampler benchmark")
    p.add_argument("--model", help="Hugging Face checkpoint directory (chat REPL)")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--bench4b", action="store_true", help="with --bench: a Qwen3-4B-shaped decode run too")
    p.add_argument("--quick", action="store_true", help="with --bench: smaller workloads")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args(rest)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.bench:
        bench(device, args.quick, args.bench4b)
    elif args.model:
        chat_repl(args.model, config, device)
    else:
        p.error("give --model DIR or --bench")


if __name__ == "__main__":
    main()
