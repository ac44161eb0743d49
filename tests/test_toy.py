"""data/toy.py: disjoint splits, correct answers, SFT trajectories in the chat format with real tool output."""
import pytest

from data import toy
from evaluate import score_math


def test_splits_are_disjoint_and_answers_right():
    train, held = toy.make_problems(3000, "train", seed=1), toy.make_problems(200, "heldout")
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}
    assert all(toy.is_heldout(p) for p in held) and not any(toy.is_heldout(p) for p in train)
    for p in train[:30] + held[:30]:
        assert eval(p["code"][len("print("):-1]) == p["answer"]  # the code is a print of one expression
    with pytest.raises(ValueError, match="distinct"):
        toy.make_problems(10_000, "train", digits=1)


def test_sft_records_mix_styles_and_hold_real_tool_output():
    problems = toy.make_problems(12, "train", seed=2)
    records = toy.make_sft_records(problems, seed=0, mix=(1, 1, 1))
    assert {r["style"] for r in records} == {"tool", "guess", "retry"}
    for p, r in zip(problems, records):
        final = r["messages"][-1]["content"]
        tools = [m for m in r["messages"] if m["role"] == "tool"]
        if r["style"] == "guess":
            assert not tools and not score_math(final, p["answer"])
        else:
            assert tools[-1]["content"].strip() == str(p["answer"]) and score_math(final, p["answer"])
        if r["style"] == "retry":
            assert "Error" in tools[0]["content"]
