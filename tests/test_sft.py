"""sft.py: the assistant mask, packing, FSDP2 under torchrun, exact resume after a kill, overfitting."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import sft
from rollout import ChatFormat
from machinery.checkpoints import checkpoints
from model import Transformer
from data.prompts import CODE_INTERPRETER as TOOL_SCHEMA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call(code):
    return {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": code}}}


def conversation(rng):
    """A tool-use trajectory of random length: 0-3 tool calls, some with an error and a retry."""
    a, b = rng.randint(10, 9999), rng.randint(10, 9999)
    messages = [{"role": "user", "content": f"What is {a} * {b}? Put the answer in \\boxed{{}}."}]
    for turn in range(rng.randint(0, 3)):
        if rng.random() < 0.3:
            messages.append({"role": "assistant", "content": "Let me use the code tool.",
                             "tool_calls": [call(f"print({a} * {b}")]})
            messages.append({"role": "tool", "content": "SyntaxError: invalid syntax"})
        else:
            messages.append({"role": "assistant", "content": "" if turn else "I will compute it.",
                             "tool_calls": [call(f"print({a} * {b})")]})
            messages.append({"role": "tool", "content": str(a * b)})
    messages.append({"role": "assistant", "content": f"The answer is \\boxed{{{a * b}}}."})
    return {"messages": messages, "tools": [TOOL_SCHEMA]}


def write_fixture(path, n, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(conversation(rng)) + "\n")
    return str(path)


def config(tiny_ckpt, data, out, **kw):
    base = dict(model=tiny_ckpt, data=data, out_dir=str(out), epochs=1, batch_size=8, lr=2e-3, max_len=1024,
                micro_batch_tokens=1024, eval_size=0, save_every=0, gradient_checkpointing=True, progress=False,
                log_every=1000)
    base.update(kw)
    return sft.Config(**base)


def train_losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [e["loss"] for e in map(json.loads, f) if e["event"] == "train"]


def weights(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def run_cli(args, threads=1, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(threads))
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def flags(cfg):
    return [f"--{k}={v}" for k, v in vars(cfg).items()]


# -----------------------------------------------------------------------------
# rendering and the mask


def test_mask_covers_exactly_the_assistant_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    messages = [
        {"role": "system", "content": "You are a careful solver."},
        {"role": "user", "content": "Compute 17 ** 5 mod 7."},
        {"role": "assistant", "content": "I will compute it.", "tool_calls": [call("print(17 ** 5 % 7)")]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": None,  # a bare call, two calls in one turn
         "tool_calls": [call("x = 17 ** 5"), {"name": "code_interpreter", "arguments": '{"code": "x % 7"}'}]},
        {"role": "tool", "content": "ok"},
        {"role": "tool", "content": "a second reply in the same turn"},
        {"role": "assistant", "content": "The answer is \\boxed{5}."},
    ]
    ids, mask, same = sft.render(ChatFormat(tok), messages, [TOOL_SCHEMA])
    # the ids are the template's own output
    assert ids == tok.apply_chat_template(messages, tools=[TOOL_SCHEMA], tokenize=True, return_dict=False)
    assert same and len(mask) == len(ids)
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assert not cur  # the render ends with the template's newline, which the assistant did not write
    blk = '<tool_call>\n{{"name": "code_interpreter", "arguments": {}}}\n</tool_call>'
    assert runs == [
        "I will compute it.\n" + blk.format('{"code": "print(17 ** 5 % 7)"}') + "<|im_end|>",
        blk.format('{"code": "x = 17 ** 5"}') + "\n" + blk.format('{"code": "x % 7"}') + "<|im_end|>",
        "The answer is \\boxed{5}.<|im_end|>",
    ]
    # everything else is system, user, tool or template text
    rest = tok.decode([t for t, m in zip(ids, mask) if not m])
    for text in ("careful solver", "Compute 17", "<tool_response>\n5\n</tool_response>", "a second reply",
                 "# Tools"):
        assert text in rest


def test_prefix_check_and_bad_records(tiny_tokenizer, tmp_path):
    # a template that drops earlier assistant turns (as some reasoning templates do) cannot be masked by prefixes
    chat = ChatFormat(tiny_tokenizer)
    render = chat.render

    def dropping(messages, add_generation_prompt=False, tools=None):
        last = max([i for i, m in enumerate(messages) if m["role"] == "user"], default=-1)
        return render([m for i, m in enumerate(messages) if not (m["role"] == "assistant" and i < last)],
                      add_generation_prompt, tools)

    chat.render = dropping
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(sft.DataError, match=r"rec:7: messages\[\d\]: the chat template renders"):
        sft.render(chat, msgs, where="rec:7")

    good = json.dumps(conversation(random.Random(0)))
    cases = {
        "not json": ("{oops", "data.jsonl:2: not valid JSON"),
        "no messages": ('{"tools": []}', "data.jsonl:2: messages: expected a non-empty list"),
        "bad role": ('{"messages": [{"role": "robot", "content": "x"}]}', r"data.jsonl:2: messages\[0\].role"),
        "bad content": ('{"messages": [{"role": "user", "content": 3}]}', r"messages\[0\].content"),
        "bad call": ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",'
                     ' "tool_calls": [{"function": {"arguments": {}}}]}]}',
                     r"messages\[1\].tool_calls\[0\].function.name"),
        "no assistant": ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message"),
        "bad tools": ('{"messages": [{"role": "user", "content": "q"}], "tools": "[1"}', "tools: a string"),
    }
    for name, (line, message) in cases.items():
        path = tmp_path / "data.jsonl"
        path.write_text(good + "\n" + line + "\n")
        with pytest.raises(sft.DataError, match=message):
            sft.load_data(str(path), tiny_tokenizer, sft.Config(max_len=1024))


def test_too_long_truncated_or_dropped(tiny_tokenizer, tmp_path):
    data = write_fixture(tmp_path / "d.jsonl", 12, seed=3)
    full, _ = sft.load_data(data, tiny_tokenizer, sft.Config(max_len=10_000))
    cut = sorted(len(s[0]) for s in full)[6]
    short, stats = sft.load_data(data, tiny_tokenizer, sft.Config(max_len=cut, too_long="drop"))
    assert stats["dropped_too_long"] == sum(len(s[0]) > cut for s in full) == 12 - len(short)
    kept, stats = sft.load_data(data, tiny_tokenizer, sft.Config(max_len=cut, too_long="truncate"))
    assert stats["truncated"] == 12 - len(short) and max(len(s[0]) for s in kept) == cut


# -----------------------------------------------------------------------------
# packing


def test_pack_and_plan():
    lengths = [7, 3, 5, 9, 1, 4, 4]
    bins = sft.pack(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins) and len(bins) == 4  # 33 tokens
    micro = sft.plan(range(7), lengths, world=2, budget=10)
    assert len(micro[0]) == len(micro[1])  # every rank runs the same number of micro-batches
    assert sorted(i for rank in micro for b in rank for i in b) == list(range(7))


def test_packed_loss_equals_per_sequence_loss(tiny_ckpt, tiny_tokenizer, tmp_path):
    seqs, _ = sft.load_data(write_fixture(tmp_path / "d.jsonl", 5, seed=1), tiny_tokenizer, sft.Config(max_len=4096))
    model = Transformer.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        packed = sft.packed_nll(model, sft.micro_batch(seqs, "cpu"))
        separate = sum(sft.packed_nll(model, sft.micro_batch([s], "cpu")) for s in seqs)
        # and against plain full logits, one sequence at a time
        direct = 0.0
        for ids, mask in seqs:
            logits = model(ids[None].long())[0, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(1, ids[1:].long()[:, None])[:, 0]
            direct += -(logp * mask[1:]).sum()
    assert torch.allclose(packed, separate, rtol=1e-5) and torch.allclose(packed, direct, rtol=1e-5)
    # packing keeps attention inside each trajectory: per-token log-probs match too
    ids, targets, mask, cu = sft.micro_batch(seqs, "cpu")
    lp = model.token_logprobs(ids, targets, cu_seqlens=cu)[0]
    s, e = int(cu[2]), int(cu[3])
    one = sft.micro_batch([seqs[2]], "cpu")
    assert torch.allclose(lp[s:e], model.token_logprobs(one[0], one[1])[0], atol=1e-5)


# -----------------------------------------------------------------------------
# training


def test_torchrun_two_ranks_matches_one_process(tiny_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM
    data = write_fixture(tmp_path / "d.jsonl", 24, seed=2)
    one = config(tiny_ckpt, data, tmp_path / "one", max_steps=3, micro_batch_tokens=1200)
    two = config(tiny_ckpt, data, tmp_path / "two", max_steps=3, micro_batch_tokens=1200)
    # one after the other: on 2 cores, overlapping runs would oversubscribe the CPU threads
    proc = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "sft.py", *flags(two)])
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    sft.train(one)
    a, b = train_losses(one.out_dir), train_losses(two.out_dir)
    assert len(a) == len(b) == 3 and a[0] > a[-1], (a, b)
    assert all(abs(x - y) < 1e-4 * abs(x) for x, y in zip(a, b)), (a, b)
    with open(os.path.join(two.out_dir, "metrics.jsonl")) as f:
        steps = [e for e in map(json.loads, f) if e["event"] == "train"]
    assert all(0 <= e["padding_waste"] < 1 and 0 < e["budget_fill"] <= 1 for e in steps)
    final = os.path.join(two.out_dir, "final")
    wa, wb = weights(os.path.join(one.out_dir, "final")), weights(final)
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    # Adam divides by sqrt(v): fp-level gradient differences move weights by ~1% of one lr-sized step
    assert diff < 1e-4, diff
    hf = AutoModelForCausalLM.from_pretrained(final).eval()
    ours = Transformer.from_pretrained(final)
    ids = torch.randint(0, ours.config.vocab_size, (1, 20))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() < 1e-4
    assert (os.path.exists(os.path.join(final, "tokenizer.json"))
            and os.path.exists(os.path.join(final, "chat_template.jinja"))
            or "chat_template" in json.load(open(os.path.join(final, "tokenizer_config.json"))))


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_kill_and_resume_matches_uninterrupted(tiny_ckpt, tmp_path, one_thread, one_rank_collectives):
    data = write_fixture(tmp_path / "d.jsonl", 40, seed=4)
    common = dict(epochs=2, batch_size=8, eval_size=4, eval_every=3)  # 8 steps: 36 // 8 per epoch, as verl
    whole = config(tiny_ckpt, data, tmp_path / "whole", **common)
    parts = config(tiny_ckpt, data, tmp_path / "parts", save_every=1, **common)
    # one thread on both sides: CPU matmuls reduce in an order that depends on the thread count, and
    # other test files may have changed this process's count
    torch.set_num_threads(1)  # restored by the one_thread fixture
    proc = run_cli(["sft.py", *flags(parts)], threads=1)
    try:  # SIGKILL once step 2's checkpoint is complete (the run may be anywhere in step 3 or its save)
        while not os.path.exists(os.path.join(parts.out_dir, "step_000002")) and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    sft.train(whole)
    killed_at = checkpoints(parts.out_dir, resumable=True)[-1][0]
    assert killed_at < 8, "the run finished before it was killed"
    sft.train(parts)  # the same command resumes
    wa, wb = weights(os.path.join(whole.out_dir, "final")), weights(os.path.join(parts.out_dir, "final"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa), f"killed at step {killed_at}"
    a, b = train_losses(whole.out_dir), train_losses(parts.out_dir)
    assert a == b[-len(a):]
    # only the newest checkpoint keeps its resume state; a leftover .tmp dir never counts as one
    assert [s for s, _ in checkpoints(parts.out_dir, resumable=True)] == [8]
    # metrics.jsonl holds every step once: the lines the killed run wrote past its checkpoint are gone
    steps = [e["step"] for e in map(json.loads, open(os.path.join(parts.out_dir, "metrics.jsonl")))
             if e["event"] == "train"]
    assert steps == list(range(1, 9))
    # resuming with a setting that changes the data order or the schedule is refused, naming it
    changed = config(tiny_ckpt, data, tmp_path / "parts", save_every=1, resume=True, **dict(common, batch_size=4))
    with pytest.raises(SystemExit, match="--batch_size is 4, .*step_000008 was made with 8: pass another --out_dir"):
        sft.train(changed)
    assert not [n for n in os.listdir(parts.out_dir) if n.startswith(".tmp")]
    assert one_rank_collectives == []  # training, saving and resuming in one process: no collective


def test_overfits_a_handful_of_trajectories(tiny_ckpt, tmp_path):
    data = write_fixture(tmp_path / "d.jsonl", 4, seed=5)
    cfg = config(tiny_ckpt, data, tmp_path / "fit", epochs=80, batch_size=2, lr=3e-3, warmup_ratio=0.05,
                 gradient_checkpointing=False)
    sft.train(cfg)
    losses = train_losses(cfg.out_dir)
    last_epoch = sum(losses[-2:]) / 2  # both halves of the data
    assert losses[0] > 3 and last_epoch < 0.05, (losses[0], last_epoch)


def test_cli_flags(monkeypatch):
    cfg = sft.parse_args(["--lr=0.5", "--resume", "--too_long", "drop", "--data", "rows.jsonl"])
    assert cfg.lr == 0.5 and cfg.resume and cfg.too_long == "drop" and cfg.data == "rows.jsonl"
    # one set of defaults, the recipe's, whatever the entry point; the toy is a named preset
    assert sft.parse_args([]) == sft.Config()
    assert (cfg.model, cfg.lr and sft.Config().lr, cfg.warmup_ratio, cfg.epochs, cfg.batch_size, cfg.max_len,
            cfg.grad_clip) == ("Qwen/Qwen3-4B-Instruct-2507", 1e-5, 0.1, 5, 32, 32768, 1.0)
    toy = sft.parse_args(["--preset", "toy", "--epochs=1"])
    assert toy.model == "toy" and toy.max_len == sft.TOY["max_len"] and toy.epochs == 1
    ran = []
    monkeypatch.setattr(sft, "train", ran.append)
    sft.main([])  # `python sft.py` alone runs the toy preset
    assert ran == [sft.parse_args(["--preset=toy"])]
    with pytest.raises(SystemExit):
        sft.parse_args(["--learning_rate=1"])


def test_qwen3_hybrid_thinking_template(tiny_tokenizer):
    """Qwen3-4B's own template writes an empty think block into the last assistant turn only, so a
    turn renders differently once later messages follow it; the mask still covers the assistant's
    tokens exactly (the think block the template puts into its turn included)."""
    import copy
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = open(os.path.join(ROOT, "tests", "fixtures", "qwen3_hybrid_chat_template.jinja")).read()
    record = conversation(random.Random(3))
    while len(record["messages"]) < 4:  # at least one tool call before the answer
        record = conversation(random.Random(len(record["messages"]) + 10))
    ids, mask, _ = sft.render(ChatFormat(tok), record["messages"], record["tools"])
    assert ids == tok.encode(tok.apply_chat_template(record["messages"], tools=record["tools"], tokenize=False),
                             add_special_tokens=False)
    runs, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assistant = [m for m in record["messages"] if m["role"] == "assistant"]
    assert len(runs) == len(assistant) and all(r.endswith("<|im_end|>") for r in runs)
    assert runs[-1] == "<think>\n\n</think>\n\n" + assistant[-1]["content"] + "<|im_end|>"
    assert all(r.startswith("<tool_call>") or r.startswith(m["content"]) for r, m in zip(runs[:-1], assistant))


def test_fsdp_reduce_scatters_every_micro_batch(tiny_ckpt, tmp_path, monkeypatch):
    """Under torchrun (here a world of one, FSDP2 for real) each micro-batch's gradient is
    reduce-scattered as its backward ends, as in rl.update: none is held unsharded between
    micro-batches (synced once per step, every rank held the whole model's in fp32)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    calls, real = [], _fsdp_param_group.foreach_reduce
    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    data = write_fixture(tmp_path / "d.jsonl", 16, seed=6)
    sft.train(config(tiny_ckpt, data, tmp_path / "fsdp", max_steps=2, micro_batch_tokens=1024))
    with open(tmp_path / "fsdp" / "metrics.jsonl") as f:
        micro = [e["micro_batches"] for e in map(json.loads, f) if e["event"] == "train"]
    units = 1 + Transformer.from_pretrained(tiny_ckpt).config.num_hidden_layers
    assert len(micro) == 2 and max(micro) > 1 and len(calls) == sum(micro) * units
