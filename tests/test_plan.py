"""scripts/plan.py and machinery/memory_plan.py: the memory plan run on fake tensors against the
same step on real CPU tensors (the same tracker) and against a count of its own where clipping
dominates, its verdict and exit status, generation in the plan, update's gradient sync pattern."""
import json
import math
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import plan  # noqa: E402
import rl  # noqa: E402
from data.tiny import TINY_CONFIG  # noqa: E402
from model import ModelConfig  # noqa: E402

SMALL = dict(micro_batch_tokens=256, logprob_micro_batch_tokens=512, max_prompt_tokens=64,
             max_response_tokens=192)


@pytest.fixture(autouse=True)
def no_process_group():
    """The plan sets up a fake process group of its own; a world-1 gloo group that an earlier test
    left in this process (distributed.setup_distributed) is taken down first."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def tiny_config():
    return ModelConfig.from_dict(dict(TINY_CONFIG, vocab_size=2048))


def test_plan_matches_the_real_step():
    """Fake tensors and real ones, one tracker: each phase's peak within 10%; AdamW's two fp32
    moments are resident in every phase (from the run's first step on) and its multi-tensor
    step (CUDA's) adds one shard-sized temporary."""
    cfg = rl.Config(**SMALL)
    fake = plan.plan_rank(tiny_config(), cfg, 0, 2, torch.bfloat16, fake=True)
    real = plan.plan_rank(tiny_config(), cfg, 0, 2, torch.bfloat16, fake=False)
    assert list(fake) == list(real) == ["generate", "old_logprob", "update", "optimizer"]
    for name in fake:
        assert fake[name]["total"] == pytest.approx(real[name]["total"], rel=0.10), name
        for kind in ("params", "grads"):
            assert fake[name][kind] == real[name][kind], (name, kind)
    shard = fake["optimizer"]["params"]            # the fp32 shard of every parameter
    for name in ("generate", "old_logprob", "update"):
        assert fake[name]["optimizer"] == pytest.approx(2 * shard, rel=0.01), name
    assert fake["optimizer"]["optimizer"] == pytest.approx(3 * shard, rel=0.01)


def write_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY_CONFIG, vocab_size=2048)))
    return str(path)


def small_flags():
    return [f"--{k}={v}" for k, v in SMALL.items()] + ["--outside_gib=0"]


def config_of(**changes):
    return ModelConfig.from_dict(dict(TINY_CONFIG, vocab_size=2048, **changes))


def independent_update(c, world):
    """What a rank holds at the update's peak when the micro-batches are a few tokens (clipping, not
    activations, would dominate), counted from the config alone: its fp32 shards of the weights, of
    their gradients and of AdamW's two moments (16 bytes a parameter, each tensor's rows padded to a
    multiple of world); in backward the root (tied embedding and head, final norm) and two blocks
    (the one differentiated, the next prefetched) gathered in bf16, that block's gradient in bf16
    and in fp32 for the reduce-scatter, and the root's in bf16."""
    d, ff, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    block = [(q + 2 * kv, d), (d, q), (2 * ff, d), (d, ff), (d,), (d,), (hd,), (hd,)]
    root = [(c.vocab_size, d), (d,)]
    shard = sum(-(-s[0] // world) * math.prod(s[1:]) for s in block * c.num_hidden_layers + root)
    n_block, n_root = (sum(math.prod(s) for s in shapes) for shapes in (block, root))
    return 16 * shard + 2 * (n_root + 2 * n_block) + 6 * n_block + 2 * n_root


def test_plan_matches_an_independent_count_where_clipping_dominates():
    """8 ranks, micro-batches of 16 tokens: the update row is the arithmetic above within 5%. The
    first clip_grad_norm_ in a process used to add an fp32 copy of every whole gradient, which the
    plan counted (DTensor's shape propagation, run in the plan's fake mode): 1.5x here, 22.48 GiB
    for Qwen3-4B where a GPU holds 18.6. (SDPA: no decode graphs' outputs beside it.)"""
    c = config_of(num_hidden_layers=6, hidden_size=192, intermediate_size=640)
    cfg = rl.Config(micro_batch_tokens=16, logprob_micro_batch_tokens=16, max_prompt_tokens=8,
                    max_response_tokens=8)
    update = plan.plan_rank(c, cfg, 0, 8, torch.bfloat16, flash=False)["update"]["total"]
    assert update == pytest.approx(independent_update(c, 8), rel=0.05)


def phase_totals(out):
    """{rank label: [each row's total]} from plan.py's printed tables."""
    tables = re.findall(r"^(rank.*)\n.*\n-+\n((?:\w+ .*\n)+)", out, re.M)
    return {label: [row.split()[-1] for row in rows.splitlines()] for label, rows in tables}


def test_every_rank_plans_alike(tmp_path, capsys):
    """Identical ranks, identical tables: rank 0's no longer holds the first clipping's phantom."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY_CONFIG, vocab_size=2048, num_hidden_layers=5)))
    code = plan.main(["--model", str(path), "--gpus", "2", "--gpu_memory_gib", "1", "--every_rank",
                      "--micro_batch_tokens=16", "--max_prompt_tokens=8", "--max_response_tokens=8",
                      "--logprob_micro_batch_tokens=16", "--outside_gib=0"])
    tables = phase_totals(capsys.readouterr().out)
    assert code == 0 and list(tables) == ["rank 0", "rank 1"]
    assert tables["rank 0"] == tables["rank 1"]


def test_update_and_generation_follow_the_flags():
    """A sequence longer than a micro-batch goes alone in one (rl.pack): the update row grows with
    --micro_batch_tokens and with --max_response_tokens; generation's prefill with the latter."""
    def plan_of(**flags):
        cfg = rl.Config(**dict(SMALL, logprob_micro_batch_tokens=64, **flags))
        return plan.plan_rank(config_of(num_hidden_layers=3), cfg, 0, 2, torch.bfloat16)
    base = plan_of(micro_batch_tokens=64, max_response_tokens=64)
    wider = plan_of(micro_batch_tokens=512, max_response_tokens=64)
    longer = plan_of(micro_batch_tokens=64, max_response_tokens=16384)
    assert base["update"]["activations"] < wider["update"]["activations"]
    assert base["update"]["activations"] < longer["update"]["activations"]
    assert base["generate"]["activations"] < longer["generate"]["activations"]
    assert wider["generate"] == base["generate"]


def test_generation_is_planned(monkeypatch):
    """The generate phase (the plan's and rl.make_engine's probe) runs a full-length prefill and the
    sampler over 256 rows beside the gathered weights, and with flash-attn keeps the decode graphs'
    outputs through every phase."""
    import rollout
    seen, real = [], rollout.sample
    monkeypatch.setattr(rollout, "sample",
                        lambda logits, *a: seen.append(logits.shape) or real(logits, *a))
    c, cfg = config_of(num_hidden_layers=3), rl.Config(**SMALL)
    flash = plan.plan_rank(c, cfg, 0, 2, torch.bfloat16)
    sdpa = plan.plan_rank(c, cfg, 0, 2, torch.bfloat16, flash=False)
    assert seen == [(256, 2048)] * 2
    logits = 4 * 256 * 2048           # the sampler's input alone, fp32
    for phases in (flash, sdpa):
        assert phases["generate"]["activations"] > logits
    graphs = 4 * 511 * 2048
    for name in ("old_logprob", "update", "optimizer"):
        assert flash[name]["total"] - sdpa[name]["total"] == graphs, name


def test_plan_fits_and_gives_the_kv_pool(tmp_path, capsys):
    code = plan.main(["--model", write_config(tmp_path), "--gpus", "2",
                      "--gpu_memory_gib", "1"] + small_flags())
    out = capsys.readouterr().out
    assert code == 0 and "fits" in out and "does not fit" not in out
    assert "tokens" in out and "full-length sequences" in out


def test_plan_says_what_does_not_fit(tmp_path, capsys):
    # 16 MiB x 0.9: less than the largest phase's peak beside the moments (about 20 MB)
    code = plan.main(["--model", write_config(tmp_path), "--gpus", "2",
                      "--gpu_memory_gib", str(16 / 1024)] + small_flags())
    out = capsys.readouterr().out
    assert code == 1 and "does NOT fit" in out
    assert re.search(r"does not fit: \w+ needs [\d.]+ GiB: no room for the KV pool", out)


def test_the_pool_is_what_rl_would_build():
    """The pool is utilization x the GPU less what torch does not hold (the CUDA context, NCCL's
    buffers: rollout.kv_budget subtracts them) less the largest peak; a pool short of one
    full-length sequence (512 tokens here) is named as the reason."""
    cfg, c = rl.Config(**dict(SMALL, max_response_tokens=448)), tiny_config()
    phases = plan.plan_rank(c, cfg, 0, 2, torch.bfloat16)
    usable = int(0.9 * 2**30) - max(p["total"] for p in phases.values())

    def pool(outside):
        lines, fits = plan.verdict(phases, c, cfg, 2**30, True, torch.bfloat16, outside)
        return int(re.search(r"= (\d+) tokens", "\n".join(lines)).group(1)), lines, fits
    whole, lines, fits = pool(0)
    assert fits and pool(1 << 28)[0] == whole - (1 << 28) // 1024   # 1 KiB of K/V a token
    tokens, lines, fits = pool(usable - 300 * 1024)                    # one block of 256
    assert tokens == 256 and not fits
    assert lines[-1].startswith("does not fit: the KV pool holds 256 tokens, less than one")
    assert plan.memory_plan.outside_torch(8) > plan.memory_plan.outside_torch(1) > 0


def test_kv_pool_tokens_is_the_engines(tiny_ckpt):
    from machinery import memory_plan as memory
    import rollout
    from model import Transformer
    model = Transformer.from_pretrained(tiny_ckpt)
    budget = 3 << 20
    engine = rollout.Engine(model, kv_cache_bytes=budget)
    tokens = memory.kv_pool_tokens(model.config, budget, torch.float32, flash=False)
    assert engine.num_blocks * engine.blocks.block_size == tokens


def test_update_reduce_scatters_every_micro_batch(monkeypatch):
    """The gradient is reduce-scattered after every micro-batch: none is held unsharded between
    them (the whole model's in fp32 on every rank), and the memory probe runs that same update."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from machinery import memory_plan as memory
    calls = []
    real = _fsdp_param_group.foreach_reduce
    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    cfg = rl.Config(**SMALL)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        model = plan.shard(tiny_config(), torch.float32)
        plan.materialize(model, cfg, fake=False)
        units = 1 + tiny_config().num_hidden_layers
        opt = memory.probe_optimizer(model, cfg)
        samples = [memory.dummy_sample(cfg.micro_batch_tokens, "cpu") for _ in range(2)]
        calls.clear()
        rl.update(model, opt, samples, 2 * cfg.micro_batch_tokens, 2, cfg, torch.device("cpu"), 2)
        assert len(calls) == 2 * units   # two micro-batches, each reduce-scattered
        # the memory probe (rl.make_engine's budget, plan.py's plan) runs that same update
        direct, seen, update = len(calls), [], rl.update

        def spy(*args, **kwargs):
            seen.append(len(calls))
            out = update(*args, **kwargs)
            seen.append(len(calls))
            return out
        monkeypatch.setattr(rl, "update", spy)
        memory.run_phases(model, opt, cfg, torch.device("cpu"), 2, lambda name: None, rl, False)
        assert seen[1] - seen[0] == direct
    finally:
        dist.destroy_process_group()


def test_generation_runs_without_fsdp_hooks(monkeypatch):
    """Inside rl.full_weights every weight is gathered: the rollout's forward calls no FSDP
    pre-forward (one per block per step otherwise, each running the root's set-up)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import rollout
    calls, real = [], FSDPParamGroup.pre_forward
    monkeypatch.setattr(FSDPParamGroup, "pre_forward",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        model = plan.shard(tiny_config(), torch.float32)
        plan.materialize(model, rl.Config(**SMALL), fake=False)
        model.eval()
        with rl.full_weights(model):
            rollout.generate(model, [[1, 2, 3]], 3, num_blocks=8)
        assert calls == []
        assert not model.bare_blocks
    finally:
        dist.destroy_process_group()


def test_plan_of_an_sft_step(tmp_path, capsys):
    code = plan.main(["--model", write_config(tmp_path), "--gpus", "2", "--gpu_memory_gib", "1",
                      "--sft", "--max_len=256", "--micro_batch_tokens=256", "--outside_gib=0"])
    out = capsys.readouterr().out
    assert code == 0 and "sft.py" in out and "update needs" in out and "generate" not in out
