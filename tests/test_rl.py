"""rl.py: each piece against hand-computed values, then whole steps on the tiny model."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import rl
from conftest import spy_collectives
from rl import Config, group_advantages, grpo_tcr_loss, overlong_penalty, shape_reward


# -----------------------------------------------------------------------------
# advantages


def test_group_advantages_table():
    rewards = [1, -1, -1, -1,          # mean -0.5, unbiased std 1 -> 1.5, -0.5, -0.5, -0.5
               1, 1, -1, -1,           # mean 0, std sqrt(4/3) -> +-sqrt(3)/2
               0.3, 0.3, 0.3, 0.3,     # all equal -> 0 exactly (not rounding noise / noise)
               -0.6, -1, -1, -0.6]     # mean -0.8, std sqrt(0.16/3) -> +-sqrt(3)/2
    adv = group_advantages(rewards, 4, eps=0.0)
    h = math.sqrt(3) / 2
    expected = [1.5, -0.5, -0.5, -0.5, h, h, -h, -h, 0, 0, 0, 0, h, -h, -h, h]
    assert adv.dtype == torch.float32 and adv.shape == (16,)
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert (adv[8:12] == 0).all()


def test_group_advantages_eps_and_singletons():
    adv = group_advantages([1.0, -1.0], 2, eps=1e-6)  # std sqrt(2)
    assert torch.allclose(adv, torch.tensor([1, -1]) / (math.sqrt(2) + 1e-6))
    assert (group_advantages([0.5, 2.0, -1.0], 1) == 0).all()  # n = 1: nothing to compare, not nan


# -----------------------------------------------------------------------------
# rewards


def test_overlong_penalty_boundaries():
    # defaults: no penalty up to 20480 - 4096 = 16384, then linear down to -1 at 20480
    assert overlong_penalty(0) == 0.0
    assert overlong_penalty(16384) == 0.0 and math.copysign(1, overlong_penalty(16384)) == 1
    assert overlong_penalty(16385) == pytest.approx(-1 / 4096)
    assert overlong_penalty(18432) == pytest.approx(-0.5)
    assert overlong_penalty(20480) == pytest.approx(-1.0)
    assert overlong_penalty(20480, factor=0.5) == pytest.approx(-0.5)
    assert [overlong_penalty(L, max_len=10, buffer=4) for L in (6, 7, 8, 10)] == [0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(10, max_len=10, buffer=0) == 0.0


def test_reward_shaping():
    cfg = Config(model="x", max_response_tokens=100, overlong_buffer=20)
    wrong, right = rl.correctness_reward("math", 0.0), rl.correctness_reward("math", 1.0)
    assert (wrong, right) == (-1.0, 1.0)
    assert rl.correctness_reward("choice", 1.0) == 1.0
    assert rl.correctness_reward("code", 0.5) == 0.5       # fraction of tests, program present
    assert rl.correctness_reward("code", 0.0) == 0.0
    assert rl.correctness_reward("code", 0.0, has_program=False) == -1.0
    # capped tool bonus for wrong answers: min(-0.6, -1 + 0.1 x tool turns)
    assert [shape_reward(wrong, k, 10, cfg) for k in (0, 1, 2, 4, 10)] == pytest.approx([-1, -0.9, -0.8, -0.6, -0.6])
    assert shape_reward(right, 5, 10, cfg) == 1.0          # never above a right answer
    assert shape_reward(0.5, 3, 10, cfg) == 0.5            # partial code credit is not "wrong"
    assert shape_reward(wrong, 3, 10, Config(model="x", tool_bonus=False)) == -1.0
    # overlong: 90 tokens of 100 with a 20 buffer -> -0.5 on top
    assert shape_reward(right, 0, 90, cfg) == pytest.approx(0.5)
    assert shape_reward(wrong, 1, 90, cfg) == pytest.approx(-1.4)
    assert shape_reward(right, 0, 90, Config(model="x", overlong=False, max_response_tokens=100)) == 1.0


# -----------------------------------------------------------------------------
# the loss


def branch_batch():
    """One row, seven tokens, one per branch (clip_low 0.2, clip_high 0.3, c 10):
       A   r     -A r   -A clip(r)   loss    branch              d loss / d logp (x 6)
       +1  1.1   -1.1   -1.1         -1.1    inside              -A r = -1.1
       +1  1.5   -1.5   -1.3         -1.3    clip high           0
       -1  0.5    0.5    0.8          0.8    clip low            0
       -1  2.0    2.0    1.3          2.0    unclipped (A < 0)   -A r = 2.0
       -1  12    12      1.3         10      dual clip           0
       +2  0.5   -1.0   -1.6         -1.0    inside (A > 0)      -A r = -1.0
       +5  3     (masked out)
    """
    A = torch.tensor([[1, 1, -1, -1, -1, 2, 5]], dtype=torch.float32)
    r = torch.tensor([[1.1, 1.5, 0.5, 2.0, 12.0, 0.5, 3.0]])
    old = torch.linspace(-3, -0.5, 7)[None]
    logp = (old + r.log()).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.float32)
    return logp, old, A, mask, r


def test_loss_and_gradient_each_branch():
    logp, old, A, mask, r = branch_batch()
    loss, stats = grpo_tcr_loss(logp, old, A, mask, clip_low=0.2, clip_high=0.3, clip_c=10.0)
    assert loss.item() == pytest.approx((-1.1 - 1.3 + 0.8 + 2.0 + 10.0 - 1.0) / 6, rel=1e-5)
    loss.backward()
    expected = torch.tensor([[-1.1, 0, 0, 2.0, 0, -1.0, 0]]) / 6
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert stats["clip_high"].item() == pytest.approx(1 / 6)
    assert stats["clip_low"].item() == pytest.approx(1 / 6)
    assert stats["clip_dual"].item() == pytest.approx(1 / 6)
    rm = r[0, :6]
    assert stats["approx_kl"].item() == pytest.approx(float(((rm - 1) - rm.log()).sum() / 6), rel=1e-5)
    # num_tokens from outside: the same sum, another denominator
    loss10, _ = grpo_tcr_loss(logp, old, A, mask, 0.2, 0.3, 10.0, num_tokens=10)
    assert loss10.item() == pytest.approx(9.4 / 10, rel=1e-5)


def test_loss_without_clip_higher_and_with_weights():
    logp, old, A, mask, _ = branch_batch()
    # GRPO-T: eps_high = eps_low = 0.2: token 2 now clips at 1.2; the rest is unchanged
    loss, _ = grpo_tcr_loss(logp, old, A, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 + 2.0 + 10.0 - 1.0) / 6, rel=1e-5)
    w = torch.tensor([[2.0, 1, 1, 1, 1, 1, 1]])
    loss_w, _ = grpo_tcr_loss(logp, old, A, mask, 0.2, 0.3, is_weights=w)
    assert loss_w.item() == pytest.approx((-2.2 - 1.3 + 0.8 + 2.0 + 10.0 - 1.0) / 6, rel=1e-5)
    ent = torch.full_like(old, 0.5)
    _, stats = grpo_tcr_loss(logp, old, A, mask, entropy=ent)
    assert stats["entropy"].item() == pytest.approx(0.5)


def test_seq_mean_token_mean():
    # on-policy (ratio 1): per-token loss is -A. Sequence 0: 2 tokens of A=1; sequence 1: 4 of A=-0.5
    logp = torch.zeros(1, 6, requires_grad=True)
    A = torch.tensor([[1.0, 1.0, -0.5, -0.5, -0.5, -0.5]])
    mask = torch.ones(1, 6)
    seq = torch.tensor([[0, 0, 1, 1, 1, 1]])
    tok, _ = grpo_tcr_loss(logp, logp.detach(), A, mask)
    seqm, _ = grpo_tcr_loss(logp, logp.detach(), A, mask, agg="seq-mean-token-mean", seq_ids=seq)
    assert tok.item() == pytest.approx((-2 + 2) / 6)
    assert seqm.item() == pytest.approx((-1 + 0.5) / 2)
    # rows are the sequences when seq_ids is not given
    seqm_rows, _ = grpo_tcr_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([[1.0], [-0.5]]),
                                 torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32), agg="seq-mean-token-mean")
    assert seqm_rows.item() == pytest.approx((-1 + 0.5) / 2)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_same_whole_or_in_micro_batches(agg):
    torch.manual_seed(0)
    B, T = 8, 16
    old = -torch.rand(B, T) * 3
    logp0 = old + torch.randn(B, T) * 0.4          # ratios on every side of the clip range
    A = torch.randn(B, 1)
    mask = (torch.rand(B, T) > 0.3).float()
    mask[:, 0] = 1

    logp = logp0.clone().requires_grad_(True)
    whole, _ = grpo_tcr_loss(logp, old, A, mask, agg=agg)
    whole.backward()
    g_whole = logp.grad.clone()

    logp = logp0.clone().requires_grad_(True)
    total = 0.0
    n_tok = mask.sum()
    for rows in torch.arange(B).chunk(4):
        part, _ = grpo_tcr_loss(logp[rows], old[rows], A[rows], mask[rows], num_tokens=n_tok, agg=agg, num_seqs=B)
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(logp.grad, g_whole, atol=1e-7)


# -----------------------------------------------------------------------------
# data order, options


def test_batch_indices_epochs_and_determinism():
    seen = [rl.batch_indices(s, 4, 10, seed=3) for s in range(5)]   # 20 = two epochs of 10
    flat = [i for b in seen for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]                                     # a new permutation per epoch
    assert rl.batch_indices(3, 4, 10, seed=3) == seen[3]              # a pure function of the step
    assert rl.batch_indices(0, 4, 10, seed=4) != seen[0]


def test_parse_args_presets_and_types(capsys):
    paper = rl.parse_args([])           # one set of defaults: the paper's recipe
    assert paper == Config() and paper.model == "Gen-Verse/Qwen3-4B-RA-SFT"
    assert (paper.prompts_per_step, paper.samples_per_prompt, paper.mini_batch_prompts) == (64, 16, 16)
    assert (paper.lr, paper.clip_low, paper.clip_high, paper.clip_c, paper.max_parallel_calls) == (
        1e-6, 0.2, 0.315, 10.0, 1)
    toy = rl.parse_args(["--preset", "toy", "--steps=3"])   # the toy, by name
    assert toy.model == "toy" and toy.prompts_per_step == rl.TOY["prompts_per_step"] and toy.steps == 3
    c = rl.parse_args(["--model", "/m", "--clip-higher=false", "--overlong", "false", "--dynamic_sampling",
                       "--lr", "3e-6", "--steps=7"])
    assert ((c.model, c.clip_higher, c.overlong, c.dynamic_sampling, c.lr, c.steps)
            == ("/m", False, False, True, 3e-6, 7))
    with pytest.raises(SystemExit, match="unrecognized argument --nope=1"):
        rl.parse_args(["--nope=1"])
    with pytest.raises(SystemExit, match="invalid int value: 'x'"):
        rl.parse_args(["--steps=x"])
    with pytest.raises(SystemExit):
        rl.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())   # each option with its comment and default
    assert ("--grad-clip GRAD_CLIP, --grad_clip GRAD_CLIP 0: no clipping "
            "(the norm is still logged) (default: 1.0)" in help_text)
    ran = []
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(rl, "train", ran.append)
    rl.main([])                          # `python rl.py` alone runs the toy preset
    monkeypatch.undo()
    assert ran == [rl.parse_args(["--preset=toy"])]


def test_bad_record_stops_with_file_and_line(tmp_path):
    path = tmp_path / "rl.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": "2", "kind": "math"}\n'
                    '{"prompt": "2+2?", "answer": "4", "kind": "math"}\n'
                    '{"prompt": "x", "kind": "essay"}\n')
    with pytest.raises(SystemExit, match=r"rl\.jsonl: line 3: .*kind"):
        rl.evaluate.load_jsonl(str(path))
    path.write_text('{"prompt": "1+1?", "answer": "2", "kind": "math"}\n{not json\n')
    with pytest.raises(SystemExit, match=r"rl\.jsonl: line 2"):
        rl.evaluate.load_jsonl(str(path))


# -----------------------------------------------------------------------------
# whole steps on a tiny model: real rollouts, real sandbox calls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = [(12, 34), (56, 78), (49, 97), (20, 30)]


def tool_messages(a, b):
    return [{"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "code_interpreter", "arguments": {"code": f"print({a} * {b})"}}}]},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"\\boxed{{{a * b}}}"}]


@pytest.fixture(scope="session")
def tool_policy(tmp_path_factory):
    """A very small model taught for a few seconds to answer two problems with a code-tool call:
    sampled at temperature 1 it makes real tool calls, some right, some broken, so groups have
    different rewards and the update is not trivial."""
    from data.tiny import build_tiny_checkpoint
    from model import Transformer, cu_seqlens_from_lengths
    from data.prompts import CODE_INTERPRETER as TOOL_SCHEMA
    from transformers import AutoTokenizer
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tool_policy")), seed=0, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=32)
    tok = AutoTokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path)
    seqs = []
    for a, b in PAIRS[:2]:
        msgs = tool_messages(a, b)
        full = tok.encode(tok.apply_chat_template(msgs, tools=[TOOL_SCHEMA], tokenize=False), add_special_tokens=False)
        prompt = tok.encode(tok.apply_chat_template(msgs[:1], tools=[TOOL_SCHEMA], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
        seqs.append((full, len(prompt)))
    ids = torch.tensor([sum((f[:-1] for f, _ in seqs), [])])
    targets = torch.tensor([sum((f[1:] for f, _ in seqs), [])])
    weight = torch.tensor([sum(([0.0] * (p - 1) + [1.0] * (len(f) - p) for f, p in seqs), [])])
    cu = cu_seqlens_from_lengths([len(f) - 1 for f, _ in seqs])
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(70):
        loss = -(model.token_logprobs(ids, targets, cu_seqlens=cu) * weight).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    data = tmp_path_factory.mktemp("rl_data")
    rows = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b), "kind": "math"} for a, b in PAIRS]
    # a fifth problem whose prompt is over any test's max_prompt_tokens: filtered out at load time
    overlong = {"prompt": "What is " + " * ".join(["12"] * 400) + "?", "answer": "0", "kind": "math"}
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [overlong]))
    (data / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[1:3]))
    return path, str(data / "train.jsonl"), str(data / "heldout.jsonl")


def small_run(tool_policy, out_dir, **overrides):
    model, train, _ = tool_policy
    options = dict(model=model, data=train, out_dir=str(out_dir), steps=2, prompts_per_step=4, max_prompt_tokens=512,
                   samples_per_prompt=4, mini_batch_prompts=2, max_response_tokens=80, overlong_buffer=32,
                   max_turns=3, tool_timeout=5.0, lr=1e-4, save_every=1, micro_batch_tokens=600,
                   logprob_micro_batch_tokens=1200, activation_checkpointing=False, score_workers=2,
                   log_samples=0, eval_every=0)
    options.update(overrides)
    return options


def as_args(options):
    return [f"--{k}={v}" for k, v in options.items()]


def weights(run_dir, step):
    from safetensors.torch import load_file
    return load_file(os.path.join(run_dir, f"step_{step:06d}", "model.safetensors"))


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if r.get("event") == "step"}


@pytest.fixture(scope="session")
def reference_run(tool_policy, tmp_path_factory):
    """Two uninterrupted steps in this process, with held-out evaluation before and after. Records
    (in SPY) every Engine made, and at each rollout the engine used and whether any gradient was held."""
    import rollout
    out = tmp_path_factory.mktemp("rl_reference")
    cfg = Config(**small_run(tool_policy, out, eval_data=tool_policy[2], eval_n=2))
    make, roll = rollout.Engine.__init__, rollout.rollout

    def made(engine, *args, **kwargs):
        SPY["engines"].append(engine)
        make(engine, *args, **kwargs)

    def rolled(model, *args, engine=None, **kwargs):
        SPY["rollouts"].append((engine, engine.cache.kv[0], any(p.grad is not None for p in model.parameters())))
        return roll(model, *args, engine=engine, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout.Engine, "__init__", made)
        mp.setattr(rollout, "rollout", rolled)
        spy_collectives(mp, SPY["collectives"])
        summary = rl.train(cfg)
    return str(out), summary


SPY = {"engines": [], "rollouts": [], "collectives": []}


def test_a_one_process_run_calls_no_collective(reference_run):
    """Two steps with evaluations and checkpoints in one process: no collective on the group of one
    (before: all_reduce, all_gather_object, broadcast_object_list, barrier, and dcp's own)."""
    assert SPY["collectives"] == []


def test_two_steps_single_process(reference_run, tool_policy):
    out, summary = reference_run
    assert summary["config"]["max_prompt_tokens"] == 512   # and the overlong fifth problem was dropped, not fatal
    m = metrics(out)
    assert sorted(m) == [1, 2]
    first = m[1]
    for key in ("reward", "accuracy", "tool_calls_per_traj", "tool_call_success", "response_length", "truncated",
                "clip_high", "clip_low", "clip_dual", "entropy", "approx_kl", "grad_norm", "mismatch_mean",
                "mismatch_max", "mismatch_outside"):
        assert key in first and first[key] is not None, key
    assert set(first["time"]) >= {"rollout", "sandbox", "score", "old_logprob", "update", "step"}
    assert first["updates"] == 2                        # 4 prompts, mini-batches of 2
    assert first["tool_calls_per_traj"] > 0 and first["time"]["sandbox"] > 0   # the sandbox really ran
    assert first["grad_norm"] > 0 and first["groups_all_equal"] < 1           # a real update
    assert first["mismatch_mean"] < 1e-3          # one module samples and trains
    # the update moved the weights; the checkpoint is a Hugging Face dir with a tokenizer
    start = checkpoint_weights(tool_policy[0])
    assert max_diff(weights(out, 1), start) > 1e-5
    assert os.path.exists(os.path.join(out, "step_000002", "tokenizer.json"))
    assert os.readlink(os.path.join(out, "final")) == "step_000002"
    assert summary["before"]["accuracy"] is not None and summary["after"]["accuracy"] is not None
    on_disk = json.load(open(os.path.join(out, "summary.json")))
    assert set(on_disk) >= {"before", "after", "config"}


def test_one_engine_for_every_rollout_and_evaluation(reference_run):
    """The KV pool is sized once per process: one Engine, the same pool, for the two steps' rollouts and
    the evaluations before and after (held-out 2 problems x eval_n 2: one batch each); the gradients of
    each update are freed before the next rollout; each step's line says how the pool was used."""
    out, _ = reference_run
    (engine,) = SPY["engines"]
    assert len(SPY["rollouts"]) == 4
    assert all(e is engine and pool is engine.cache.kv[0] for e, pool, _ in SPY["rollouts"])
    assert not any(held for _, _, held in SPY["rollouts"])
    for m in metrics(out).values():
        assert m["kv_pool_tokens"] == engine.num_blocks * engine.blocks.block_size
        assert 0 < m["kv_peak_tokens"] <= m["kv_pool_tokens"] and m["preemptions"] == 0
        assert "memory_gib" not in m  # CUDA only


def test_kept_trajectories(reference_run, tool_policy):
    """--save_trajectories 1 (the default): each step's first group, whole, as evaluate.py writes trajectories,
    with the step, reward, advantage and the trainer's log-probs beside the sampler's."""
    import gzip
    out, _ = reference_run
    for step, m in metrics(out).items():
        with gzip.open(os.path.join(out, "trajectories", f"step_{step:06d}.jsonl.gz"), "rt") as f:
            records = [json.loads(line) for line in f]
        assert [(r["problem_index"], r["sample_index"]) for r in records] == [(0, j) for j in range(4)]
        for r in records:
            n = len(r["response_ids"])
            assert r["step"] == step and len(r["loss_mask"]) == len(r["logprobs"]) == len(r["trainer_logprobs"]) == n
            assert r["prompt"].startswith("<|im_start|>system") and r["uid"].isdigit()
            assert {"reward", "advantage", "score", "correct", "tool_calls", "finish_reason", "text"} <= set(r)
            near = [abs(a - b) < 1e-3 for a, b, k in zip(r["logprobs"], r["trainer_logprobs"], r["loss_mask"]) if k]
            assert all(near)       # one module samples and trains
        assert sum(r["advantage"] for r in records) == pytest.approx(0.0, abs=1e-5)


def checkpoint_weights(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def test_kill_and_resume_reproduces_the_run(reference_run, tool_policy, tmp_path):
    """Kill a run (SIGKILL) once its first checkpoint is on disk, start it again: the result is
    the uninterrupted run's, bit for bit (which also shows evaluation leaves training alone:
    the reference evaluated before and after, this run does not)."""
    ref_dir, _ = reference_run
    out = tmp_path / "killed"
    options = small_run(tool_policy, out)
    proc = subprocess.Popen([sys.executable, "rl.py", *as_args(options)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / "step_000001"          # renamed into place only once complete
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not first.exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert first.exists(), "the run never wrote its first checkpoint"
    rl.train(Config(**options))
    assert max_diff(weights(str(out), 2), weights(ref_dir, 2)) == 0.0
    a, b = metrics(str(out)), metrics(ref_dir)
    assert sorted(a) == [1, 2]
    for key in ("reward", "accuracy", "loss", "grad_norm", "clip_high", "response_length"):
        assert a[2][key] == b[2][key], key


def test_torchrun_two_processes_same_update(reference_run, tool_policy, tmp_path):
    """The same global batch on 2 processes (gloo, FSDP2) gives the single process's update."""
    import inspect
    import rollout
    ref_dir, _ = reference_run
    out = tmp_path / "ddp"
    options = small_run(tool_policy, out, steps=1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "rl.py",
           *as_args(options)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "seeds" in inspect.signature(rollout.rollout).parameters  # per-problem seeds: same samples on any split
    a, b = metrics(str(out))[1], metrics(ref_dir)[1]
    # the same trajectories; the reward mean is summed in another order across ranks
    assert a["reward"] == pytest.approx(b["reward"], rel=1e-12) and a["response_length"] == b["response_length"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert max_diff(weights(str(out), 1), weights(ref_dir, 1)) < 1e-5


SLOW_RANK = """
import os, sys, time
sys.path.insert(0, {root!r})
import rl
from machinery.exits import exit_worker
grade = rl.grade


def slow(*args):  # rank 1 grades {delay} s late: a slow sandbox, long trajectories
    if os.environ["RANK"] == "1":
        time.sleep({delay})
    return grade(*args)


rl.grade = slow
rl.main(sys.argv[1:])
exit_worker()
"""


def test_a_slow_rank_does_not_stop_the_run(tool_policy, tmp_path):
    """Rank 1 finishes its rollout and grading 12 s after rank 0, twice the --dist_timeout of 6 s:
    rank 0 waits for the rewards on the long-timeout group, and the step ends (the gather on the
    default group stopped the job after --dist_timeout)."""
    script = tmp_path / "slow_rank.py"
    script.write_text(SLOW_RANK.format(root=ROOT, delay=12))
    out = tmp_path / "slow"
    options = small_run(tool_policy, out, steps=1, dist_timeout=0.1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), *as_args(options)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(metrics(str(out))) == [1]


def test_nan_loss_stops_with_the_step(tool_policy, tmp_path, monkeypatch):
    real = rl.grpo_tcr_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(rl, "grpo_tcr_loss", nan_loss)
    with pytest.raises(SystemExit, match=r"step 1: loss nan"):
        rl.train(Config(**small_run(tool_policy, tmp_path / "nan", steps=1, prompts_per_step=2, samples_per_prompt=2,
                                    max_response_tokens=40)))
    assert not os.path.exists(tmp_path / "nan" / "final")


def test_bad_record_stops_the_run(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": "2", "kind": "math"}\n{"prompt": "", "kind": "math"}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl: line 2"):
        rl.train(Config(model="unused", data=str(path), out_dir=str(tmp_path / "run")))


# -----------------------------------------------------------------------------
# what a reading against verl found (issue 16)


def test_log_ratio_is_clamped_as_verl():
    # A = 0 with a log-ratio of 100: exp(100) * 0 would be inf * 0 = nan without verl's clamp to [-20, 20]
    logp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    loss, stats = grpo_tcr_loss(logp, torch.zeros(1, 2), torch.zeros(1, 1), torch.ones(1, 2))
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == 0.0 and torch.isfinite(logp.grad).all()
    assert math.isfinite(stats["approx_kl"].item())
    big, _ = grpo_tcr_loss(torch.tensor([[30.0]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), clip_c=1e12)
    assert big.item() == pytest.approx(math.exp(20.0))        # the ratio saturates at exp(20)


def tiny_update_inputs(tiny_ckpt):
    from model import Transformer
    model = Transformer.from_pretrained(tiny_ckpt)
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(3):
        ids = torch.randint(3, model.config.vocab_size, (12,), generator=g).tolist()
        samples.append(dict(ids=ids, prompt_len=4, mask=[1] * 8, sampler_logprobs=[0.0] * 8, adv=[1.0, -0.5, 0.3][k]))
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["ids"]])
            s["old_logprobs"] = model.token_logprobs(ids[:, :-1], ids[:, 1:])[0] + 0.05
    return model, samples


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_entropy_bonus_moves_the_gradient(tiny_ckpt):
    """--entropy_coef: the gradient of the update is the policy loss's minus coef times the
    gradient of the token-mean entropy (it used to come from no-grad stats: no effect at all)."""
    from machinery.distributed import setup_distributed
    setup_distributed()
    model, samples = tiny_update_inputs(tiny_ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    n_tok = sum(sum(s["mask"]) for s in samples)
    base = Config(model="x", micro_batch_tokens=20, grad_clip=1e9)  # no clipping: compare raw gradients
    rl.update(model, opt, samples, n_tok, 3, base, torch.device("cpu"), 1)
    g0 = grads(model)
    rl.update(model, opt, samples, n_tok, 3, Config(model="x", micro_batch_tokens=20, grad_clip=1e9, entropy_coef=0.5),
              torch.device("cpu"), 1)
    g1 = grads(model)
    # the reference: the entropy term alone, by hand over the same tokens
    model.zero_grad()
    for s in samples:
        ids = torch.tensor([s["ids"]])
        _, ent = model.token_logprobs(ids[:, :-1], ids[:, 1:], return_entropy=True)
        (-0.5 * ent[0, s["prompt_len"] - 1:].sum() / n_tok).backward()
    g_ent = grads(model)
    assert (g1 - g0).abs().max() > 1e-6
    assert torch.allclose(g1 - g0, g_ent, atol=1e-6)


def test_grad_clip_zero_means_no_clipping(tiny_ckpt):
    """--grad_clip=0 is off, as in sft.py (clip_grad_norm_(max_norm=0) would zero every gradient);
    a small positive value clips to it; the logged norm is the one before clipping."""
    from machinery.distributed import setup_distributed
    setup_distributed()
    model, samples = tiny_update_inputs(tiny_ckpt)
    opt, n_tok, cpu = (torch.optim.AdamW(model.parameters(), lr=0.0),
                       sum(sum(s["mask"]) for s in samples), torch.device("cpu"))
    results = {}
    for clip in (1e9, 0.0, 1e-3):
        stats = rl.update(model, opt, samples, n_tok, 3,
                          Config(model="x", micro_batch_tokens=20, grad_clip=clip), cpu, 1)
        results[clip] = (stats["grad_norm"], grads(model))
    norm = results[1e9][0]
    assert norm > 1e-3 and results[0.0][0] == pytest.approx(norm) and results[1e-3][0] == pytest.approx(norm)
    assert torch.equal(results[0.0][1], results[1e9][1])
    assert float(results[1e-3][1].norm()) == pytest.approx(1e-3, rel=1e-3)


def traj(problem_index, sample_index, text, calls, length=10):
    from types import SimpleNamespace
    return SimpleNamespace(problem_index=problem_index, sample_index=sample_index, prompt_ids=[1, 2],
                           response_ids=list(range(length)), loss_mask=[1] * length, logprobs=[0.0] * length,
                           text=text, tool_calls=calls, finish_reason="stop")


def test_tool_bonus_counts_tool_turns_and_code_is_graded():
    """The recipe's bonus is (num_turns - 2) / 2 * 0.1: one per assistant turn that called the
    tool, so three calls packed into one wrong turn earn 0.1, not 0.3; bad calls do not count.
    A code problem goes through the sandbox: fraction of tests passed, -1 without a program."""
    cfg = Config(model="x", max_response_tokens=100, overlong_buffer=20, score_workers=2)
    call = lambda turn, status="ok": {"code": "1", "status": status, "output": "", "turn": turn}
    math_p = {"prompt": "q", "kind": "math", "answer": "7"}
    tests = {"fn_name": None, "cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2\n", "output": "4\n"}]}
    code_p = {"prompt": "q", "kind": "code", "tests": tests}
    program = "```python\na, b = map(int, input().split())\nprint(a + b if a == 1 else 0)\n```"
    trajs = [traj(0, 0, "\\boxed{6}", [call(0), call(0), call(0)]),
             traj(0, 1, "\\boxed{6}", [call(0), call(1), call(2)]),
             traj(0, 2, "\\boxed{6}", [call(0, "bad_call"), call(1, "bad_call"), call(2)]),
             traj(0, 3, "\\boxed{7}", [call(0)]),
             traj(1, 0, program, []), traj(1, 1, "no code at all", [call(0)])]
    samples = rl.grade([math_p, code_p], trajs, cfg)
    assert [s["reward"] for s in samples] == pytest.approx([-0.9, -0.7, -0.9, 1.0, 0.5, -0.9])
    assert [s["score"] for s in samples] == pytest.approx([0, 0, 0, 1, 0.5, 0])


def test_distributed_waits_for_every_rank_before_tearing_down(monkeypatch):
    """A rank that destroys its gloo group while a peer still uses it gets the peer aborted
    (SIGABRT in a 2-rank torchrun eval): leaving normally, the group is destroyed only after a
    barrier; leaving by an exception, it is destroyed without waiting on ranks that may never come."""
    from machinery import distributed as common
    calls = []
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(common, "setup_distributed", lambda device, *_: (0, 2, torch.device("cpu"), True))
    monkeypatch.setattr(common.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(common.dist, "destroy_process_group", lambda: calls.append("destroy"))
    with common.distributed() as (rank, world, _, _):
        assert (rank, world) == (0, 2) and calls == []
    assert calls == ["barrier", "destroy"]
    calls.clear()
    with pytest.raises(SystemExit):
        with common.distributed():
            raise SystemExit("bad flag")
    assert calls == ["destroy"]


def test_setup_distributed_sets_a_long_timeout(monkeypatch):
    """Rollouts of 20k-token trajectories and rank 0's checkpoint writes keep the others waiting in
    a collective longer than a default timeout: the process group gets an explicit one (30
    minutes, --dist_timeout; evaluations gather on a group of their own)."""
    from machinery import distributed as common
    seen = {}
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(common.dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.setattr(common.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(common.dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    assert common.setup_distributed()[3] is True
    assert (seen["backend"] == "gloo" and seen["timeout"] == common.DIST_TIMEOUT
            and common.DIST_TIMEOUT.total_seconds() >= 1800)


def test_recipe_options_run_inside_the_loop(tool_policy, tmp_path):
    """kl_coef with the frozen reference, tis_cap, dynamic_sampling and ppo_epochs > 1, in real steps."""
    out = tmp_path / "options"
    summary = rl.train(Config(**small_run(tool_policy, out, steps=1, kl_coef=0.1, tis_cap=2.0, dynamic_sampling=True,
                                          ppo_epochs=2, save_every=0)))
    m = metrics(str(out))[1]
    kept = round((1 - m["groups_all_equal"]) * 4)          # problems whose group has a signal
    assert 0 < kept and m["updates"] <= 2 * 2 and m["updates"] >= 2  # two passes over the kept mini-batches
    assert m["ref_kl"] > 0 and math.isfinite(m["loss"])     # the second pass has moved away from the reference
    assert summary["config"]["kl_coef"] == 0.1


# -----------------------------------------------------------------------------
# what a reading of the CUDA paths found (issue 23), shown on CPU


@pytest.fixture
def fsdp_model(tiny_ckpt):
    """The tiny checkpoint as the trainers build it under torchrun: FSDP2, one unit per block and the root,
    here in a world of one process (gloo)."""
    from machinery.distributed import build_model, setup_distributed
    setup_distributed()
    return build_model(tiny_ckpt, torch.device("cpu"), sharded=True)


def test_full_weights_leaves_the_root_gathered_after_forward(fsdp_model):
    """After a rollout's full_weights the blocks reshard after each forward again, but the root (embeddings,
    final norm, tied head) keeps FSDP's own choice for it: gathered until the backward, not once per micro-batch."""
    from torch.distributed.tensor import DTensor
    model = fsdp_model
    with rl.full_weights(model):
        assert not isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor)
    model.train()
    model(torch.zeros(1, 4, dtype=torch.long))
    assert isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor)   # the block gave its weights back
    assert not isinstance(model.model.embed_tokens.weight, DTensor)          # the root did not


def test_gradients_are_reduced_every_micro_batch(fsdp_model, tiny_ckpt, monkeypatch):
    """Three micro-batches, one reduce-scatter per FSDP unit after each (as verl): no unsharded fp32
    gradient is held between them (machinery/memory_plan.py's probe runs this same update: tests/test_plan.py)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    real, calls = _fsdp_param_group.foreach_reduce, []
    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, samples = tiny_update_inputs(tiny_ckpt)
    opt = torch.optim.AdamW(fsdp_model.parameters(), lr=0.0)
    n_tok = sum(sum(s["mask"]) for s in samples)
    cfg = Config(model="x", micro_batch_tokens=11)  # one 11-token sample per micro-batch
    rl.update(fsdp_model, opt, samples, n_tok, 3, cfg, torch.device("cpu"), 1)
    units = 1 + len(fsdp_model.model.layers)
    assert len(calls) == 3 * units and all(p.grad is not None for p in fsdp_model.parameters())


def test_entropy_is_computed_with_gradients_only_for_its_bonus(tiny_ckpt, monkeypatch):
    from machinery.distributed import setup_distributed
    setup_distributed()
    model, samples = tiny_update_inputs(tiny_ckpt)
    asked, real = [], model.token_logprobs
    monkeypatch.setattr(model, "token_logprobs", lambda *a, **k: asked.append(k["return_entropy"]) or real(*a, **k))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    for coef in (0.0, 0.1):
        rl.update(model, opt, samples, 24, 3, Config(model="x", micro_batch_tokens=40, entropy_coef=coef),
                  torch.device("cpu"), 1)
    assert asked == [False, True]


def test_checkpoints_are_saved_in_the_base_models_dtype(tool_policy, tmp_path):
    """A bf16 base (as every Qwen3 checkpoint) is saved in bf16 (was fp32: 16 GB per save for 4B)."""
    import shutil
    from safetensors import safe_open
    from model import Transformer
    base = tmp_path / "bf16"
    shutil.copytree(tool_policy[0], base)
    Transformer.from_pretrained(str(base)).to(torch.bfloat16).save_pretrained(str(base))
    out = tmp_path / "run"
    rl.train(Config(**small_run(tool_policy, out, model=str(base), steps=1, prompts_per_step=2, samples_per_prompt=2,
                                max_response_tokens=40)))
    with safe_open(str(out / "step_000001" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.load(open(out / "step_000001" / "config.json"))["torch_dtype"] == "bfloat16"


def test_a_sandbox_that_cannot_start_stops_the_run_before_any_rollout(tool_policy, tmp_path, monkeypatch):
    """Every rank checks its sandbox at start-up (its own share of the cores, or --sandbox_workers) and stops with
    the sandbox's own error; before, the error became every tool reply and RL trained on a dead tool."""
    import rollout
    import sandbox
    told, rolled = [], []
    monkeypatch.setattr(sandbox, "configure", lambda workers, require: told.append((workers, require)))
    monkeypatch.setattr(sandbox, "check", lambda: (_ for _ in ()).throw(
        RuntimeError("sandbox: refusing to start, not in force: landlock (required by --sandbox_require=all)")))
    monkeypatch.setattr(rollout, "rollout", lambda *a, **k: rolled.append(1))
    with pytest.raises(SystemExit, match=r"rank 0: sandbox: refusing to start, not in force: landlock"):
        rl.train(Config(**small_run(tool_policy, tmp_path / "run", sandbox_workers=3, sandbox_require="all")))
    assert told == [(3, "all")] and rolled == []
