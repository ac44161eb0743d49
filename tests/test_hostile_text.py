"""Hostile model text through every stage that reads it: the rollout's tool-call parsing and the
agent loop's reply, rl.py's grading and reward, the kept trajectories and their reading back, the
viewer's page, evaluate.py's scoring and records. Each stage takes every text of a fuzzed corpus
(deep nesting, huge numbers, lone surrogates, NUL bytes, unclosed tags, megabyte lines, mixes) and
ends normally: a malformed call gets an error reply, a response with no parseable program the
rules' reward, and nothing raises. Sandbox runs are answered by a box that sends hostile output
back after the grader's own marker."""
import gzip
import json
import math
import pickle
import random
import re
from concurrent.futures import Future

import pytest

import evaluate
import rl
import rollout
import sandbox
from machinery import code_grading, run_log
from rollout import RolloutConfig, Trajectory
from scripts import view
from test_code_grading import nested

PY = "Done.\n```python\n{}\n```\n"


def call(body):
    return "<tool_call>\n" + body + "\n</tool_call>"


def with_args(inner):
    return call('{"name": "code_interpreter", "arguments": ' + inner + "}")


def deep(n):
    return "[" * n + "]" * n


def corpus():
    shapes = {
        "deep brackets": "(" * 5000 + "[" * 5000 + "{" * 5000,
        "a call nested past the stack": call(deep(100_000)),
        "a call nested under the stack": with_args('{"code": "1", "x": ' + deep(900) + "}"),
        "arguments as a string nested deep": with_args(json.dumps(deep(900))),
        "a 5,000-digit integer": with_args('{"code": ' + "9" * 5000 + "}"),
        "1e999, NaN, -Infinity": with_args('{"code": "1", "a": 1e999, "b": NaN, "c": -Infinity}'),
        "a lone surrogate in the code": with_args('{"code": "print(\'\\ud800\')"}'),
        "a lone surrogate as the name": call('{"name": "\\udc00", "arguments": {}}'),
        "lone surrogates in the text": "so \ud800 then " + with_args('{"code": "1"}') + " \udfff",
        "NUL bytes": "\0" * 10 + with_args('{"code": "print(1)\\u0000"}') + PY.format("x = 1\0"),
        "unclosed tags": "<tool_call>" * 20_000 + "<tool_response>" * 10 + "\\boxed{" * 100
                         + "```python\n",
        "closed malformed calls": "<tool_call>x</tool_call>" * 5000,
        "a megabyte line": "x" * (1 << 20),
        "a megabyte program of +1": PY.format("1" + "+1" * 500_000),
        "a program of 5,000 +1": PY.format("1" + "+1" * 5000),
        "a program of not": PY.format("not " * 50_000 + "1"),
        "a program of minus": PY.format("-" * 3000 + "1"),
        "end tokens": "\\boxed{3}" + "<|im_end|>" * 100_000,
        "a reply left open": "<tool_response>" + "<tool_call>" * 1000,
    }
    rng, pieces = random.Random(0), list(shapes.values())
    for i in range(8):
        cuts = [rng.choice(pieces)[:rng.randint(0, 50_000)] for _ in range(6)]
        shapes[f"mixed {i}"] = "".join(cuts)
    return shapes


CORPUS = corpus()
MARKER = re.compile(r"@@sandbox-[a-z]+-[0-9a-f]{16}@@")


def grading_outputs():
    """What a run may print after the marker the grader looks for."""
    same_hash = code_grading._encode({k * (2 ** 61 - 1) for k in range(3000)}, set())
    return [code_grading._encode(nested(5000), set()), same_hash, "[" + "[]," * 300_000 + "[]]",
            "[" * 100_000, "1 " * 300_000, "x\tvalue\t" + same_hash, "need 0 " + "[" * 1000,
            "\ud800\0", "pass\n" * 1000, "3"]


class HostileBox:
    """submit() -> a Future of a Result: a tool run echoes its code; a grading run prints, after
    the grader's marker (or alone, for a stdin program), the next of grading_outputs()."""

    def __init__(self):
        self.outputs, self.at = grading_outputs(), 0

    def submit(self, code, timeout=10.0, memory_mb=1024, stdin="", output_limit=None):
        future, marker = Future(), MARKER.search(code)
        if output_limit is None:                                       # the code tool
            future.set_result(sandbox.Result("ok", stdout=code[:300], returncode=0))
            return future
        self.at += 1
        said = self.outputs[self.at % len(self.outputs)]
        stdout = "noise\n" + marker.group(0) + said if marker else said
        future.set_result(sandbox.Result("ok", stdout=stdout, returncode=0))
        return future


def trajectories():
    """A trajectory per text of the corpus, and per text with a good final program after it."""
    good = PY.format("def f(x):\n    return x")
    out = []
    for i, text in enumerate(list(CORPUS.values()) + [t + good for t in CORPUS.values()]):
        calls = [{"name": name, "arguments": args, "status": "bad_call" if why else "ok",
                  "output": why or "1", "turn": 0}
                 for name, args, why in rollout.parse_tool_calls(text)]
        out.append(Trajectory(i % 5, i // 5, [1, 2], [3] * 50, [1] * 50, [-0.5] * 50, text, calls,
                              1, "stop"))
    return out


ASSERTS = {"fn_name": None, "cases": [], "entry_point": "f",
           "import_prefix": "def g(x):\n    return x\n",
           "test_code": "def check(candidate):\n    assert candidate(1) == 1\n"
                        "    assert g(candidate(2)) == 2\n"
                        "    assert candidate(candidate(3)) == 3\n"}
PROBLEMS = [
    {"kind": "math", "prompt": "p", "answer": "3"},
    {"kind": "choice", "prompt": "p", "answer": "B"},
    {"kind": "code", "prompt": "p",
     "tests": {"fn_name": None, "cases": [{"input": "", "output": "3"}] * 3}},
    {"kind": "code", "prompt": "p",
     "tests": {"fn_name": "f", "cases": [{"input": "1", "output": "1"}] * 3}},
    {"kind": "code", "prompt": "p", "tests": ASSERTS},
]


@pytest.fixture
def hostile_box(monkeypatch):
    box = HostileBox()
    monkeypatch.setattr(sandbox, "default_sandbox", lambda: box)
    monkeypatch.setattr(sandbox, "submit", box.submit)
    return box


def test_tool_calls_parse_and_get_replies(tiny_tokenizer):
    """parse_tool_calls never raises, keeps only arguments any later stage can copy and write, and
    answers at most max_calls malformed blocks; the agent loop's reply to them renders."""
    chat = rollout.chat_format(tiny_tokenizer, RolloutConfig())
    loop = rollout.AgentLoop(None, chat, RolloutConfig(max_parallel_calls=2), sandbox=HostileBox())
    turn = type("Agent", (), {"num_turns": 1})()
    for name, text in CORPUS.items():
        calls = rollout.parse_tool_calls(text, max_calls=2)
        assert len(calls) <= 2 + 2 + 1, name                   # parsed, malformed, left open
        for call_name, args, refusal in calls:
            assert (refusal is None) == (call_name is not None), name
            json.loads(json.dumps(args))                        # within depth and writable
            pickle.loads(pickle.dumps(args))
        pending = [loop._dispatch(turn, *c) for c in calls]
        replies = [rollout.call_outcome(refusal, future)[1] for _, refusal, future in pending]
        assert all(isinstance(r, str) and r.encode("utf-8") for r in replies), name
        assert all(isinstance(i, int) for i in chat.forced_ids("tool", replies)), name
    deep_call = rollout.parse_tool_calls(CORPUS["a call nested under the stack"])
    assert deep_call[0][0] is None and "nested deeper" in deep_call[0][2]
    huge = rollout.parse_tool_calls(CORPUS["a 5,000-digit integer"])
    assert huge[0][0] is None and "JSON" in huge[0][2]


def test_the_agent_loop_answers_hostile_turns_and_ends(tiny_tokenizer, tiny_ckpt):
    """The real loop (a scripted policy samples each turn's tokens): every hostile call gets its
    reply, and every trajectory ends as the rules say."""
    from model import Transformer
    from scripts.bench_rollout import ScriptedModel
    tok, config = tiny_tokenizer, RolloutConfig(max_turns=6, max_response_tokens=3000)
    chat = rollout.chat_format(tok, config)
    turns = [with_args('{"code": "1", "x": ' + deep(80) + "}"),
             call('{"name": "\\ud800", "arguments": {"code": "print(\'\\udfff\\u0000\')"}}'),
             with_args('{"code": "print(1)", "n": 1e999, "m": NaN}'),
             with_args('{"code": "print(\'\\ud800\')"}'),
             "<tool_call>x</tool_call>" * 30 + "<tool_call>" * 30, "\\boxed{3}"]
    script = [i for t in turns
              for i in tok.encode(t, add_special_tokens=False) + [chat.end_of_turn]]

    def next_token(seq):
        return script[sum(seq.mask)] if sum(seq.mask) < len(script) else chat.end_of_turn
    policy = ScriptedModel(Transformer.from_pretrained(tiny_ckpt).config, next_token)
    engine = rollout.Engine(policy, max_seq_lens=[3500])
    traj, = rollout.rollout(policy, tok, [{"prompt": "p"}], config, sandbox=HostileBox(),
                            engine=engine)
    calls = traj.tool_calls
    assert traj.finish_reason == "stop" and traj.num_turns == 6
    assert [c["status"] for c in calls] == ["bad_call", "bad_call", "ok", "ok"] + ["bad_call"] * 2
    assert "nested deeper" in calls[0]["output"] and "closed" in calls[5]["output"]
    assert "\\udfff" in calls[1]["output"] or "\\ud800" in calls[1]["output"]
    assert "print('\\ud800')" in calls[3]["output"]   # a lone surrogate replied as its escape


def test_grading_and_reward(hostile_box):
    """rl.grade scores every trajectory, whatever its text and whatever its runs print; a response
    whose final program does not parse gets the rules' reward for no program."""
    cfg, trajs = rl.Config(), trajectories()
    samples = rl.grade(PROBLEMS, trajs, cfg)
    assert len(samples) == len(trajs) and hostile_box.at > 0
    for s, t in zip(samples, trajs):
        assert 0.0 <= s["score"] <= 1.0 and math.isfinite(s["reward"])
    unparsed = {"a program of 5,000 +1", "a program of not", "a program of minus",
                "a megabyte program of +1"}
    for i, name in enumerate(CORPUS):
        if name in unparsed and PROBLEMS[i % 5]["kind"] == "code":
            assert not rl.has_program(trajs[i].text), name
            want = rl.shape_reward(-1.0, rl.tool_turns(trajs[i].tool_calls), 50, cfg)
            assert samples[i]["reward"] == want, name


def records(trajs, samples):
    """rl.keep_trajectories's records."""
    return [dict(t.to_dict(), step=1, problem_index=t.problem_index, uid=str(t.problem_index),
                 kind=PROBLEMS[t.problem_index]["kind"], source="hostile", prompt="p",
                 reward=s["reward"], advantage=0.5, score=s["score"], correct=s["correct"],
                 logprobs=t.logprobs, trainer_logprobs=t.logprobs) for t, s in zip(trajs, samples)]


def test_kept_trajectories_read_back_and_the_viewer_builds_a_page(hostile_box, tmp_path, tiny_ckpt):
    trajs = trajectories()
    kept = records(trajs, rl.grade(PROBLEMS, trajs, rl.Config()))
    pickle.loads(pickle.dumps(kept))                            # what all_gather_list sends
    run_log.write_trajectories(str(tmp_path), 1, kept)
    with gzip.open(tmp_path / "trajectories" / "step_000001.jsonl.gz", "rt", encoding="utf-8") as f:
        back = [json.loads(line) for line in f]
    order = sorted(kept, key=lambda r: (r["problem_index"], r["sample_index"]))
    assert [json.dumps(r) for r in back] == [json.dumps(r) for r in order]   # surrogates and all
    page = tmp_path / "view.html"
    view.main([str(tmp_path), "--out", str(page), "--tokenizer", tiny_ckpt])
    text = page.read_text(encoding="utf-8")
    scripts = re.findall(r'<script type="application/json" id="[^"]+">(.*?)</script>', text, re.S)
    assert len(scripts) == len(kept)

    def refuse(name):                                           # JSON.parse takes no NaN
        raise ValueError(name)
    for script in scripts:
        json.loads(script, parse_constant=refuse)


def test_evaluate_scores_and_writes_records(hostile_box, tmp_path):
    """evaluate.py's grading of each trajectory, its records written and read back (a resume),
    and the summary."""
    trajs = trajectories()
    problems = evaluate.with_uids(PROBLEMS, "hostile")
    cfg = evaluate.EvalConfig(n=1)
    graded = [evaluate.grade_trajectory(problems[t.problem_index],
                                        dict(t.to_dict(), prompt="p"), cfg) for t in trajs]
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in graded), encoding="utf-8")
    done = evaluate.read_done([str(path)], 1)
    assert set(done) == {p["uid"] for p in problems}
    summary = evaluate.summarize([evaluate.light(r) for r in graded])
    assert evaluate.markdown_table(summary) and json.dumps(summary)
    preds = [evaluate.extract_pred(p, t.text) for p in problems for t in trajs]
    assert all(pred is None or isinstance(pred, str) for pred in preds)
