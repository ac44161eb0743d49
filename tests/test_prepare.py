"""data/prepare.py and data/prompts.py on hand-written rows in the upstream layouts: converters,
upstream's prompt texts, the three code-test shapes, the LiveCodeBench date window, malformed
rows, the restricted unpickler, parquet (when pyarrow is installed), the command line."""
import base64
import json
import os
import pickle
import sys
import types
import zlib

import pytest

from data import prepare

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "fixtures")

# Upstream's texts (Gen-Verse/Open-AgentRL recipe/demystify/reward.py), written out here on their
# own so the tests check data/prompts.py against them, not against itself.
MATH_1 = "Analyze and solve the following math problem step by step. \n\n"
MATH_2 = ("\n\nThe tool could be used for more precise and efficient calculation and could help you to verify "
          "your result before you reach the final answer.")
AGENT = ("\n\n**Note: You should first analyze the problem and form a high-level solution strategy, then utilize "
         "the tools to help you solve the problem.**")
ANSWER = ("\nRemember once you make sure the current answer is your final answer, do not call the tools again and "
          "directly output the final answer in the following text format, the answer format must be: "
          "\\boxed{'The final answer goes here.'}.")
SUBMIT = ("\nBefore sumbit your code, you can utilize tools to check the correctness of your code, once you make "
          "sure the current code is correct, do not call the tools again and submit your code within "
          "```python\n# YOUR CODE HERE\n```.")
UNITS_DAPO = ("\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be the "
              "numerical value of the final answer only, without any units.")
UNITS_SKYWORK = UNITS_DAPO.replace("the numerical value", "the final numerical value")
LCB_START = ("You will be given a question (problem specification) and will generate a correct Python program "
             "that matches the specification and passes all tests.\n\n")
LCB_CODE = ("\n\nRead the inputs from stdin solve the problem and write the answer to stdout (do not directly test "
            "on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
            "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n```python\n"
            "# YOUR CODE HERE\n\"")


def gpqa_prompt(domain, problem):
    return (f"Analyze and solve the following {domain} problem step by step. \n\n" + problem + MATH_2 + AGENT + ANSWER
            + "\n Here you need to put the final uppercase letter option of this problem into \\boxed{}")


def lcb_prompt(problem, inputs, outputs):
    examples = ("\nHere are some input and output examples of the expected code:\nInput:" + inputs
                + "\nOutput:\n" + outputs)
    return LCB_START + problem + examples + AGENT + LCB_CODE + SUBMIT


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def quiet(*a):
    pass


def write_rows(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


# ------------------------------------------------------------------- SFT


def test_sft_fixture(tmp_path):
    rows = read(prepare.prepare_sft(os.path.join(FIX, "sft"), str(tmp_path), report=quiet))
    assert len(rows) == 2
    first = rows[0]
    assert [m["role"] for m in first["messages"]] == ["user", "assistant", "tool", "assistant"]
    # JSON-text arguments become a dict; ids are kept; nulls from the struct schema are gone
    assert first["messages"][1]["tool_calls"][0] == {
        "type": "function", "id": "call_0",
        "function": {"name": "code_interpreter", "arguments": {"code": "print(17 * 23)"}}}
    assert "tool_calls" not in first["messages"][0] and "name" not in first["messages"][0]
    assert first["messages"][2]["name"] == "code_interpreter"
    assert first["tools"][0]["function"]["name"] == "code_interpreter"   # parsed from JSON text
    second = rows[1]
    assert second["messages"][2]["content"] == ""                      # content null -> ""
    assert second["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"code": "sum(range(1, 20, 2))"}
    assert set(second["tools"][0]["function"]["parameters"]["properties"]) == {"code"}   # null 'timeout' dropped


# ------------------------------------------------------------------- RL


def rl_rows(tmp_path):
    return {r["source"]: r for r in read(prepare.prepare_rl(os.path.join(FIX, "rl"), str(tmp_path), report=quiet))}


def test_rl_fixture_prompts_are_upstreams(tmp_path):
    rows = rl_rows(tmp_path)
    dapo = rows["math_dapo"]
    assert dapo["kind"] == "math" and dapo["answer"] == "9" and dapo["id"] == "a1b2"
    assert dapo["prompt"] == ("Solve step by step, you may use the code tool, and put the final answer in \\boxed{}."
                              "\n\nHow many positive divisors does 36 have?" + UNITS_DAPO)
    assert rows["mega-science"]["answer"] == "2" and rows["mega-science"]["prompt"].endswith("without any units.")
    sky = rows["skywork_math"]
    assert sky["answer"] == "1024"                                     # one-element list unwrapped
    # the system turn stays a system message; the user turn gets map_fn_skywork's math template
    assert sky["system"] == "Be careful."
    assert sky["prompt"] == MATH_1 + "What is 2^10?" + MATH_2 + AGENT + ANSWER + UNITS_SKYWORK
    assert "system" not in dapo
    taco = rows["codegen/taco"]
    assert taco["kind"] == "code" and taco["answer"] is None
    assert taco["prompt"] == "Read two integers a and b from one line and print their sum." + AGENT + SUBMIT
    assert taco["tests"] == {"fn_name": None, "cases": [{"input": "1 2\n", "output": "3\n"},
                                                        {"input": "10 -3\n", "output": "7\n"}]}


def test_call_based_taco_rows_keep_their_wrapped_outputs(tmp_path):
    rows = rl_rows(tmp_path)
    # TACO stores call-based outputs wrapped in a list; the grader must know, or a right answer scores 0
    assert rows["train-code-taco-medium"]["tests"] == {"fn_name": "lcm_of", "wrapped": True, "cases": [
        {"input": "12\n16", "output": "[48]"}, {"input": "4\n5", "output": "[20]"}]}
    assert rows["codegen/leetcode"]["tests"] == {"fn_name": "add", "wrapped": True, "cases": [
        {"input": "1\n2", "output": "3"}, {"input": "[1]\n[2]", "output": "[1, 2]"}]}
    # LiveCodeBench-style functional tests (arguments already text) are not wrapped
    lcb = read(prepare.prepare_eval(os.path.join(FIX, "eval"), str(tmp_path), report=quiet)["lcb"])
    assert lcb[1]["tests"] == {"fn_name": "longestRun", "cases": [{"input": '"aab"', "output": "2"},
                                                                  {"input": '"abc"', "output": "1"}]}


def test_assert_style_rows_are_kept_verbatim(tmp_path):
    rows = rl_rows(tmp_path)
    assert len(rows) == 8                                              # nothing skipped
    code_rows = read(os.path.join(FIX, "rl", "open_agentrl_30k_code_rows.jsonl"))
    gt = json.loads(code_rows[1]["reward_model"]["ground_truth"])
    assert rows["train-code-leetcode-Easy"]["tests"] == {"fn_name": None, "cases": [], **gt}
    assert rows["codegen/kodcode"]["tests"] == {"fn_name": None, "cases": [], "import_prefix": "",
                                                "test_code": "def check(f):\n    assert f(2)", "entry_point": "is_even"}


GOOD_RL = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "1+1?"}],
           "ability": "MATH", "reward_model": {"ground_truth": "2"}}


def code_row(**gt):
    return dict(GOOD_RL, data_source="codegen/leetcode", reward_model={"ground_truth": json.dumps(gt)})


@pytest.mark.parametrize("bad,field", [
    ({k: v for k, v in GOOD_RL.items() if k != "reward_model"}, "reward_model"),
    (dict(GOOD_RL, prompt=[{"role": "system", "content": "x"}]), "prompt"),
    (dict(GOOD_RL, reward_model={"ground_truth": ""}), "reward_model.ground_truth"),
    (code_row(inputs=["1"], outputs=[]), "reward_model.ground_truth"),
    (dict(GOOD_RL, reward_model="{not json"), "reward_model"),
    (code_row(import_prefix="", test_code="def check(c):\n    assert c(1)"), "reward_model.ground_truth.entry_point"),
    (code_row(import_prefix="", entry_point="f"), "reward_model.ground_truth.test_code"),
    (code_row(fn_name="f", inputs=[[1], 2], outputs=[1, 2]), "reward_model.ground_truth.inputs"),
])
def test_malformed_rl_row_names_file_row_and_field(tmp_path, bad, field):
    path = write_rows(tmp_path / "rl.jsonl", [GOOD_RL, bad])
    with pytest.raises(SystemExit) as e:
        prepare.prepare_rl(path, str(tmp_path / "out"), report=quiet)
    assert str(e.value).startswith(f"{path}: row 2: field '{field}'"), str(e.value)
    assert not os.path.exists(tmp_path / "out" / "rl.jsonl")     # nothing half-written


# ------------------------------------------------------------------- eval


def test_eval_fixture_prompts_are_upstreams(tmp_path):
    paths = prepare.prepare_eval(os.path.join(FIX, "eval"), str(tmp_path), report=quiet)
    assert sorted(paths) == ["aime24", "aime25", "gpqa", "lcb"]
    aime24 = read(paths["aime24"])
    assert [r["answer"] for r in aime24] == [2, 33]                 # ints, "033" unpadded
    assert all(r["kind"] == "math" and r["benchmark"] == "aime24" for r in aime24)
    assert aime24[0]["prompt"] == MATH_1 + "Find the remainder when 2^100 is divided by 7." + MATH_2 + AGENT + ANSWER
    assert aime24[0]["id"] == "2024-I-1" and "system" not in aime24[0]
    aime25 = read(paths["aime25"])[0]
    assert aime25["answer"] == 14 and aime25["prompt"].startswith(MATH_1 + "How many integers")
    gpqa = read(paths["gpqa"])
    assert [r["answer"] for r in gpqa] == ["B", "C"] and gpqa[0]["kind"] == "choice"
    assert gpqa[0]["prompt"] == gpqa_prompt("Physics", "Which particle mediates the electromagnetic force?\n"
                                            "(A) gluon\n(B) photon\n(C) W boson\n(D) graviton")
    lcb = read(paths["lcb"])
    assert lcb[0]["tests"] == {"fn_name": None, "cases": [{"input": "3\n", "output": "6\n"},
                                                          {"input": "5\n", "output": "10\n"}]}
    # the examples are Python's str() of the ground-truth lists, as upstream prints them
    assert lcb[0]["prompt"] == lcb_prompt("Given N on one line, print N * 2.", "['3\\n', '5\\n']", "['6\\n', '10\\n']")
    assert lcb[1]["prompt"] == lcb_prompt("Return the length of the longest run of equal characters in s.",
                                          "['\"aab\"', '\"abc\"']", "['2', '1']")


def test_raw_livecodebench_window_tests_and_prompt(tmp_path):
    lines = []
    rows = read(prepare.prepare_eval(os.path.join(FIX, "lcb_raw"), str(tmp_path), report=lines.append)["lcb"])
    # the paper's v6 slice, 2025-02-01 .. 2025-05-31 inclusive: the January contest is dropped, 05-31 kept
    assert [r["id"] for r in rows] == ["abc400_a", "3999", "abc408_a"]
    assert any("dropped 1 " in line for line in lines)
    assert rows[0]["source"] == "livecodebench/atcoder" and rows[0]["benchmark"] == "lcb"
    # public + base64/zlib/pickle private tests
    assert rows[0]["tests"] == {"fn_name": None, "cases": [
        {"input": "3\n", "output": "6\n"}, {"input": "7\n", "output": "14\n"}, {"input": "0\n", "output": "0\n"}]}
    assert rows[1]["tests"] == {"fn_name": "addTwo", "cases": [
        {"input": "1\n2", "output": "3"}, {"input": "-1\n1", "output": "0"}]}
    # upstream's LiveCodeBench template, the public tests as its examples
    assert rows[0]["prompt"] == lcb_prompt("Read an integer N and print 2N.", "['3\\n']", "['6\\n']")
    # the window moves with --lcb_start / --lcb_end, in both option spellings
    prepare.main(["eval", "--source", os.path.join(FIX, "lcb_raw"), f"--out={tmp_path / 'all'}",
                  "--lcb_start=2025-01-01", "--lcb_end", "2025-04-30"])
    assert [r["id"] for r in read(tmp_path / "all" / "eval" / "lcb.jsonl")] == ["abc400_a", "abc390_a"]


def test_raw_livecodebench_without_a_date_is_an_error(tmp_path):
    row = read(os.path.join(FIX, "lcb_raw", "code_generation_lite_v6.jsonl"))[0]
    for date in (None, "last spring"):
        path = write_rows(tmp_path / "code_generation_lite.jsonl", [dict(row, contest_date=date)])
        with pytest.raises(SystemExit, match=r"code_generation_lite.jsonl: row 1: field 'contest_date'"):
            prepare.prepare_eval(path, str(tmp_path / "out"), report=quiet)


def test_raw_livecodebench_metadata_not_an_object_is_one_line(tmp_path):
    """A functional row whose metadata is a JSON list or string: the field error, no traceback."""
    rows = read(os.path.join(FIX, "lcb_raw", "code_generation_lite_v6.jsonl"))
    row = next(r for r in rows if "func_name" in str(r.get("metadata")))
    for meta in ("[1, 2]", '"addTwo"'):
        path = write_rows(tmp_path / "code_generation_lite.jsonl", [dict(row, metadata=meta)])
        with pytest.raises(SystemExit, match=r"row 1: field 'metadata.func_name'"):
            prepare.prepare_eval(path, str(tmp_path / "out"), report=quiet)


def test_raw_gpqa_options_are_shuffled_once_and_written_in(tmp_path):
    row = {"Question": "Which is a noble gas?", "Correct Answer": "Neon", "Incorrect Answer 1": "Iron",
           "Incorrect Answer 2": "Carbon", "Incorrect Answer 3": "Sodium", "High-level domain": "Chemistry"}
    path = write_rows(tmp_path / "gpqa_raw.jsonl", [row, row])
    a, b = read(prepare.prepare_eval(path, str(tmp_path), report=quiet)["gpqa"])
    assert a == b and a["kind"] == "choice"
    options = a["prompt"].split("Which is a noble gas?\n")[1].split(MATH_2)[0].split("\n")   # "(A) ..." lines
    assert [o[:4] for o in options] == ["(A) ", "(B) ", "(C) ", "(D) "]
    assert sorted(o[4:] for o in options) == ["Carbon", "Iron", "Neon", "Sodium"]
    assert f"({a['answer']}) Neon" in options
    assert a["prompt"] == gpqa_prompt("Chemistry", "Which is a noble gas?\n" + "\n".join(options))


def test_malformed_eval_and_sft_rows(tmp_path):
    d = tmp_path / "aime2025"
    d.mkdir()
    write_rows(d / "x.jsonl", [{"problem": "p", "answer": "12"}, {"problem": "q", "answer": "twelve"}])
    with pytest.raises(SystemExit, match=r"row 2: field 'answer': AIME answer 'twelve' is not an integer"):
        prepare.prepare_eval(str(d), str(tmp_path / "out"), report=quiet)
    path = write_rows(tmp_path / "s.jsonl", ['{"messages": [}'])
    with pytest.raises(SystemExit, match=r"s.jsonl: row 1: not JSON"):
        prepare.prepare_sft(path, str(tmp_path / "out"), report=quiet)
    path = write_rows(tmp_path / "s2.jsonl", [{"messages": [{"role": "robot", "content": "hi"}], "tools": []}])
    with pytest.raises(SystemExit, match=r"row 1: field 'messages\[0\].role'"):
        prepare.prepare_sft(path, str(tmp_path / "out"), report=quiet)
    bad_gpqa = tmp_path / "gpqa"
    bad_gpqa.mkdir()
    write_rows(bad_gpqa / "g.jsonl", [{"problem": "p", "solution": "maybe", "domain": "Physics"}])
    with pytest.raises(SystemExit, match=r"row 1: field 'solution': 'maybe' is not an option letter"):
        prepare.prepare_eval(str(bad_gpqa), str(tmp_path / "out"), report=quiet)


# ------------------------------------------------------------------- the restricted unpickler


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def blob(obj):
    return base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()


def raw_lcb_dir(tmp_path, private):
    row = read(os.path.join(FIX, "lcb_raw", "code_generation_lite_v6.jsonl"))[0]
    write_rows(tmp_path / "code_generation_lite.jsonl", [dict(row, private_test_cases=private)])
    return str(tmp_path / "code_generation_lite.jsonl")


def test_restricted_unpickler_refuses_objects(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit, match="field 'private_test_cases': .*refused to load builtins.print"):
        prepare.prepare_eval(raw_lcb_dir(tmp_path, blob([Evil()])), str(tmp_path / "out"), report=quiet)
    assert "must never run" not in capsys.readouterr().out
    # plain data straight in the pickle (no JSON text) is fine; tuples, sets and bytes are not
    case = {"input": "1\n", "output": "2\n", "testtype": "stdin"}
    rows = read(prepare.prepare_eval(raw_lcb_dir(tmp_path, blob([case])), str(tmp_path / "a"), report=quiet)["lcb"])
    assert rows[0]["tests"]["cases"][-1] == {"input": "1\n", "output": "2\n"}
    for bad in ([dict(case, input=("1", "2"))], [{1, 2}], [b"1"]):
        with pytest.raises(SystemExit, match="only plain data"):
            prepare.prepare_eval(raw_lcb_dir(tmp_path, blob(bad)), str(tmp_path / "out"), report=quiet)
    with pytest.raises(SystemExit, match="neither JSON nor base64"):
        prepare.prepare_eval(raw_lcb_dir(tmp_path, "%%% not base64 %%%"), str(tmp_path / "out"), report=quiet)
    monkeypatch.setattr(prepare, "MAX_DECOMPRESSED", 100)      # the cap against zip bombs
    with pytest.raises(SystemExit, match="decompresses past 100 bytes"):
        prepare.prepare_eval(raw_lcb_dir(tmp_path, blob([case] * 50)), str(tmp_path / "out"), report=quiet)


# ------------------------------------------------------------------- sources and the command line


def test_hub_failure_is_one_clear_line(monkeypatch):
    fake = types.ModuleType("huggingface_hub")

    def snapshot_download(**kw):
        raise ConnectionError("no network here")
    fake.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    with pytest.raises(SystemExit, match=r"could not download Gen-Verse/Open-AgentRL-30K .*--source DIR"):
        prepare.main(["rl"])
    with pytest.raises(SystemExit, match=r"no/such/dir/x: no such file or directory"):
        prepare.main(["rl", "--source=no/such/dir/x"])


def test_json_list_source_and_help(tmp_path, capsys):
    path = tmp_path / "aime2025.json"
    path.write_text(json.dumps([{"problem": "p", "answer": "12"}]))
    prepare.main(["eval", "--source", str(path), "--out", str(tmp_path)])
    assert read(tmp_path / "eval" / "aime25.jsonl")[0]["answer"] == 12
    with pytest.raises(SystemExit):
        prepare.main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    for option in ("--source", "--out", "--lcb_start", "--lcb_end", "default: data", "default: 2025-02-01",
                   "default: 2025-05-31"):
        assert option in usage


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
    assert a == b and len(a) == 6
