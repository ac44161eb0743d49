"""data/prepare.py: get the paper's datasets into the project's jsonl formats.

    python data/prepare.py sft  --out data     # Gen-Verse/Open-AgentRL-SFT-3K -> data/sft.jsonl
    python data/prepare.py rl   --out data     # Gen-Verse/Open-AgentRL-30K    -> data/rl.jsonl
    python data/prepare.py eval --out data     # Gen-Verse/Open-AgentRL-Eval   -> data/eval/{aime24,aime25,gpqa,lcb}.jsonl
    python data/prepare.py all  --out data     # all three
    python data/prepare.py rl --source /path/to/Open-AgentRL-30K   # a local copy (dir or file)
    python data/prepare.py filter --model DIR --data data/rl.jsonl --k 8 --out data/rl_filtered.jsonl

Sources are Hugging Face dataset ids (downloaded with huggingface_hub) or, for clusters
whose compute nodes have no internet, a local directory or file. Files may be .parquet
(needs pyarrow: `pip install pyarrow`), .jsonl or .json (a list of rows) in the same row
layout, which is what the offline tests use.

Formats written (DESIGN.md):
  SFT       {"messages": [...], "tools": [...]}  OpenAI-style; tool-call arguments as dicts
  RL, eval  {"prompt", "answer", "kind": math|choice|code, "source", "tests" (code),
             "benchmark" (eval), "id"}
  code tests {"fn_name": null | str, "cases": [{"input": str, "output": str}, ...]}

Upstream fields read:
  SFT-3K          messages (role, content, tool_calls[].function.{name, arguments}, name,
                  tool_call_id), tools
  30K (verl)      data_source, prompt (chat messages; the user turn, a system turn is
                  prepended to it), ability, reward_model.ground_truth, extra_info.index;
                  code ground truth {"inputs", "outputs", "fn_name"?} (JSON text or dict)
  Eval AIME 2024  Problem, Answer (or problem/answer, or the verl fields)
  Eval AIME 2025  problem, answer
  Eval GPQA-D     problem (options written in), solution (the letter), domain; or raw GPQA:
                  Question, Correct Answer, Incorrect Answer 1-3 (shuffled with a fixed seed)
  Eval LCB v6     problem, reward_model.ground_truth {"inputs","outputs","fn_name"?},
                  extra_info.starter_code?; or raw LiveCodeBench: question_content,
                  starter_code, public_test_cases, private_test_cases (base64 + zlib +
                  pickle, read with a plain-data-only unpickler), metadata.func_name,
                  question_id
A malformed row stops the run with the file, the row number (from 1) and the field.
Rows this project cannot grade (assert-style code tests) are skipped and counted.

Model-aware filtering (the paper's data strategy): `filter` samples k trajectories per
problem with a checkpoint (paper: 8), records each problem's pass rate in
<out>.results.jsonl as it goes (rerunning skips the problems already there), drops the
problems solved always or never, tags the rest easy (>= 0.75), medium or hard (<= 0.25),
and writes <out> plus a difficulty histogram in <out>.hist.json.
"""

import argparse
import base64
import hashlib
import io
import json
import os
import pickle
import random
import re
import sys
import zlib
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python data/prepare.py` puts data/ on the path, not the root
    sys.path.insert(0, ROOT)

from data import prompts  # noqa: E402

HUB = {
    "sft": "Gen-Verse/Open-AgentRL-SFT-3K",
    "rl": "Gen-Verse/Open-AgentRL-30K",
    "eval": "Gen-Verse/Open-AgentRL-Eval",
}
ROW_FILES = (".parquet", ".jsonl", ".json")
MAX_DECOMPRESSED = 1 << 30  # LiveCodeBench's biggest test blobs are far below 1 GiB


class DataError(Exception):
    """A malformed source row: says where and what."""

    def __init__(self, where, field, what):
        super().__init__(f"{where}: field '{field}': {what}")


class Skip(Exception):
    """A well-formed row this project cannot use; counted, not fatal."""


# --------------------------------------------------------------------------------------
# finding and reading files


def resolve_files(source):
    """A local file, every row file under a local directory, or a hub dataset's files."""
    if os.path.isfile(source):
        return [source]
    if os.path.isdir(source):
        root = source
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", source) and not source.startswith("."):
        root = download(source)
    else:
        raise SystemExit(f"{source}: no such file or directory")
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))  # skip .cache, .git
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(ROW_FILES)]
    if not files:
        raise SystemExit(f"{source}: no .parquet, .jsonl or .json files found")
    return files


def download(repo_id):
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SystemExit("downloading from the hub needs huggingface_hub "
                         "(pip install huggingface_hub), or pass --source DIR")
    try:
        return snapshot_download(repo_id=repo_id, repo_type="dataset",
                                 allow_patterns=["*.parquet", "*.jsonl", "*.json"])
    except Exception as e:
        raise SystemExit(f"could not download {repo_id} from the Hugging Face hub "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                         "download it where there is internet and pass --source DIR")


def read_parquet(path):
    """Rows of a parquet file as plain dicts, streamed in batches (LiveCodeBench rows are
    large). pyarrow is an optional dependency needed only here; see the README."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                         "or convert the file to .jsonl first")
    for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
        yield from batch.to_pylist()


def read_rows(path):
    """(row number from 1, row dict) for a .parquet, .jsonl or .json file."""
    if path.endswith(".parquet"):
        rows = read_parquet(path)
    elif path.endswith(".jsonl"):
        rows = _jsonl_rows(path)
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: not JSON ({e.msg}, line {e.lineno})")
        if not isinstance(data, list):
            raise SystemExit(f"{path}: a .json source must hold a list of rows")
        rows = data
    else:
        raise SystemExit(f"{path}: unknown file type (expected .parquet, .jsonl or .json)")
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise SystemExit(f"{path}: row {i}: not an object")
        yield i, row


def _jsonl_rows(path):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: row {lineno}: not JSON ({e.msg})")


def write_jsonl(path, records):
    """Write through a temporary file and rename, so a crash never leaves half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------
# field helpers


def need(row, name, where, types=str):
    if name not in row or row[name] is None:
        raise DataError(where, name, "missing")
    if not isinstance(row[name], types):
        raise DataError(where, name, f"expected {_type_names(types)}, got {type(row[name]).__name__}")
    return row[name]


def _type_names(types):
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in types)


def json_field(value, where, field):
    """Upstream files store nested fields either as structs or as JSON text; accept both."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(where, field, f"not valid JSON ({e.msg})")
    return value


def drop_none(x):
    """Parquet struct columns fill absent keys with None (one schema for all rows)."""
    if isinstance(x, dict):
        return {k: drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [drop_none(v) for v in x]
    return x


def check_plain(x, where, field, depth=0):
    """Only str/int/float/bool/None/list/dict-with-str-keys; anything else is refused."""
    if depth > 100:
        raise DataError(where, field, "nested too deeply")
    if x is None or isinstance(x, (str, bool, int, float)):
        return
    if isinstance(x, list):
        for v in x:
            check_plain(v, where, field, depth + 1)
        return
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str):
                raise DataError(where, field, f"non-string key of type {type(k).__name__}")
            check_plain(v, where, field, depth + 1)
        return
    raise DataError(where, field, f"holds a {type(x).__name__}, only plain data is allowed")


# --------------------------------------------------------------------------------------
# code tests


class PlainUnpickler(pickle.Unpickler):
    """Unpickles only what the pickle opcodes build by themselves (str, bytes, numbers,
    lists, dicts, ...). Any class or function reference, the way a pickle runs code, is
    refused; check_plain then narrows the result to JSON-like data."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain data is allowed")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused a persistent id: only plain data is allowed")


def decode_lcb_tests(value, where, field):
    """LiveCodeBench test lists: JSON text, or (private tests) base64 of zlib of a pickle
    of JSON text."""
    if value is None or value == "":
        return []
    obj = value
    if isinstance(value, str):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError:
            try:
                raw = base64.b64decode(value, validate=True)
                d = zlib.decompressobj()
                data = d.decompress(raw, MAX_DECOMPRESSED)
                if d.unconsumed_tail:
                    raise DataError(where, field, f"decompresses past {MAX_DECOMPRESSED} bytes")
                obj = PlainUnpickler(io.BytesIO(data)).load()
            except DataError:
                raise
            except Exception as e:
                raise DataError(where, field, f"neither JSON nor base64+zlib+pickle ({type(e).__name__}: {e})")
            if isinstance(obj, bytes):
                obj = obj.decode("utf-8", errors="replace")
            if isinstance(obj, str):
                try:
                    obj = json.loads(obj)
                except json.JSONDecodeError as e:
                    raise DataError(where, field, f"decoded payload is not JSON ({e.msg})")
    check_plain(obj, where, field)
    if not isinstance(obj, list):
        raise DataError(where, field, "expected a list of test cases")
    return obj


def lcb_cases(items, where, field):
    """[{'input', 'output', 'testtype'}] -> (cases, set of test types)."""
    cases, kinds = [], set()
    for j, c in enumerate(items):
        if not isinstance(c, dict) or not isinstance(c.get("input"), str) or not isinstance(c.get("output"), str):
            raise DataError(where, f"{field}[{j}]", "expected {'input': str, 'output': str, 'testtype': ...}")
        kinds.add(c.get("testtype", "stdin"))
        cases.append({"input": c["input"], "output": c["output"]})
    return cases, kinds


def tests_from_ground_truth(gt, where, field="reward_model.ground_truth"):
    """verl / PRIME-style code ground truth -> the project's test shape.

    {"inputs": [...], "outputs": [...], "fn_name"?}: stdin programs take each input string
    as stdin (a list of lines is joined); with fn_name, inputs given as argument lists are
    written one JSON argument per line and outputs as JSON, while inputs already given as
    text (LiveCodeBench style) are kept as they are."""
    gt = json_field(gt, where, field)
    if isinstance(gt, list):
        cases, kinds = lcb_cases(gt, where, field)
        if "functional" in kinds:
            raise DataError(where, field, "functional test list without a function name")
        return {"fn_name": None, "cases": cases}
    if not isinstance(gt, dict):
        raise DataError(where, field, f"expected an object with inputs/outputs, got {type(gt).__name__}")
    if "inputs" not in gt and ("test_code" in gt or "import_prefix" in gt):
        raise Skip("assert-style code tests (import_prefix/test_code) are not supported")
    ins, outs = gt.get("inputs"), gt.get("outputs")
    if not isinstance(ins, list) or not isinstance(outs, list):
        raise DataError(where, field, "needs lists 'inputs' and 'outputs'")
    if len(ins) != len(outs):
        raise DataError(where, field, f"{len(ins)} inputs but {len(outs)} outputs")
    if not ins:
        raise DataError(where, field, "no test cases")
    fn = gt.get("fn_name") or None
    if fn is not None and not isinstance(fn, str):
        raise DataError(where, field + ".fn_name", "not a string")
    cases = []
    for j, (i, o) in enumerate(zip(ins, outs)):
        if fn is None:
            if isinstance(i, list):
                i = "\n".join(str(x) for x in i)
            if isinstance(o, list):
                o = "\n".join(str(x) for x in o)
            if not isinstance(i, str) or not isinstance(o, str):
                raise DataError(where, f"{field}.inputs[{j}]", "stdin tests need string inputs and outputs")
        elif isinstance(i, str):
            if not isinstance(o, str):
                o = json.dumps(o)
        else:
            args = i if isinstance(i, list) else [i]
            i = "\n".join(json.dumps(a) for a in args)
            o = json.dumps(o)
        cases.append({"input": i, "output": o})
    return {"fn_name": fn, "cases": cases}


# --------------------------------------------------------------------------------------
# converters


ROLES = ("system", "user", "assistant", "tool")


def convert_sft_row(row, where):
    msgs = json_field(need(row, "messages", where, (list, str)), where, "messages")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(where, "messages", "expected a non-empty list of messages")
    out = []
    for j, m in enumerate(msgs):
        f = f"messages[{j}]"
        if not isinstance(m, dict):
            raise DataError(where, f, "not an object")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(where, f + ".role", f"{role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise DataError(where, f + ".content", "not a string")
        msg = {"role": role, "content": content}
        calls = json_field(m.get("tool_calls"), where, f + ".tool_calls")
        if calls:
            if role != "assistant":
                raise DataError(where, f + ".tool_calls", f"only assistant messages call tools, not {role}")
            msg["tool_calls"] = [normalize_call(c, where, f"{f}.tool_calls[{k}]") for k, c in enumerate(calls)]
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str) and m[key]:
                msg[key] = m[key]
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(where, "messages", "no assistant message to train on")
    tools = json_field(need(row, "tools", where, (list, str)), where, "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(where, "tools", "expected a list of tool schemas")
    return {"messages": out, "tools": drop_none(tools)}


def normalize_call(c, where, field):
    if not isinstance(c, dict):
        raise DataError(where, field, "not an object")
    fn = c.get("function") if isinstance(c.get("function"), dict) else c
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise DataError(where, field + ".function.name", "missing")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise DataError(where, field + ".function.arguments", f"not valid JSON ({e.msg})")
    if not isinstance(args, dict):
        raise DataError(where, field + ".function.arguments", "expected an object")
    call = {"type": "function", "function": {"name": name, "arguments": drop_none(args)}}
    if isinstance(c.get("id"), str) and c["id"]:
        call["id"] = c["id"]
    return call


def verl_user_text(row, where):
    """The user turn of a verl chat prompt; a system turn, if any, goes in front of it (the
    project's rollout adds no system prompt of its own)."""
    msgs = json_field(need(row, "prompt", where, (list, str)), where, "prompt")
    if isinstance(msgs, str) or not isinstance(msgs, list):
        raise DataError(where, "prompt", "expected a list of chat messages")
    system = [m.get("content") or "" for m in msgs if isinstance(m, dict) and m.get("role") == "system"]
    users = [m for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str) or not users[-1]["content"].strip():
        raise DataError(where, "prompt", "no user message with text")
    return "\n\n".join([s for s in system if s] + [users[-1]["content"]])


def reward_ground_truth(row, where):
    rm = json_field(need(row, "reward_model", where, (dict, str)), where, "reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise DataError(where, "reward_model.ground_truth", "missing")
    return rm["ground_truth"]


def row_id(row):
    extra = row.get("extra_info")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError:
            extra = None
    if isinstance(extra, dict) and extra.get("index") is not None:
        return extra["index"]
    return None


def is_code_row(row):
    ds = str(row.get("data_source") or "").lower()
    ability = str(row.get("ability") or "").lower()
    return "code" in ds or ability in ("code", "coding")


def convert_rl_row(row, where):
    """A verl-layout row of Open-AgentRL-30K (math_dapo, mega-science, code)."""
    source = need(row, "data_source", where)
    text = verl_user_text(row, where)
    gt = reward_ground_truth(row, where)
    rec = {"prompt": None, "answer": None, "kind": None, "source": source}
    if is_code_row(row):
        rec.update(prompt=text + prompts.CODE_SUFFIX, kind="code",
                   tests=tests_from_ground_truth(gt, where))
    else:
        if isinstance(gt, list) and len(gt) == 1:
            gt = gt[0]
        if isinstance(gt, bool) or not isinstance(gt, (str, int, float)) or str(gt).strip() == "":
            raise DataError(where, "reward_model.ground_truth", "expected a non-empty answer string")
        # math_dapo / mega-science messages already carry the tool and box instructions
        already = source.lower() in ("math_dapo", "mega-science", "mega_science")
        prompt = text + prompts.UNITS_SUFFIX if already else prompts.math_prompt(text)
        rec.update(prompt=prompt, kind="math", answer=str(gt).strip())
    rid = row_id(row)
    if rid is not None:
        rec["id"] = rid
    return rec


def benchmark_name(text):
    """aime24 / aime25 / gpqa / lcb from a data_source value or a path; None if unknown."""
    t = re.sub(r"[^a-z0-9]", "", str(text).lower())
    if "aime" in t and ("2024" in t or "aime24" in t):
        return "aime24"
    if "aime" in t and ("2025" in t or "aime25" in t):
        return "aime25"
    if "gpqa" in t:
        return "gpqa"
    if "livecodebench" in t or "lcb" in t or "codegenerationlite" in t:
        return "lcb"
    return None


def aime_answer(value, where, field):
    """AIME answers are integers 0..999; some copies zero-pad them ("033")."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    s = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[+-]?\d+", s):
        raise DataError(where, field, f"AIME answer {s[:40]!r} is not an integer")
    return int(s)


def first_present(row, names):
    for n in names:
        if row.get(n) is not None:
            return n
    return None


def convert_aime_row(row, where, bench):
    pf = first_present(row, ("Problem", "problem", "question"))
    af = first_present(row, ("Answer", "answer"))
    if pf is None and "prompt" in row:
        problem, answer, af = verl_user_text(row, where), reward_ground_truth(row, where), "reward_model.ground_truth"
    else:
        if pf is None:
            raise DataError(where, "Problem", "missing (also looked for problem, question, prompt)")
        if af is None:
            raise DataError(where, "Answer", "missing (also looked for answer)")
        problem, answer = need(row, pf, where), row[af]
    rec = {"prompt": prompts.math_prompt(problem), "answer": aime_answer(answer, where, af),
           "kind": "math", "source": row.get("data_source") or bench, "benchmark": bench}
    rid = row.get("ID", row.get("id"))
    if rid is not None:
        rec["id"] = rid
    return rec


def choice_letter(value, where, field, n_choices=None):
    if isinstance(value, int) and not isinstance(value, bool):
        if n_choices is not None and not 0 <= value < n_choices:
            raise DataError(where, field, f"answer index {value} out of range")
        return chr(ord("A") + value)
    s = str(value).strip().strip("()").strip().rstrip(".").upper()
    if not re.fullmatch(r"[A-Z]", s):
        raise DataError(where, field, f"{str(value)[:40]!r} is not an option letter")
    return s


def convert_gpqa_row(row, where, bench):
    domain = row.get("domain") or row.get("High-level domain") or None
    if row.get("Question") is not None and row.get("Correct Answer") is not None:
        # the original GPQA layout: shuffle the options with a seed fixed by the question
        question = need(row, "Question", where)
        right = str(need(row, "Correct Answer", where)).strip()
        wrong = [str(need(row, f"Incorrect Answer {i}", where)).strip() for i in (1, 2, 3)]
        options = [right] + wrong
        random.Random(zlib.crc32(question.encode())).shuffle(options)
        prompt = prompts.choice_prompt(question, options, domain)
        letter = chr(ord("A") + options.index(right))
    elif isinstance(row.get("choices"), list):
        question = need(row, first_present(row, ("problem", "question")) or "question", where)
        choices = row["choices"]
        af = first_present(row, ("answer", "solution")) or "answer"
        letter = choice_letter(need(row, af, where, (str, int)), where, af, len(choices))
        prompt = prompts.choice_prompt(question, choices, domain)
    else:
        pf = first_present(row, ("problem", "question"))
        if pf is None:
            raise DataError(where, "problem", "missing (also looked for question, Question)")
        af = first_present(row, ("solution", "answer"))
        if af is None:
            raise DataError(where, "solution", "missing (also looked for answer)")
        letter = choice_letter(row[af], where, af)
        prompt = prompts.choice_prompt(need(row, pf, where), None, domain)
    return {"prompt": prompt, "answer": letter, "kind": "choice",
            "source": row.get("data_source") or bench, "benchmark": bench}


def convert_lcb_row(row, where, bench):
    if row.get("question_content") is not None:
        # raw LiveCodeBench (livecodebench/code_generation_lite)
        content = need(row, "question_content", where)
        starter = row.get("starter_code") or ""
        public, k1 = lcb_cases(decode_lcb_tests(row.get("public_test_cases"), where, "public_test_cases"),
                               where, "public_test_cases")
        private, k2 = lcb_cases(decode_lcb_tests(row.get("private_test_cases"), where, "private_test_cases"),
                                where, "private_test_cases")
        cases = public + private
        if not cases:
            raise DataError(where, "public_test_cases", "no test cases")
        fn = None
        if "functional" in k1 | k2:
            meta = json_field(row.get("metadata") or {}, where, "metadata")
            fn = meta.get("func_name") if isinstance(meta, dict) else None
            if not isinstance(fn, str) or not fn:
                raise DataError(where, "metadata.func_name", "missing for a functional problem")
        rec = {"prompt": prompts.code_prompt(content, starter), "answer": None, "kind": "code",
               "source": f"livecodebench/{row.get('platform') or 'unknown'}", "benchmark": bench,
               "tests": {"fn_name": fn, "cases": cases}}
        if row.get("question_id") is not None:
            rec["id"] = row["question_id"]
        return rec
    # Open-AgentRL-Eval layout: problem text + verl reward_model
    pf = first_present(row, ("problem", "question"))
    if pf is not None:
        problem = need(row, pf, where)
    else:
        problem = verl_user_text(row, where)
    extra = json_field(row.get("extra_info") or {}, where, "extra_info")
    starter = extra.get("starter_code") if isinstance(extra, dict) else None
    tests = tests_from_ground_truth(reward_ground_truth(row, where), where)
    return {"prompt": prompts.code_prompt(problem, starter), "answer": None, "kind": "code",
            "source": row.get("data_source") or bench, "benchmark": bench, "tests": tests}


def convert_eval_row(row, where, bench):
    if bench in ("aime24", "aime25"):
        return convert_aime_row(row, where, bench)
    if bench == "gpqa":
        return convert_gpqa_row(row, where, bench)
    if bench == "lcb":
        return convert_lcb_row(row, where, bench)
    rec = convert_rl_row(row, where)  # an unknown benchmark in verl layout
    rec["benchmark"] = bench
    return rec


# --------------------------------------------------------------------------------------
# commands


def convert_files(files, convert, report):
    """Run convert(row, where) over every row; DataError stops with its message."""
    out, skipped = [], Counter()
    for path in files:
        for i, row in read_rows(path):
            where = f"{path}: row {i}"
            try:
                rec = convert(row, where, path)
            except Skip as e:
                skipped[str(e)] += 1
                continue
            except DataError as e:
                raise SystemExit(str(e))
            out.append(rec)
    for why, n in skipped.items():
        report(f"  skipped {n} rows: {why}")
    return out


def prepare_sft(source, out_dir, report=print):
    files = resolve_files(source)
    recs = convert_files(files, lambda row, where, path: convert_sft_row(row, where), report)
    path = os.path.join(out_dir, "sft.jsonl")
    write_jsonl(path, recs)
    report(f"wrote {len(recs)} SFT conversations to {path}")
    return path


def prepare_rl(source, out_dir, report=print):
    files = resolve_files(source)
    recs = convert_files(files, lambda row, where, path: convert_rl_row(row, where), report)
    path = os.path.join(out_dir, "rl.jsonl")
    write_jsonl(path, recs)
    kinds = Counter(f"{r['kind']}/{r['source']}" for r in recs)
    report(f"wrote {len(recs)} RL problems to {path} (" + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + ")")
    return path


def eval_benchmark_of(path, row, root):
    """The benchmark a row belongs to: folder and file names first (Open-AgentRL-Eval has
    aime2024/, gpqa-diamond/, ...), then the row's shape (raw LiveCodeBench or GPQA), then
    its data_source."""
    rel = os.path.relpath(path, root) if root else path
    parts = rel.replace("\\", "/").split("/")
    if root:
        parts = [os.path.basename(os.path.normpath(root))] + parts
    for part in reversed(parts):
        b = benchmark_name(part)
        if b:
            return b
    if "question_content" in row:  # raw LiveCodeBench, whatever the file is called
        return "lcb"
    if "Correct Answer" in row:    # raw GPQA
        return "gpqa"
    if row.get("data_source"):
        b = benchmark_name(row["data_source"])
        if b:
            return b
        return re.sub(r"[^a-z0-9_]+", "_", str(row["data_source"]).lower()).strip("_") or "other"
    return re.sub(r"[^a-z0-9_]+", "_", os.path.splitext(os.path.basename(path))[0].lower()).strip("_")


def prepare_eval(source, out_dir, report=print):
    files = resolve_files(source)
    root = source if os.path.isdir(source) else (os.path.dirname(files[0]) if len(files) > 1 else None)
    by_bench = {}

    def convert(row, where, path):
        bench = eval_benchmark_of(path, row, root)
        rec = convert_eval_row(row, where, bench)
        by_bench.setdefault(bench, []).append(rec)
        return rec

    convert_files(files, convert, report)
    paths = {}
    for bench, recs in sorted(by_bench.items()):
        path = os.path.join(out_dir, "eval", f"{bench}.jsonl")
        write_jsonl(path, recs)
        paths[bench] = path
        report(f"wrote {len(recs)} {bench} problems to {path}")
    return paths


# --------------------------------------------------------------------------------------
# model-aware filtering


def difficulty(pass_rate):
    if pass_rate >= 0.75:
        return "easy"
    if pass_rate <= 0.25:
        return "hard"
    return "medium"


def problem_key(index, problem):
    """Stable across reruns; a changed data file gives new keys instead of stale results."""
    return f"{index}:{hashlib.sha1(problem['prompt'].encode()).hexdigest()[:12]}"


def filter_problems(model, tokenizer, problems, results_path, k=8, batch=16,
                    temperature=1.0, top_p=1.0, max_response_tokens=20480, max_turns=16,
                    code_timeout=6.0, seed=0, report=print, progress=True):
    """Sample k trajectories per problem, append {key, pass_rate, ...} per problem to
    results_path, skipping problems already recorded there. Returns key -> result."""
    import rollout
    import sandbox
    from tqdm import tqdm
    import evaluate

    done = {}
    if os.path.exists(results_path):
        with open(results_path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a kill; that problem is simply redone
                done[r["key"]] = r
    keyed = [(problem_key(i, p), p) for i, p in enumerate(problems)]
    todo = [(key, p) for key, p in keyed if key not in done]
    report(f"filter: {len(keyed) - len(todo)} problems already scored, {len(todo)} to go")
    cfg = rollout.RolloutConfig(n=k, temperature=temperature, top_p=top_p,
                                max_response_tokens=max_response_tokens, max_turns=max_turns)
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    with open(results_path, "a", encoding="utf-8") as f, \
            tqdm(total=len(todo), desc="filter", unit="problem", disable=not progress) as bar:
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            cfg.seed = (seed * 1_000_003 + zlib.crc32(chunk[0][0].encode())) % 2**31
            trajs = rollout.rollout(model, tokenizer, [p for _, p in chunk], cfg, sandbox=sandbox)
            scores = [[] for _ in chunk]
            for t in trajs:
                scores[t.problem_index].append(evaluate.score(chunk[t.problem_index][1], t.text, code_timeout))
            lines = []
            for (key, p), s in zip(chunk, scores):
                solved = sum(1 for x in s if x >= 1.0)
                r = {"key": key, "pass_rate": solved / len(s) if s else 0.0, "solved": solved,
                     "samples": len(s), "scores": s}
                done[key] = r
                lines.append(json.dumps(r) + "\n")
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(chunk))
    return {key: done[key] for key, _ in keyed}


def write_filtered(problems, results, out_path, k, report=print):
    """Keep problems solved sometimes but not always; tag difficulty; histogram."""
    kept, hist = [], Counter()
    rates = Counter()
    for i, p in enumerate(problems):
        r = results[problem_key(i, p)]
        rate = r["pass_rate"]
        rates[f"{r['solved']}/{r['samples']}"] += 1
        if r["solved"] == 0:
            hist["dropped_never_solved"] += 1
            continue
        if r["solved"] == r["samples"]:
            hist["dropped_always_solved"] += 1
            continue
        tag = difficulty(rate)
        hist[tag] += 1
        kept.append(dict(p, pass_rate=rate, difficulty=tag))
    write_jsonl(out_path, kept)
    histogram = {"problems": len(problems), "kept": len(kept), "k": k,
                 "difficulty": {t: hist[t] for t in ("easy", "medium", "hard",
                                                     "dropped_always_solved", "dropped_never_solved")},
                 "solved_of_k": dict(sorted(rates.items(), key=lambda kv: int(kv[0].split("/")[0])))}
    with open(out_path + ".hist.json", "w", encoding="utf-8") as f:
        json.dump(histogram, f, indent=2)
    width = max(histogram["difficulty"].values()) or 1
    report(f"kept {len(kept)} of {len(problems)} problems -> {out_path}")
    for t, n in histogram["difficulty"].items():
        report(f"  {t:>22} {n:6d} " + "#" * round(40 * n / width))
    return histogram


def filter_command(args, report=print):
    import evaluate
    problems = evaluate.load_jsonl(args.data)
    if args.limit:
        problems = problems[: args.limit]
    model, tokenizer = evaluate.load_checkpoint(args.model)
    results = filter_problems(model, tokenizer, problems, args.out + ".results.jsonl", k=args.k,
                              batch=args.batch, temperature=args.temperature, top_p=args.top_p,
                              max_response_tokens=args.max_response_tokens,
                              max_turns=args.max_turns, seed=args.seed, report=report)
    return write_filtered(problems, results, args.out, args.k, report)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("sft", "rl", "eval", "all"):
        p = sub.add_parser(name, help=f"convert {HUB.get(name, 'all three datasets')}")
        p.add_argument("--out", default="data", help="output directory (default: data)")
        if name != "all":
            p.add_argument("--source", default=HUB[name],
                           help=f"hub dataset id, local directory or file (default: {HUB[name]})")
    p = sub.add_parser("filter", help="model-aware filtering of RL problems")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--data", required=True, help="project-format RL jsonl")
    p.add_argument("--out", required=True, help="filtered jsonl to write")
    p.add_argument("--k", type=int, default=8, help="samples per problem (paper: 8)")
    p.add_argument("--batch", type=int, default=16, help="problems per rollout call")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-response-tokens", type=int, default=20480)
    p.add_argument("--max-turns", type=int, default=16)
    p.add_argument("--limit", type=int, default=0, help="first N problems only")
    p.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    if args.command == "filter":
        filter_command(args)
    elif args.command == "all":
        prepare_sft(HUB["sft"], args.out)
        prepare_rl(HUB["rl"], args.out)
        prepare_eval(HUB["eval"], args.out)
    else:
        {"sft": prepare_sft, "rl": prepare_rl, "eval": prepare_eval}[args.command](args.source, args.out)


if __name__ == "__main__":
    main()
