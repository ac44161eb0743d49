"""data/toy.py: disjoint splits, correct answers, SFT trajectories in the chat format with real tool output."""
import json
import os

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
        toy.make_problems(10_000, "train", digits=2)


@pytest.mark.parametrize("digits", [2, 3, 4])
def test_every_number_of_a_kind_has_a_fixed_width(digits):
    # fixed widths keep every copy the task needs at a fixed token distance (see make_problem)
    import random, re
    rng = random.Random(digits)
    for kind in toy.KINDS:
        problems = [toy.make_problem(rng, kind, digits) for _ in range(500)]
        shapes = {(tuple(len(n) for n in re.findall(r"\d+", p["prompt"].split("?")[0])), len(str(p["answer"])))
                  for p in problems}
        assert len(shapes) == 1, (kind, shapes)


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


# ----------------------------------------------------------------------------- the pipeline, fast
# The learning claim is measured by the full `python rl.py` (README, Results); here every stage
# runs a few steps on tens of problems and leaves its files.

@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)       # the toy presets write under ./runs/toy
    return tmp_path


def test_sft_toy_stage_writes_a_checkpoint(in_tmp):
    import sft
    toy.build(toy.DATA, n_sft=24, n_train=8, n_heldout=8)   # small: sft.py reuses it
    final = sft.train(sft.parse_args(["--preset=toy", "--max_steps=2", "--batch_size=4", "--eval_size=4",
                                      "--progress=false"]))
    assert (os.path.exists(os.path.join(final, "config.json"))
            and os.path.exists(os.path.join(final, "model.safetensors")))
    rows = [json.loads(l) for l in open("runs/toy/sft/metrics.jsonl")]
    assert any(r.get("step") == 2 and "loss" in r for r in rows)
    assert toy.sft_start() == os.path.join(toy.ROOT, "sft", "final")   # rl.py now starts from this run


def test_rl_toy_pipeline_from_the_shipped_start(in_tmp, capsys):
    import evaluate
    import rl
    summary = rl.train(rl.parse_args(["--preset=toy", "--steps=1", "--prompts_per_step=2", "--samples_per_prompt=2",
                                      "--mini_batch_prompts=2", "--eval_limit=12", "--save_every=1"]))
    out = "runs/toy/rl"
    for name in ("metrics.jsonl", "summary.json", "final/config.json"):
        assert os.path.exists(os.path.join(out, name)), name
    assert summary["config"]["model"] == toy.SHIPPED_SFT
    before, after = summary["before"], summary["after"]
    assert 0.0 <= before["accuracy"] <= 1.0 and 0.0 <= after["accuracy"] <= 1.0
    # the SFT start already speaks the protocol: it calls the tool (about every other answer;
    # the rest are guesses) and the calls parse and run
    assert before["tool_calls_per_response"] > 0 and before["tool_call_success"] >= 0.5, before
    assert "held-out accuracy" in capsys.readouterr().out
    # `python evaluate.py` alone evaluates the newest toy policy: now the RL checkpoint
    assert evaluate.toy_policy() == os.path.join(out, "final")


def test_evaluate_without_arguments_starts_from_the_shipped_policy(in_tmp):
    import evaluate
    assert evaluate.toy_policy() == toy.SHIPPED_SFT
    cfg = evaluate.parse_config(["--preset=toy"])
    assert (cfg.model, cfg.data, cfg.n, cfg.top_p) == ("toy", toy.HELDOUT, 1, 0.6)
