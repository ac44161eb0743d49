"""Benchmark of rollout.py on a random Qwen3 (6.5M parameters):
    python scripts/bench_rollout.py [--quick] [--threads=N] [--device=cuda] [--bench4b] [--compile]
1. tokens/s of rollout.generate against transformers.generate, batch 32, greedy, the tokens checked
   identical: equal prompts (128 and 512 new tokens), ragged prompts; 2. continuous against static
   batching on long-tailed lengths; 3. tool calls of 0.5 s overlapped with decoding against blocking;
   --bench4b: decode tokens/s of a random Qwen3-4B-shaped model at batch 64 and 256 (meant for a GPU);
   --compile: section 1 through Engine(compile=True).
Wall and process CPU time, best of 3 interleaved; on a shared machine prefer --threads=1."""
import concurrent.futures
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402
from machinery.flags import parse_config  # noqa: E402


class ScriptedModel(nn.Module):
    """Stands in for the model (tests, tool bench): each sequence samples `script(seq)` (a token id) at every
    step, with probability 1. With `model` given, the real forward still runs on the same cache, so timings
    and KV traffic are real; only the logits are replaced. Reads the step's sequences from kv_cache.seqs."""

    def __init__(self, config, script, model=None):
        super().__init__()
        self.config, self.script, self.model = config, script, model
        self.attn_backend = "sdpa"  # the script reads the step's rows on the host: no bucketed flash step, no graph
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


def timed(fn):
    """(result, wall s, process CPU s): a shared machine's wall clock also counts other processes."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def vs_transformers(model, hf, prompts, new_tokens, label, repeats=3, compile=False):
    """Greedy, no stop tokens; transformers gets the prompts left-padded with an attention mask."""
    width = max(map(len, prompts))
    padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0  # the full length

    def run_hf():
        with torch.inference_mode():
            return hf.generate(padded, attention_mask=attn, max_new_tokens=new_tokens, do_sample=False,
                               temperature=None, top_p=None, top_k=None)[:, width:].tolist()

    rollout.generate(model, prompts[:2], 4, compile=compile)  # warm-up both (and compile)
    hf.generate(padded[:2, -8:], attention_mask=attn[:2, -8:], max_new_tokens=4, do_sample=False)
    runs = [(timed(lambda: rollout.generate(model, prompts, new_tokens, compile=compile)), timed(run_hf))
            for _ in range(repeats)]  # interleaved, best of each: this machine's speed drifts between runs
    (ours, w_ours, c_ours), (theirs, w_hf, c_hf) = (min(r, key=lambda run: run[1:]) for r in zip(*runs))
    n, same = len(prompts) * new_tokens, sum(a == b for a, b in zip(ours, theirs))
    print(f"  {label}: batch {len(prompts)}, prompt lengths {min(map(len, prompts))}..{width}, "
          f"{new_tokens} new tokens each (greedy)")
    print(f"    rollout.generate      {n / w_ours:8.1f} tok/s wall ({w_ours:.2f} s), {n / c_ours:8.1f} tok/s CPU time")
    print(f"    transformers.generate {n / w_hf:8.1f} tok/s wall ({w_hf:.2f} s), {n / c_hf:8.1f} tok/s CPU time")
    print(f"    ratio {w_hf / w_ours:.2f}x wall, {c_hf / c_ours:.2f}x CPU time; "
          f"identical greedy tokens in {same}/{len(prompts)} rows")


def random_prompts(lengths, vocab):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def long_tail(n, low, high, scale, generator):
    """Pareto-like lengths: most short, a few long, as in agentic rollouts."""
    return [int(min(high, low + scale * (1 / (1 - u) - 1))) for u in torch.rand(n, generator=generator).tolist()]


def continuous_batching(model, vocab, num_requests, slots, max_len):
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, vocab, (num_requests, 32), generator=g).tolist()
    lengths = long_tail(num_requests, 8, max_len, 16, g)
    total = sum(lengths)

    def static():  # slots are refilled only when the whole group has finished
        for s in range(0, num_requests, slots):
            rollout.generate(model, prompts[s:s + slots], lengths[s:s + slots], max_num_seqs=slots)

    _, t_static, _ = timed(static)
    _, t_cont, _ = timed(lambda: rollout.generate(model, prompts, lengths, max_num_seqs=slots))
    print(f"  {num_requests} requests, {slots} slots, lengths {min(lengths)}..{max(lengths)} "
          f"(mean {total / num_requests:.0f})")
    print(f"  static batches      {total / t_static:8.1f} tok/s  ({t_static:.2f} s)")
    print(f"  continuous batching {total / t_cont:8.1f} tok/s  ({t_cont:.2f} s)")
    print(f"  gain {t_static / t_cont:.2f}x")


class DelayedSandbox:
    """Every run takes `delay` seconds; blocking=True waits inside submit, as a rollout without overlap would."""

    def __init__(self, delay, blocking=False):
        self.delay, self.blocking, self.calls, self.pool = delay, blocking, 0, concurrent.futures.ThreadPoolExecutor(64)

    def _run(self, code):
        time.sleep(self.delay)
        return SimpleNamespace(status="ok", stdout="42\n", stderr="", returncode=0, seconds=self.delay)

    def submit(self, code, timeout=10.0, memory_mb=1024, stdin=""):
        self.calls += 1
        future = self.pool.submit(self._run, code)
        if self.blocking:
            future.result()
        return future

    prepare_code = staticmethod(lambda code: code)
    format_tool_output = staticmethod(lambda result, max_chars=256: (result.stdout + result.stderr)[:max_chars])


def tool_overlap(model, tokenizer, num_traj, delay):
    chat = rollout.chat_format(tokenizer, rollout.RolloutConfig())
    call = tokenizer.encode('Let me compute.\n<tool_call>\n'
                            '{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}\n'
                            '</tool_call>', add_special_tokens=False) + [chat.end_of_turn]
    filler = tokenizer.encode(" the sum of the digits", add_special_tokens=False)
    # half the trajectories: two tool turns then an answer; the others: one long answer
    scripts = [call * 2 + filler * 4 + [chat.end_of_turn] if i % 2 == 0 else filler * 24 + [chat.end_of_turn]
               for i in range(num_traj)]
    problems = [{"prompt": f"Problem {i}: what is 6 times 7?"} for i in range(num_traj)]
    prompt_key = {tuple(chat.prompt_ids(p["prompt"])): i for i, p in enumerate(problems)}

    def script(seq):
        s, k = scripts[prompt_key[tuple(seq.token_ids[:seq.num_prompt])]], sum(seq.mask)
        return s[k] if k < len(s) else chat.end_of_turn

    policy, cfg, results = (ScriptedModel(model.config, script, model),
                            rollout.RolloutConfig(temperature=0.0, max_response_tokens=1024), {})
    for name, blocking in (("blocking", True), ("overlapped", False)):
        box = DelayedSandbox(delay, blocking)
        trajs, t, _ = timed(lambda: rollout.rollout(policy, tokenizer, problems, cfg, sandbox=box))
        results[name] = t
        print(f"  {name:10s}: {t:6.2f} s for {num_traj} trajectories, "
              f"{sum(len(x.response_ids) for x in trajs)} tokens, "
              f"{box.calls} tool calls of {delay} s (serial tool time {box.calls * delay:.1f} s)")
    print(f"  overlap saves {results['blocking'] - results['overlapped']:.2f} s "
          f"({results['blocking'] / results['overlapped']:.2f}x)")


def qwen3_4b_decode(device, batches=(64, 256), new_tokens=64):
    from model import ModelConfig, Transformer
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Transformer.from_config(ModelConfig(), device=device, dtype=dtype).eval()  # defaults: Qwen3-4B's shape
    for batch in batches:
        prompts = torch.randint(0, model.config.vocab_size, (batch, 128)).tolist()
        rollout.generate(model, prompts[:4], 4)
        if device.type == "cuda":
            torch.cuda.synchronize()
        engine = rollout.Engine(model, max_seq_lens=[128 + new_tokens] * batch)
        _, t, _ = timed(lambda: rollout.generate(model, prompts, new_tokens, engine=engine))
        print(f"  Qwen3-4B shape, {dtype}, batch {batch}: {batch * new_tokens / t:8.1f} tok/s end to end "
              f"(prompt 128, {new_tokens} new; flash-attn {'on' if engine.use_flash else 'off'}, "
              f"CUDA graphs {'on' if engine.use_flash and engine.cache.use_graphs else 'off'})")


@dataclass
class BenchConfig:
    quick: bool = False    # smaller workloads
    threads: int = 0       # torch intra-op threads (0: torch's default)
    device: str = "auto"
    bench4b: bool = False  # a Qwen3-4B-shaped decode run too
    compile: bool = False  # section 1 with Engine(compile=True) (CPU; needs a C++ compiler, compiles for minutes)


def main(argv):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data.tiny import build_tiny_checkpoint
    from model import Transformer
    args = parse_config(BenchConfig, argv, __doc__)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    path = build_tiny_checkpoint(tempfile.mkdtemp(prefix="rollout-bench-"), seed=0, hidden_size=256,
                                 intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64)
    model, tokenizer = Transformer.from_pretrained(path, device=device), AutoTokenizer.from_pretrained(path)
    vocab, c = model.config.vocab_size, model.config
    print(f"bench model: random Qwen3, {model.num_params() / 1e6:.1f}M parameters, {c.num_hidden_layers} layers, "
          f"hidden {c.hidden_size}, vocab {vocab}, {device}, {torch.get_num_threads()} threads")
    print("1. generate vs transformers.generate")
    hf = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    new = 32 if args.quick else 128
    vs_transformers(model, hf, random_prompts([64] * 32, vocab), new, "equal prompts", compile=args.compile)
    vs_transformers(model, hf, random_prompts([64] * 32, vocab), 4 * new,
                    "equal prompts, decode-heavy", compile=args.compile)
    ragged = long_tail(32, 16, 512, 24, torch.Generator().manual_seed(3))
    vs_transformers(model, hf, random_prompts(ragged, vocab), new, "ragged prompts", compile=args.compile)
    del hf
    print("2. continuous batching on long-tailed lengths")
    continuous_batching(model, vocab, num_requests=32 if args.quick else 64, slots=8 if args.quick else 16,
                        max_len=128 if args.quick else 512)
    print("3. tool latency overlap")
    tool_overlap(model, tokenizer, num_traj=8 if args.quick else 16, delay=0.5)
    if args.bench4b:
        print("4. Qwen3-4B-shaped decode")
        qwen3_4b_decode(device)


if __name__ == "__main__":
    main(sys.argv[1:])
