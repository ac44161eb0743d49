"""machinery/fast_sampling.py: the fast paths of rollout.py's Engine (a first reading can skip
them). rollout.PagedKVCache is the reference: RowKVCache and FlashKVCache change where K/V is read
from, not what attention computes, as mixins over the plain cache (super() for all they leave
alone) that the Engine hands to `kv_cache`, so no import of rollout. CpuForward: the CPU forward."""

import contextlib
import functools
import itertools

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from model import Linear, flash_attn_varlen_func, flash_attn_with_kvcache


def upload(values, device, dtype=None):
    """A host list or tensor on device; on CUDA through pinned memory, so the copy does not sync."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def kv_cache(paged, config, num_blocks, block_size, device, dtype, flash, row_budget, max_batch,
             max_seq_lens):
    """The cache an Engine runs on: paged (rollout.PagedKVCache) with one fast path mixed in. flash:
    FlashKVCache, decode steps bucketed up to max_batch rows, tables as wide as the longest of
    max_seq_lens needs; else RowKVCache, its rows holding at most row_budget token positions."""
    cache = _over(FlashKVCache if flash else RowKVCache, paged)
    if flash:
        longest = max(max_seq_lens) if max_seq_lens else config.max_position_embeddings
        return cache(config, num_blocks, block_size, device, dtype, max_batch, longest)
    return cache(config, num_blocks, block_size, device, dtype, row_budget)


@functools.cache
def _over(fast, paged):
    """The class of fast mixed over paged: fast's methods first, the plain cache's behind them."""
    return type(fast.__name__, (fast, paged), {"__doc__": fast.__doc__})


class RowKVCache:
    """Fast path 1 (without flash-attn, CPU or CUDA): while the same sequences keep decoding, each
    step writes its token per row into contiguous row buffers [2, rows, Hkv, capacity, D] as well
    as into the pool, and reads the rows instead of gathering every block again (17-38% of the
    rollout bench's rows on CPU). New rows, or a row that outgrows them, lay them out again from
    the pool. Rows are padded to the longest; past row_budget, decode gathers blocks."""

    row_headroom = 128  # free positions past the longest row when the rows are laid out

    def __init__(self, config, num_blocks, block_size, device, dtype, row_budget):
        super().__init__(config, num_blocks, block_size, device, dtype)
        self.row_budget = row_budget   # rows x capacity <= row_budget
        self.rows, self.row_cached, self.row_kv = None, {}, [torch.zeros(2, 0, 0, 0, 0)]

    def decode_order(self, batch):
        """Longest first; the same rows in the same order while the same sequences keep decoding."""
        same_rows = {id(s): s.num_cached for s in batch} == self.row_cached
        if same_rows and max(map(len, batch)) <= self.row_kv[0].shape[3]:
            return self.rows  # last step's rows, one token longer each (self.rows keeps ids alive)
        rows, step = sorted(batch, key=len, reverse=True), self.row_headroom
        capacity = -(-(len(rows[0]) + step) // step) * step
        fits = len(rows) * capacity <= self.row_budget
        self.rows, self.row_cached = (rows, None) if fits else (None, {})
        _, have_rows, _, have_capacity, _ = self.row_kv[0].shape
        if self.rows and (len(rows) > have_rows or capacity > have_capacity):
            if capacity > have_capacity:  # geometric growth: a long decode reallocates log(n) times
                capacity = max(capacity, min(2 * have_capacity, self.row_budget // len(rows)))
            self.row_kv = None  # free the old buffers first
            _, _, _, hkv, d = self.kv[0].shape
            self.row_kv = [torch.zeros(2, len(rows), hkv, capacity, d, device=self.device,
                                       dtype=p.dtype) for p in self.kv]
        self.stale = True  # refill from the pool before the step
        return rows

    def begin(self, batch, decode):
        layout = super().begin(batch, decode)
        self.use_rows = decode and bool(self.rows)  # a bool: what torch.compile guards
        if self.use_rows and self.stale:  # copy every row's cached K/V out of the pool, head-major
            for layer, rows in enumerate(self.row_kv):
                pool = self._gather(layer, self.block_tables.flatten().long())
                pool = pool.view(2, len(batch), -1, *self.kv[0].shape[3:])
                width = min(pool.shape[2], rows.shape[3])  # the last block may overhang the buffer
                rows[:, :len(batch), :, :width].copy_(pool[:, :, :width].transpose(2, 3))
            self.stale = False
        if self.use_rows:  # after this step every row holds len(seq) tokens
            self.row_cached = {id(s): len(s) for s in batch}
            # K/V c of row r, head h goes to flat index ((c * R + r) * Hkv + h) * cap + len - 1
            _, R, hkv, cap, _ = self.row_kv[0].shape
            index = [((c * R + r) * hkv + h) * cap + n - 1
                     for r, n in enumerate(self.k_lens) for c in (0, 1) for h in range(hkv)]
            self.row_index = upload(index, self.device, torch.long)
        return layout

    def _attend_decode(self, layer, q, kv):
        if self.use_rows:  # the step's token into each row, then the rows are read, not the blocks
            d = q.shape[-1]
            self.row_kv[layer].view(-1, d).index_copy_(0, self.row_index, kv.view(-1, d))
        return super()._attend_decode(layer, q, kv)

    def _group_kv(self, layer, start, end, width):
        if self.use_rows:
            return self.row_kv[layer][:, start:end, :, :width]
        return super()._group_kv(layer, start, end, width)


def bucket(n):
    """A flash decode step's batch size: the next power of two (one CUDA graph per bucket)."""
    return 1 << (n - 1).bit_length()


def cuda_graph(fn, pool, stream):
    """fn() captured in a CUDA graph on `stream` -> replay(), which reruns it on the same buffers
    and returns its output. A warm-up on that stream, outside the capture, does lazy set-up and
    makes cuBLAS's per-stream workspace (made inside a capture, it would keep the graph pool)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()

    def replay():
        graph.replay()
        return out
    return replay


class FlashKVCache:
    """Fast path 2 (flash-attn on CUDA, blocks of 256): flash-attn reads the pools through the block
    tables. decode_step (called by the Engine instead of begin and the model) lays a step out in
    static buffers at its bucket's batch size, so it is captured once per bucket as a CUDA graph."""

    def __init__(self, config, num_blocks, block_size, device, dtype, max_batch, longest):
        super().__init__(config, num_blocks, block_size, device, dtype)
        self.num_blocks, self.max_batch = num_blocks, max_batch
        self.max_blocks = min(num_blocks, -(-longest // block_size))  # a bucketed table's width
        self.static, self.tables_key = None, None   # tables_key: what the static tables hold
        self.use_graphs = device.type == "cuda"
        self.capture_stream = torch.cuda.Stream(device) if self.use_graphs else None
        self.reset_graphs()      # graphs: bucket -> step (its graph's replay, or the eager step)
        self.weights_at = None   # where the weights were when the graphs were captured

    def reset_graphs(self):
        """Drop every graph; the next ones capture into a fresh pool, not the dropped ones'."""
        self.graphs = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def new_rollout(self, model):
        """The CUDA graphs dropped if the weights moved (FSDP2 gathers them anew for every rollout,
        maybe at other addresses), since a graph replays the addresses it was captured with."""
        weights_at = [p.data_ptr() for p in model.parameters()]
        if weights_at != self.weights_at:
            self.reset_graphs()
            self.weights_at = weights_at

    def begin(self, batch, decode):  # prefills only: decode_step lays out decode steps
        layout = super().begin(batch, decode)
        self.cu_q_t = upload(self.cu_q, self.device, torch.int32)
        cu_k = list(itertools.accumulate(self.k_lens, initial=0))
        self.cu_k_t = upload(cu_k, self.device, torch.int32)
        return layout

    def decode_step(self, model, batch):
        """The logits [len(batch), V] of one decode step, run at its bucket's batch size."""
        width = max(len(s.block_table) for s in batch)
        if width > self.max_blocks:  # a reused engine meets a longer sequence: widen, graphs anew
            self.max_blocks = min(self.num_blocks, 2 * width)
            self.static, self.tables_key = None, None
            self.reset_graphs()
        b = self.begin_bucketed(batch)
        if b not in self.graphs:
            def step():  # bucket b's step reads only the static buffers, so its graph replays any
                meta = self.static[0][:, :b]
                slots = meta[2].long()
                self.pool_index = torch.stack([slots, slots + self.v_offset], 1)
                ids, positions = meta[0, :, None].long(), meta[1, :, None].long()
                h = model.hidden(ids, positions=positions, kv_cache=self)
                return model.lm_head(h[:, 0]).float()
            self.graphs[b] = (cuda_graph(step, self.graph_pool, self.capture_stream)
                              if self.use_graphs else step)
        return self.graphs[b]()[:len(batch)]

    def begin_bucketed(self, batch):
        """Lay out a decode step in static buffers at its bucket's batch size; returns the bucket.
        Padded rows write the spare block and read one token of it: real rows never see them."""
        n, b, dev = len(batch), bucket(len(batch)), self.device
        if self.static is None:  # ids, positions, slots, lengths; block tables (int32 for flash)
            rows = bucket(self.max_batch)
            self.static = (torch.zeros(4, rows, dtype=torch.int32, device=dev),
                           torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=dev))
        meta, tables = self.static
        bs, lens, pad = self.block_size, [len(s) for s in batch], b - n
        slots = [s.block_table[(k - 1) // bs] * bs + (k - 1) % bs for s, k in zip(batch, lens)]
        ids = [s.token_ids[-1] for s in batch]
        meta[:, :b].copy_(upload([ids + [0] * pad, [k - 1 for k in lens] + [0] * pad,
                                  slots + [self.spare_slot] * pad, lens + [1] * pad],
                                 dev, torch.int32))
        # the tables change only when a row gains a block (every 256 tokens) or the rows change:
        # other steps reuse the uploaded ones instead of rebuilding rows x width ints. The key holds
        # each row's table list itself (a released sequence gets a new one) and its length
        key = [(s.block_table, len(s.block_table)) for s in batch]
        old = self.tables_key or []  # None when static is made anew; b follows from len(key)
        if len(old) != len(key) or any(x[0] is not y[0] or x[1] != y[1] for x, y in zip(old, key)):
            width, spare = self.max_blocks, self.spare_slot // bs
            rows = [s.block_table + [0] * (width - len(s.block_table)) for s in batch]
            tables[:b].copy_(upload(rows + [[spare] * width] * pad, dev, torch.int32))
            self.tables_key = key
        self.seqs, self.decode = batch, True
        self.context_lens, self.block_tables = meta[3, :b], tables[:b]
        return b

    def attend(self, layer, q, k, v):
        shape, pool = q.shape, self.kv[layer]
        q, _ = self.write(layer, q, k, v)
        if self.decode:
            out = flash_attn_with_kvcache(q[:, None], *pool, cache_seqlens=self.context_lens,
                                          block_table=self.block_tables, causal=True)[:, 0]
        else:
            out = flash_attn_varlen_func(q, pool[0], pool[1], self.cu_q_t, self.cu_k_t,
                                         max(self.q_lens), max(self.k_lens), causal=True,
                                         block_table=self.block_tables)
        return out.reshape(shape)


# Optimizer steps taken in this process. FSDP2 gathers updated weights into the same parameters,
# keeping their version counter and often their address: those two alone miss an update.
OPTIMIZER_STEPS = [0]


def _count_step(*_):
    OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


def transposed_weights(module, old=None):
    """{Linear in module: (version, contiguous [in, out] copy of its weight)}, for CpuForward;
    `old`'s entries whose weight is unchanged (storage, version counter, optimizer steps) reused."""
    new = {}
    # old holds the same modules: no walk of the module tree
    for m in old or [m for m in module.modules() if isinstance(m, Linear)]:
        w = m.weight
        version = (w.data_ptr(), -1 if w.is_inference() else w._version, OPTIMIZER_STEPS[0])
        new[m] = old[m] if old and old[m][0] == version else (version, w.detach().t().contiguous())
    return new


class CpuForward:
    """The model call of the Engine's eager steps, with its CPU speed-ups: matmuls against
    transposed weight copies (model.Linear; remade when a weight changes) and, with compile=True,
    decode steps of one length group through torch.compile (needs a C++ compiler; ~30 s per new
    graph: with and without a padding mask, one row and more). Elsewhere model.hidden as it is."""

    def __init__(self, model, compile=False):
        self.model, self.weights_t = model, {}   # weights_t: CPU [in, out] copies
        self.compiled = torch.compile(model.hidden, dynamic=True) if compile else None

    @contextlib.contextmanager
    def __call__(self, cache, decode):
        """Yields the function to run the step with (model.hidden or its compiled twin); the lm_head
        belongs inside the with block too, so that it also multiplies by its transposed copy."""
        if cache.device.type == "cpu":
            self.weights_t = transposed_weights(self.model, self.weights_t)
        copies = self.weights_t   # inside, each Linear of copies multiplies by its transposed copy
        for m, (_, wt) in copies.items():
            m.__dict__["weight_t"] = wt  # not Module.__setattr__: this runs every decode step
        try:
            one_group = decode and self.compiled and len(cache.groups) == 1
            yield self.compiled if one_group else self.model.hidden
        finally:
            for m in copies:
                m.__dict__.pop("weight_t", None)
