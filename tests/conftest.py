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
