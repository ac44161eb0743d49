"""scripts/plan.py and machinery/memory_plan.py: the memory plan run on fake tensors against the same step on real
CPU tensors (the same tracker), its verdict and exit status, and update's gradient sync pattern."""
import json
import os
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
             max_response_tokens=448)


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
    return [f"--{k}={v}" for k, v in SMALL.items()]


def test_plan_fits_and_gives_the_kv_pool(tmp_path, capsys):
    code = plan.main(["--model", write_config(tmp_path), "--gpus", "2",
                      "--gpu_memory_gib", "1"] + small_flags())
    out = capsys.readouterr().out
    assert code == 0 and "fits" in out and "does not fit" not in out
    assert "tokens" in out and "full-length sequences" in out


def test_plan_says_what_does_not_fit(tmp_path, capsys):
    # 16 MiB x 0.9: less than the log-prob pass's peak beside the moments (about 20 MB)
    code = plan.main(["--model", write_config(tmp_path), "--gpus", "2",
                      "--gpu_memory_gib", str(16 / 1024)] + small_flags())
    out = capsys.readouterr().out
    assert code == 1 and "does not fit: old_logprob needs" in out and "does NOT fit" in out


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
        memory.run_phases(model, opt, cfg, torch.device("cpu"), 2, lambda name: None, rl)
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
                      "--sft", "--max_len=256", "--micro_batch_tokens=256"])
    out = capsys.readouterr().out
    assert code == 0 and "sft.py" in out and "update needs" in out and "generate" not in out
