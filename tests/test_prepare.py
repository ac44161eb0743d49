"""data/prepare.py and data/prompts.py: converters on the hand-written upstream fixtures,
malformed rows, the restricted unpickler, parquet (when pyarrow is installed), filtering."""
import base64
import json
import os
import pickle
import sys
import types
import zlib

import pytest

from data import prepare, prompts

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "fixtures")


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def quiet(*a):
    pass


# ------------------------------------------------------------------- SFT


def test_sft_fixture(tmp_path):
    path = prepare.prepare_sft(os.path.join(FIX, "sft"), str(tmp_path), report=quiet)
    rows = read(path)
    assert len(rows) == 2
    first = rows[0]
    assert [m["role"] for m in first["messages"]] == ["user", "assistant", "tool", "assistant"]
    call = first["messages"][1]["tool_calls"][0]
    # JSON-text arguments become a dict; ids are kept; nulls from the struct schema are gone
    assert call == {"type": "function", "id": "call_0",
                    "function": {"name": "code_interpreter", "arguments": {"code": "print(17 * 23)"}}}
    assert "tool_calls" not in first["messages"][0] and "name" not in first["messages"][0]
    assert first["messages"][2]["name"] == "code_interpreter"
    assert first["tools"][0]["function"]["name"] == "code_interpreter"   # parsed from JSON text
    second = rows[1]
    assert second["messages"][2]["content"] == ""                      # content null -> ""
    assert second["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"code": "sum(range(1, 20, 2))"}
    props = second["tools"][0]["function"]["parameters"]["properties"]
    assert set(props) == {"code"}                                        # the null 'timeout' key dropped


# ------------------------------------------------------------------- RL


def test_rl_fixture(tmp_path):
    lines = []
    path = prepare.prepare_rl(os.path.join(FIX, "rl"), str(tmp_path), report=lines.append)
    rows = read(path)
    assert any("skipped 1 rows: assert-style" in l for l in lines)
    by_source = {r["source"]: r for r in rows}
    dapo = by_source["math_dapo"]
    assert dapo["kind"] == "math" and dapo["answer"] == "9" and dapo["id"] == "a1b2"
    assert dapo["prompt"].startswith("Solve step by step") and dapo["prompt"].endswith(prompts.UNITS_SUFFIX)
    assert by_source["mega-science"]["answer"] == "2"
    sky = by_source["skywork_math"]
    assert sky["answer"] == "1024"                                   # one-element list unwrapped
    assert "Be careful." in sky["prompt"] and "What is 2^10?" in sky["prompt"]   # system kept
    assert "\\boxed" in sky["prompt"]                                 # wrapped in the math template
    taco = by_source["codegen/taco"]
    assert taco["kind"] == "code" and taco["answer"] is None
    assert taco["tests"] == {"fn_name": None, "cases": [{"input": "1 2\n", "output": "3\n"},
                                                        {"input": "10 -3\n", "output": "7\n"}]}
    assert taco["prompt"].endswith(prompts.CODE_SUFFIX)
    fn = by_source["codegen/leetcode"]["tests"]
    # argument lists -> one JSON argument per line; return values as JSON
    assert fn == {"fn_name": "add", "cases": [{"input": "1\n2", "output": "3"},
                                              {"input": "[1]\n[2]", "output": "[1, 2]"}]}


# ------------------------------------------------------------------- eval


def test_eval_fixture(tmp_path):
    paths = prepare.prepare_eval(os.path.join(FIX, "eval"), str(tmp_path), report=quiet)
    assert sorted(paths) == ["aime24", "aime25", "gpqa", "lcb"]
    aime24 = read(paths["aime24"])
    assert [r["answer"] for r in aime24] == [2, 33]                 # ints, "033" unpadded
    assert all(r["kind"] == "math" and r["benchmark"] == "aime24" for r in aime24)
    assert "Find the remainder" in aime24[0]["prompt"] and "\\boxed" in aime24[0]["prompt"]
    assert read(paths["aime25"])[0]["answer"] == 14
    gpqa = read(paths["gpqa"])
    assert [r["answer"] for r in gpqa] == ["B", "C"]
    assert "Physics" in gpqa[0]["prompt"] and "(B) photon" in gpqa[0]["prompt"]
    assert "uppercase letter" in gpqa[0]["prompt"]
    lcb = read(paths["lcb"])
    assert lcb[0]["tests"] == {"fn_name": None, "cases": [{"input": "3\n", "output": "6\n"},
                                                          {"input": "5\n", "output": "10\n"}]}
    assert lcb[1]["tests"]["fn_name"] == "longestRun"
    assert lcb[1]["tests"]["cases"][0] == {"input": '"aab"', "output": "2"}   # text kept as is
    assert "def longestRun" in lcb[1]["prompt"]                                  # starter code shown


def test_raw_livecodebench(tmp_path):
    paths = prepare.prepare_eval(os.path.join(FIX, "lcb_raw"), str(tmp_path), report=quiet)
    rows = read(paths["lcb"])
    assert rows[0]["id"] == "abc400_a" and rows[0]["source"] == "livecodebench/atcoder"
    # public + base64/zlib/pickle private tests
    assert rows[0]["tests"] == {"fn_name": None, "cases": [
        {"input": "3\n", "output": "6\n"}, {"input": "7\n", "output": "14\n"}, {"input": "0\n", "output": "0\n"}]}
    assert rows[1]["tests"] == {"fn_name": "addTwo", "cases": [
        {"input": "1\n2", "output": "3"}, {"input": "-1\n1", "output": "0"}]}
    assert "standard input" in rows[0]["prompt"] and "class Solution" in rows[1]["prompt"]


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def blob(obj):
    return base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()


def test_restricted_unpickler_refuses_objects(capsys):
    with pytest.raises(prepare.DataError, match="refused to load builtins.print"):
        prepare.decode_lcb_tests(blob([Evil()]), "f.jsonl: row 3", "private_test_cases")
    assert "must never run" not in capsys.readouterr().out
    # plain data straight in the pickle (no JSON text) is fine; other types are not
    assert prepare.decode_lcb_tests(blob([{"input": "1", "output": "2"}]), "w", "f") == [{"input": "1", "output": "2"}]
    with pytest.raises(prepare.DataError, match="only plain data"):
        prepare.decode_lcb_tests(blob([{"input": (1, 2)}]), "w", "f")
    with pytest.raises(prepare.DataError, match="neither JSON nor base64"):
        prepare.decode_lcb_tests("%%% not base64 %%%", "w", "private_test_cases")


# ------------------------------------------------------------------- malformed rows


def write_rows(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


GOOD_RL = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "1+1?"}],
           "ability": "MATH", "reward_model": {"ground_truth": "2"}}


@pytest.mark.parametrize("bad,field", [
    ({k: v for k, v in GOOD_RL.items() if k != "reward_model"}, "reward_model"),
    (dict(GOOD_RL, prompt=[{"role": "system", "content": "x"}]), "prompt"),
    (dict(GOOD_RL, reward_model={"ground_truth": ""}), "reward_model.ground_truth"),
    (dict(GOOD_RL, data_source="code", reward_model={"ground_truth": json.dumps({"inputs": ["1"], "outputs": []})}),
     "reward_model.ground_truth"),
    (dict(GOOD_RL, reward_model="{not json"), "reward_model"),
])
def test_malformed_rl_row_names_file_row_and_field(tmp_path, bad, field):
    path = write_rows(tmp_path / "rl.jsonl", [GOOD_RL, bad])
    with pytest.raises(SystemExit) as e:
        prepare.prepare_rl(path, str(tmp_path / "out"), report=quiet)
    msg = str(e.value)
    assert msg.startswith(f"{path}: row 2: field '{field}'"), msg
    assert not os.path.exists(tmp_path / "out" / "rl.jsonl")     # nothing half-written


def test_malformed_eval_and_sft_rows(tmp_path):
    d = tmp_path / "aime2025"
    d.mkdir()
    path = write_rows(d / "x.jsonl", [{"problem": "p", "answer": "12"}, {"problem": "q", "answer": "twelve"}])
    with pytest.raises(SystemExit, match=r"row 2: field 'answer': AIME answer 'twelve' is not an integer"):
        prepare.prepare_eval(str(tmp_path), str(tmp_path / "out"), report=quiet)
    path = write_rows(tmp_path / "s.jsonl", ['{"messages": [}'])
    with pytest.raises(SystemExit, match=r"s.jsonl: row 1: not JSON"):
        prepare.prepare_sft(path, str(tmp_path / "out"), report=quiet)
    path = write_rows(tmp_path / "s2.jsonl", [{"messages": [{"role": "robot", "content": "hi"}], "tools": []}])
    with pytest.raises(SystemExit, match=r"row 1: field 'messages\[0\].role'"):
        prepare.prepare_sft(path, str(tmp_path / "out"), report=quiet)
    bad_gpqa = tmp_path / "gpqa"
    bad_gpqa.mkdir()
    write_rows(bad_gpqa / "g.jsonl", [{"problem": "p", "solution": "maybe"}])
    with pytest.raises(SystemExit, match=r"row 1: field 'solution': 'maybe' is not an option letter"):
        prepare.prepare_eval(str(bad_gpqa), str(tmp_path / "out"), report=quiet)


def test_raw_gpqa_shuffle_is_deterministic():
    row = {"Question": "Which is a noble gas?", "Correct Answer": "Neon", "Incorrect Answer 1": "Iron",
           "Incorrect Answer 2": "Carbon", "Incorrect Answer 3": "Sodium", "High-level domain": "Chemistry"}
    a = prepare.convert_gpqa_row(row, "w", "gpqa")
    b = prepare.convert_gpqa_row(dict(row), "w", "gpqa")
    assert a == b and a["kind"] == "choice"
    assert f"({a['answer']}) Neon" in a["prompt"]


def test_hub_failure_is_one_clear_line(monkeypatch):
    fake = types.ModuleType("huggingface_hub")

    def snapshot_download(**kw):
        raise ConnectionError("no network here")
    fake.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    with pytest.raises(SystemExit, match=r"could not download Gen-Verse/Open-AgentRL-30K .*--source DIR"):
        prepare.resolve_files("Gen-Verse/Open-AgentRL-30K")


# ------------------------------------------------------------------- parquet (optional)


def test_parquet_matches_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = read(os.path.join(FIX, "rl", "open_agentrl_30k_rows.jsonl"))
    # one schema for all rows, as the upstream file has: extra_info.index as string
    for r in rows:
        r["extra_info"] = {"index": str(r["extra_info"]["index"]), "split": r["extra_info"].get("split")}
        gt = r["reward_model"]["ground_truth"]
        r["reward_model"]["ground_truth"] = gt if isinstance(gt, str) else json.dumps(gt)
    (tmp_path / "pq").mkdir()
    (tmp_path / "js").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "pq" / "train.parquet"))
    write_rows(tmp_path / "js" / "train.jsonl", rows)
    a = read(prepare.prepare_rl(str(tmp_path / "pq"), str(tmp_path / "a"), report=quiet))
    b = read(prepare.prepare_rl(str(tmp_path / "js"), str(tmp_path / "b"), report=quiet))
    assert a == b and len(a) == 5


# ------------------------------------------------------------------- prompts


def test_prompts_give_the_papers_instructions():
    m = prompts.math_prompt("What is 1+1?")
    assert "step by step" in m and "tool" in m and "\\boxed{" in m and "What is 1+1?" in m
    c = prompts.choice_prompt("Pick one.", ["x", "y"], "Biology")
    assert "(A) x\n(B) y" in c and "uppercase letter" in c and "Biology" in c
    k = prompts.code_prompt("Sum.", "class Solution:\n    def f(self): ...")
    assert "```python" in k and "class Solution" in k and "tool" in k
    assert "standard input" in prompts.code_prompt("Sum.")
    with pytest.raises(ValueError):
        prompts.prompt_for("essay", "x")


# ------------------------------------------------------------------- model-aware filtering


def test_filter_is_resumable_and_tags_difficulty(tmp_path, monkeypatch):
    """A stand-in rollout module: problem i is solved by the first solved[i] of k samples."""
    k = 4
    solved = [0, 1, 2, 3, 4]
    problems = [{"prompt": f"p{i}", "answer": "7", "kind": "math", "source": "t"} for i in range(5)]
    calls = []

    class Traj:
        def __init__(self, pi, si, text):
            self.problem_index, self.sample_index, self.text = pi, si, text

    class RolloutConfig:
        def __init__(self, n=1, temperature=1.0, top_p=1.0, max_response_tokens=1, max_turns=1, seed=None):
            self.n, self.seed = n, seed

    def rollout(model, tokenizer, batch, cfg, sandbox=None):
        calls.append(len(batch))
        out = []
        for pi, p in enumerate(batch):
            i = int(p["prompt"][1:])
            for si in range(cfg.n):
                out.append(Traj(pi, si, "\\boxed{7}" if si < solved[i] else "\\boxed{8}"))
        return out

    fake = types.ModuleType("rollout")
    fake.RolloutConfig, fake.rollout = RolloutConfig, rollout
    monkeypatch.setitem(sys.modules, "rollout", fake)
    results_path = str(tmp_path / "f.jsonl.results.jsonl")
    # first pass stops after 3 problems (as if killed), the second does only the rest
    prepare.filter_problems(None, None, problems[:3], results_path, k=k, batch=2, report=quiet, progress=False)
    assert calls == [2, 1]
    results = prepare.filter_problems(None, None, problems, results_path, k=k, batch=2, report=quiet, progress=False)
    assert calls == [2, 1, 2]
    assert [results[prepare.problem_key(i, p)]["pass_rate"] for i, p in enumerate(problems)] == [0, .25, .5, .75, 1]
    hist = prepare.write_filtered(problems, results, str(tmp_path / "f.jsonl"), k, report=quiet)
    kept = read(str(tmp_path / "f.jsonl"))
    assert [(r["prompt"], r["difficulty"]) for r in kept] == [("p1", "hard"), ("p2", "medium"), ("p3", "easy")]
    assert hist["difficulty"] == {"easy": 1, "medium": 1, "hard": 1,
                                  "dropped_always_solved": 1, "dropped_never_solved": 1}
    assert json.load(open(str(tmp_path / "f.jsonl.hist.json")))["kept"] == 3
