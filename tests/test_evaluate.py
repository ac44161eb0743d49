"""evaluate.py: graders, metrics, tool statistics, the harness (resume, CLI), and an
end-to-end run on the tiny random checkpoint."""
import itertools
import json
import math
import os
import subprocess
import sys
import time
import types

import pytest

import evaluate
from evaluate import (extract_program, maj_at_k, normalize_math, pass_at_k, score, score_choice,
                      score_code, score_math)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH4 = os.path.join(ROOT, "data", "fixtures", "bench4.jsonl")


# ------------------------------------------------------------------- math grader


@pytest.mark.parametrize("response,answer,ok", [
    ("first \\boxed{5}, on second thought \\boxed{7}", "7", True),      # the last box counts
    ("first \\boxed{5}, on second thought \\boxed{7}", "5", False),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}", True),     # nested braces
    ("\\boxed{\\left(\\frac{1}{2}, 3\\right)}", "(\\frac{1}{2},3)", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True),                  # \dfrac -> \frac
    ("\\boxed{\\dfrac34}", "\\frac{3}{4}", True),                      # shorthand
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{10\\text{ cm}}", "10", True),                            # \text{} units
    ("\\boxed{10 \\text{cm}^2}", "10", True),
    ("\\boxed{12 \\text{ ways}}", "12", True),
    ("\\boxed{45^\\circ}", "45", True),
    ("\\boxed{\\text{Monday}}", "Monday", True),                       # text that is the answer
    ("\\boxed{033}", 33, True),                                        # zero padding
    ("\\boxed{ 3 \\sqrt{2} }", "3\\sqrt2", True),                       # spaces, \sqrt2
    ("\\boxed{5}<|im_end|>", "5", True),                               # end token ignored
    ("\\boxed{6}", "5", False),
    ("\\boxed{}", "", False),                                          # empty never matches
    ("the answer is 5", "5", False),                                   # no box
    ("\\boxed{5", "5", False),                                         # unterminated
    ("\\boxed{5} and so \\boxed{5", "5", False),                       # last box unterminated: no fallback
    ("\\boxed{5}" + " and some more words" * 10, "5", False),          # box not near the end
    ("<tool_response>\n\\boxed{5}\n</tool_response>\nI am done.", "5", False),  # box in tool output
    ("<tool_response>\n8\n</tool_response>\nSo \\boxed{8}.", "8", True),
])
def test_score_math(response, answer, ok):
    assert score_math(response, answer) is ok


@pytest.mark.parametrize("response", [
    "x" * 300_000,                          # 300 KB without a box
    "\\boxed{" * 50_000,                    # thousands of unterminated boxes
    "{" * 300_000 + "\\boxed{1",
    "```python\n" * 30_000,                 # fences without an end
    "</tool_response>" * 20_000 + "\\boxed{" + "{" * 100_000,
    None, 12345, b"\\boxed{1}",
])
def test_graders_never_raise_and_are_fast(response):
    t = time.time()
    assert score_math(response, "1") in (True, False)
    assert score_choice(response, "A") in (True, False)
    extract_program(response)
    assert score_code(response, {"fn_name": None, "cases": [{"input": "", "output": "1"}]}) == 0.0
    assert score({"kind": "math", "answer": "1"}, response) in (0.0, 1.0)
    assert time.time() - t < 5.0   # milliseconds when linear; a quadratic scan of 300 KB takes minutes


def test_score_never_raises_on_bad_problems():
    assert score({}, "\\boxed{1}") == 0.0
    assert score({"kind": "math"}, "\\boxed{1}") == 0.0
    assert score({"kind": "code", "tests": None}, "```python\nprint(1)\n```") == 0.0
    assert score_math("\\boxed{1}", None) is False


def test_normalize_math():
    assert normalize_math("\\$1,234.50") == "1234.50"
    assert normalize_math("50\\%") == "50"
    assert normalize_math("y=\\tfrac{2}{3}") == "\\frac{2}{3}"
    assert normalize_math("+007") == "7"


@pytest.mark.parametrize("response,letter,ok", [
    ("so \\boxed{B}", "B", True),
    ("so \\boxed{(B)}", "B", True),
    ("so \\boxed{\\text{B}}", "B", True),
    ("so \\boxed{B.}", "B", True),
    ("so \\boxed{B}", "C", False),
    ("so \\boxed{b}", "B", False),            # the prompt asks for the uppercase letter
    ("\\boxed{A} no wait \\boxed{D}", "D", True),
    ("the answer is B", "B", False),
])
def test_score_choice(response, letter, ok):
    assert score_choice(response, letter) is ok


def test_extract_program_takes_the_final_answers_last_block():
    r = ("<tool_call>\n{...}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
         "```python\nprint('from tool output')\n```\n</tool_response><|im_end|>\n"
         "<|im_start|>assistant\nDraft:\n```python\nprint(1)\n```\nFinal:\n```python\nprint(2)\n```\n")
    assert extract_program(r) == "print(2)\n"
    assert extract_program("```python\nprint(1)\n```\nthen ```python\nunfinished") == "print(1)\n"
    assert extract_program("<tool_response>```python\nx\n```</tool_response> no code") is None


# ------------------------------------------------------------------- code grader (sandbox)


def sandbox_ready():
    try:
        import sandbox
    except ImportError:
        return False
    return hasattr(sandbox, "submit")


needs_sandbox = pytest.mark.skipif(not sandbox_ready(), reason="no sandbox")

STDIN_TESTS = {"fn_name": None, "cases": [
    {"input": "1 2\n", "output": "3\n"}, {"input": "10 -3\n", "output": "7\n"},
    {"input": "0 0\n", "output": "0\n"}, {"input": "5 5\n", "output": "10\n"}]}


def fenced(code):
    return f"I tested it with the tool.\n```python\n{code}\n```"


@needs_sandbox
@pytest.mark.parametrize("code,expected", [
    ("a, b = map(int, input().split())\nprint(a + b)", 1.0),                 # correct
    ("a, b = map(int, input().split())\nprint(a - b)", 0.25),                # wrong (only 0 0)
    ("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", 0.5),  # partly right
    ("raise ValueError('boom')", 0.0),                                         # crashes
    ("while True:\n    pass", 0.0),                                            # never terminates
])
def test_score_code_stdin(code, expected):
    t = time.time()
    assert score_code(fenced(code), STDIN_TESTS, timeout=1.0) == pytest.approx(expected)
    assert time.time() - t < 15


FN_TESTS = {"fn_name": "addTwo", "cases": [
    {"input": "1\n2", "output": "3"}, {"input": "-1\n1", "output": "0"}, {"input": "[1]\n[2]", "output": "[1, 2]"}]}


@needs_sandbox
@pytest.mark.parametrize("code,expected", [
    ("class Solution:\n    def addTwo(self, a, b):\n        return a + b", 1.0),
    ("def addTwo(a, b):\n    return a + b", 1.0),                             # a bare function
    ("class Solution:\n    def addTwo(self, a, b):\n        return a * b if isinstance(a, int) else a + b", 1 / 3),
    ("class Solution:\n    def addTwo(self, a, b):\n        return None", 0.0),
    ("class Solution:\n    def addTwo(self, a, b):\n        return 1 / 0", 0.0),
    ("class Solution:\n    def addTwo(self, a, b):\n        while True: pass", 0.0),
])
def test_score_code_functional(code, expected):
    assert score_code(fenced(code), FN_TESTS, timeout=1.0) == pytest.approx(expected)


@needs_sandbox
def test_score_code_uses_the_final_answer_only():
    inside_tool = ("<tool_response>\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
                   "</tool_response>\nI give up.")
    assert score_code(inside_tool, STDIN_TESTS, timeout=1.0) == 0.0
    assert score({"kind": "code", "tests": STDIN_TESTS},
                 fenced("a, b = map(int, input().split())\nprint(a + b)")) == 1.0


# ------------------------------------------------------------------- metrics


def test_pass_at_k_against_closed_form_and_brute_force():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                closed = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    assert pass_at_k(32, 8, 1) == pytest.approx(8 / 32)
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)   # big n: no overflow
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_maj_at_k():
    assert maj_at_k(["1", "2", "2"], [True, False, False], 3) == 0.0
    assert maj_at_k(["1", "2", "1"], [True, False, True], 3) == 1.0
    assert maj_at_k(["1", "2", "2"], [True, False, False], 1) == 1.0      # first k only
    assert maj_at_k(["2", "1"], [False, True], 2) == 0.0                 # tie: first seen
    assert maj_at_k([None, None, "1"], [False, False, True], 3) == 1.0   # no answer, no vote
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def rec(uid, bench, si, correct, kind="math", pred=None, calls=(), turns=1, resp=10, sampled=10, before=0,
        finish="stop"):
    return {"uid": uid, "benchmark": bench, "sample_index": si, "kind": kind, "correct": correct,
            "score": float(correct), "pred": pred, "num_tool_calls": len(calls), "call_status": list(calls),
            "num_turns": turns, "response_tokens": resp, "sampled_tokens": sampled,
            "tokens_before_first_call": before, "finish_reason": finish}


def test_summarize_and_table():
    records = [
        rec("a:0", "aime24", 0, True, pred="5", calls=("ok", "error"), turns=3, resp=100, sampled=60, before=20),
        rec("a:0", "aime24", 1, False, pred="6"),
        rec("a:1", "aime24", 0, False, pred="7", finish="length"),
        rec("a:1", "aime24", 1, False, pred="7"),
        rec("c:0", "lcb", 0, True, kind="code", calls=("ok",), turns=2, resp=50, sampled=40, before=30),
        rec("c:0", "lcb", 1, True, kind="code"),
    ]
    s = evaluate.summarize(records)
    a = s["benchmarks"]["aime24"]
    assert a["problems"] == 2 and a["n"] == 2 and a["avg@2"] == 0.25
    assert a["pass@1"] == 0.25 and a["pass@2"] == 0.5 and a["maj@2"] == 0.5
    t = a["tools"]
    assert t["tool_calls_per_response"] == 0.5 and t["tool_call_success"] == 0.5
    assert t["tokens_before_first_call"] == 20 and t["tokens_per_call"] == 30
    assert t["turns"] == 1.5 and t["finish_reasons"] == {"length": 0.25, "stop": 0.75}
    c = s["benchmarks"]["lcb"]
    assert c["pass@1"] == 1.0 and "maj@2" not in c
    assert s["overall"]["avg@2"] == pytest.approx(0.625) and s["overall"]["headline"] == pytest.approx(0.625)
    table = evaluate.markdown_table(s, "tiny")
    lines = table.splitlines()
    assert lines[0] == "| | **MATH** | **Code** |"
    assert lines[2] == "| **Method** | **AIME2024** | **LiveCodeBench-v6** |"
    assert lines[4] == "| tiny | 25.0 | 100.0 |"


def test_grade_trajectory_token_counts():
    problem = {"uid": "x:0", "benchmark": "x", "kind": "math", "answer": "4"}
    traj = {"problem_index": 0, "sample_index": 0, "prompt_ids": [1], "response_ids": list(range(9)),
            "loss_mask": [1, 1, 1, 0, 0, 1, 1, 0, 1], "logprobs": [0.0] * 9, "text": "so \\boxed{4}",
            "tool_calls": [{"code": "1", "status": "ok", "output": ""},
                           {"code": "2", "status": "timeout", "output": ""}],
            "num_turns": 3, "finish_reason": "stop"}
    r = evaluate.grade_trajectory(problem, traj, evaluate.EvalConfig())
    assert r["correct"] and r["pred"] == "4" and r["score"] == 1.0
    assert (r["response_tokens"], r["sampled_tokens"], r["tokens_before_first_call"]) == (9, 6, 3)
    assert r["call_status"] == ["ok", "timeout"] and r["num_tool_calls"] == 2


def test_parse_config(capsys):
    c = evaluate.parse_config(["--n", "4", "--top-p=0.5", "--temperature", "0.7",
                               "--benchmarks=aime24", "--verl_metrics"])
    assert (c.n, c.top_p, c.temperature, c.benchmarks, c.verl_metrics) == (4, 0.5, 0.7, "aime24", True)
    with pytest.raises(SystemExit, match="unrecognized argument --nope=1"):
        evaluate.parse_config(["--nope=1"])
    with pytest.raises(SystemExit, match="invalid int value: 'many'"):
        evaluate.parse_config(["--n=many"])


def test_load_problems_limit_and_errors(tmp_path):
    cfg = evaluate.EvalConfig(data=BENCH4, limit=1)
    ps = evaluate.load_problems(cfg)
    assert [p["uid"] for p in ps] == ["toymath:0", "toychoice:0", "toycode:0"]   # first 1 per benchmark
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "kind": "math", "answer": "1"}\n{"prompt": "p", "kind": "poem"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl: line 2: field 'kind'"):
        evaluate.load_problems(evaluate.EvalConfig(data=str(bad)))
    with pytest.raises(SystemExit, match="prepare.py eval"):
        evaluate.load_problems(evaluate.EvalConfig(data_dir=str(tmp_path)))


# ------------------------------------------------------------------- harness with a stand-in rollout


def fake_rollout_module(calls):
    """Answers every math problem with \\boxed{42}, after one tool call."""
    from dataclasses import dataclass, asdict

    @dataclass
    class RolloutConfig:
        n: int = 1
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0
        max_prompt_tokens: int = 2560
        max_response_tokens: int = 20480
        max_turns: int = 16
        tool_output_chars: int = 256
        tool_timeout: float = 10.0
        tool_memory_mb: int = 1024
        max_parallel_calls: int = 1
        seed: int = None

    @dataclass
    class Trajectory:
        problem_index: int
        sample_index: int
        prompt_ids: list
        response_ids: list
        loss_mask: list
        logprobs: list
        text: str
        tool_calls: list
        num_turns: int
        finish_reason: str

        def to_dict(self):
            return asdict(self)

    def rollout(model, tokenizer, problems, config, sandbox=None, seeds=None, engine=None):
        assert seeds is not None and len(seeds) == len(problems) and engine == "the engine"
        calls.append([p["uid"] for p in problems])
        return [Trajectory(i, s, [1, 2], [5, 6, 7, 8], [1, 0, 0, 1], [0.0] * 4,
                           "<tool_call>x</tool_call><tool_response>\n1\n</tool_response>\\boxed{42}",
                           [{"code": "1", "status": "ok", "output": "1"}], 2, "stop")
                for i in range(len(problems)) for s in range(config.n)]

    m = types.ModuleType("rollout")
    m.RolloutConfig, m.Trajectory, m.rollout = RolloutConfig, Trajectory, rollout
    m.Engine = lambda model, **kwargs: "the engine"   # one for all batches
    return m


TOKENIZER = types.SimpleNamespace(decode=lambda ids, **kwargs: f"prompt {ids}")


def test_evaluate_resumes_from_its_trajectory_file(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "rollout", fake_rollout_module(calls))
    problems = [{"prompt": f"q{i}", "kind": "math", "answer": "42" if i % 2 == 0 else "1", "benchmark": "t"}
                for i in range(5)]
    cfg = evaluate.EvalConfig(n=3, problems_per_batch=2)
    out = str(tmp_path / "run")
    trajs, s = evaluate.evaluate(None, TOKENIZER, problems[:3], cfg, out_dir=out, progress=False)
    assert calls == [["t:0", "t:1"], ["t:2"]] and len(trajs) == 9
    # a torn last line (killed mid-write) and a half-finished problem are redone
    path = os.path.join(out, "trajectories.jsonl")
    lines = open(path).read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    trajs, s = evaluate.evaluate(None, TOKENIZER, problems, cfg, out_dir=out, progress=False)
    assert calls[2:] == [["t:2", "t:3"], ["t:4"]]
    b = s["benchmarks"]["t"]
    assert b["problems"] == 5 and b["samples"] == 15 and b["avg@3"] == pytest.approx(3 / 5)
    assert b["maj@3"] == pytest.approx(3 / 5) and b["tools"]["tokens_before_first_call"] == 1
    assert b["tools"]["tool_call_success"] == 1.0
    trajs, s2 = evaluate.evaluate(None, TOKENIZER, problems, cfg, out_dir=out, progress=False)
    assert len(calls) == 4 and s2["benchmarks"] == s["benchmarks"]       # nothing left to do


def test_a_changed_evaluation_names_what_changed():
    from machinery.eval_resume import differences
    saved = {"model": "a", "sampling": {"top_p": 0.6, "n": 4, "gone": 1}}
    assert differences(saved, {"model": "b", "sampling": {"top_p": 0.9, "n": 4}}) == \
        "model differ; sampling differ: top_p 0.6 -> 0.9, gone 1 -> None"
    # a setting the saved key has and the current one lacks is a difference too
    assert differences(saved, {"model": "a", "sampling": {"top_p": 0.6, "n": 4}}) == \
        "sampling differ: gone 1 -> None"


def test_model_aware_filtering_tags_difficulty(tmp_path, monkeypatch):
    """--filter_out: problem i is solved by the first solved[i] of n = 4 samples; the always and
    never solved go, the rest are tagged by pass rate, with a histogram beside them."""
    solved = [0, 1, 2, 3, 4]
    calls = []
    fake = fake_rollout_module(calls)

    def rollout(model, tokenizer, problems, config, sandbox=None, seeds=None, engine=None):
        calls.append(len(problems))
        return [fake.Trajectory(pi, si, [1], [2], [1], [0.0], "\\boxed{7}" if si < solved[int(p["prompt"][1:])] else
                                "\\boxed{8}", [], 1, "stop") for pi, p in enumerate(problems) for si in range(config.n)]

    fake.rollout = rollout
    monkeypatch.setitem(sys.modules, "rollout", fake)
    problems = [{"prompt": f"p{i}", "answer": "7", "kind": "math", "source": "t"} for i in range(5)]
    out = str(tmp_path / "f.jsonl")
    cfg = evaluate.EvalConfig(n=4, problems_per_batch=2, filter_out=out)
    records, _ = evaluate.evaluate(None, TOKENIZER, problems[:3], cfg, out_dir=str(tmp_path / "run"), progress=False)
    records, _ = evaluate.evaluate(None, TOKENIZER, problems, cfg, out_dir=str(tmp_path / "run"), progress=False)
    assert calls == [2, 1, 2]                                    # resumable: the second pass ran only the rest
    assert all("response_ids" not in json.loads(l) for l in open(tmp_path / "run" / "trajectories.jsonl"))
    hist = evaluate.write_filtered(problems, records, out)
    kept = [json.loads(l) for l in open(out)]
    assert [(r["prompt"], r["difficulty"], r["pass_rate"]) for r in kept] == \
        [("p1", "hard", 0.25), ("p2", "medium", 0.5), ("p3", "easy", 0.75)]
    assert hist["difficulty"] == {"easy": 1, "medium": 1, "hard": 1, "dropped_always_solved": 1,
                                  "dropped_never_solved": 1}
    assert json.load(open(out + ".hist.json"))["kept"] == 3


def test_verl_bootstrap_metrics():
    """verl's maj@k/mean and best@k/mean draw k of the n samples with replacement (1,000 times,
    seed 42), and an empty answer is a vote of its own; ours draw without replacement."""
    import numpy as np
    preds, corrects = [None, None, None, "7"], [False, False, False, True]
    maj, best = evaluate.verl_bootstrap(preds, corrects, 4)
    assert maj < 0.2                               # three empty answers outvote the right one
    assert maj_at_k(preds, corrects, 4) == 1.0     # ours: no answer, no vote
    # best@k/mean is the chance that k draws with replacement hit a correct sample, 1 - (3/4)^k
    assert best == pytest.approx(1 - 0.75 ** 4, abs=0.03) and pass_at_k(4, 1, 4) == 1.0
    # the same draws as verl's bootstrap_metric: np.random.seed(42), then np.random.choice per draw
    np.random.seed(42)
    draws = [np.random.choice(4, size=2, replace=True) for _ in range(1000)]
    assert evaluate.verl_bootstrap(preds, corrects, 2)[1] == pytest.approx(
        np.mean([max(corrects[i] for i in d) for d in draws]))
    recs = [rec("a:0", "aime24", i, c, pred=p) for i, (p, c) in enumerate(zip(preds, corrects))]
    s = evaluate.summarize(recs, [4], verl=True)["benchmarks"]["aime24"]
    assert s["verl_maj@4/mean"] == pytest.approx(maj) and s["verl_best@4/mean"] == pytest.approx(best)


def test_assert_style_and_system_records_are_accepted(tmp_path):
    rows = [{"prompt": "p", "kind": "code", "system": "You are a coder.", "tests": {
        "fn_name": None, "cases": [], "import_prefix": "import math\n", "entry_point": "Solution().f",
        "test_code": "def check(candidate):\n    assert candidate(1) == 2\n"}}]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert evaluate.load_jsonl(str(path))[0]["system"] == "You are a coder."
    path.write_text(json.dumps(dict(rows[0], tests={"fn_name": None, "cases": []})) + "\n")
    with pytest.raises(SystemExit, match="field 'tests'"):
        evaluate.load_jsonl(str(path))


# ------------------------------------------------------------------- end to end on the tiny checkpoint


def pipeline_ready():
    try:
        import data.tiny  # noqa: F401
        import model  # noqa: F401
        import rollout
    except ImportError:
        return False
    return hasattr(rollout, "rollout") and hasattr(rollout, "RolloutConfig") and sandbox_ready()


needs_pipeline = pytest.mark.skipif(not pipeline_ready(),
                                    reason="needs model.py, data/tiny.py, rollout.py and sandbox.py (issues 2-4)")


@needs_pipeline
def test_end_to_end_tiny_checkpoint(tiny_ckpt, tmp_path, capsys, one_rank_collectives):
    out = str(tmp_path / "eval")
    args = [f"--model={tiny_ckpt}", f"--data={BENCH4}", "--n=2", "--max_response_tokens=48",
            "--max_turns=2", f"--out={out}", "--tool_timeout=2", "--code_test_timeout=2"]
    evaluate.main(args)
    printed = capsys.readouterr().out
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["overall"]["problems"] == 4 and summary["overall"]["samples"] == 8
    assert summary["config"]["n"] == 2
    assert set(summary["benchmarks"]) == {"toymath", "toychoice", "toycode"}
    trajs = [json.loads(l) for l in open(os.path.join(out, "trajectories.jsonl"))]
    assert len(trajs) == 8 and all("response_ids" in t and "score" in t for t in trajs)
    assert "| **Method** |" in printed and "toymath" in printed
    # resuming with everything done runs no rollout and gives the same numbers
    evaluate.main(args)
    again = json.load(open(os.path.join(out, "summary.json")))
    assert again["benchmarks"] == summary["benchmarks"]
    assert one_rank_collectives == []


@needs_pipeline
def test_end_to_end_under_torchrun(tiny_ckpt, tmp_path):
    out = str(tmp_path / "eval")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "evaluate.py"), "--", f"--model={tiny_ckpt}", f"--data={BENCH4}", "--n=1",
           "--max_response_tokens=16", "--max_turns=1", f"--out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=240, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # the first rank's error sits above torchrun's traceback
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["overall"]["problems"] == 4
    counts = [len(open(os.path.join(out, f"trajectories.rank{r}.jsonl")).readlines()) for r in (0, 1)]
    assert counts == [2, 2]


def test_a_sandbox_that_cannot_start_stops_the_evaluation(monkeypatch):
    import sandbox
    told = []
    monkeypatch.setattr(sandbox, "configure", lambda workers, require: told.append((workers, require)))
    monkeypatch.setattr(sandbox, "check", lambda: (_ for _ in ()).throw(RuntimeError("sandbox: no seccomp here")))
    with pytest.raises(SystemExit, match="rank 0: sandbox: no seccomp here"):
        evaluate.main(["--model=unused", f"--data={os.path.join(ROOT, 'data', 'fixtures', 'bench4.jsonl')}",
                       "--sandbox_workers=2"])
    assert told == [(2, "default")]
