"""Shared fixtures: the tiny offline checkpoint, built once per test session."""
import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from data.tiny import build_tiny_checkpoint
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_ckpt)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "gather", "gather_object", "reduce",
               "reduce_scatter_tensor", "scatter", "scatter_object_list")


def spy_collectives(mp, calls):
    """Every torch.distributed collective called while the process group has one rank goes into calls (and
    still runs). A one-process run must call none: after one gloo collective, even over a single rank, small
    CPU ops stay 2-3x slower for the rest of the process (the toy run ~9% slower end to end)."""
    import torch.distributed as dist
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            if dist.is_initialized() and dist.get_world_size() == 1:
                calls.append(_name)
            return _real(*args, **kwargs)
        mp.setattr(dist, name, spy)


@pytest.fixture
def one_rank_collectives(monkeypatch):
    calls = []
    spy_collectives(monkeypatch, calls)
    return calls
