"""data/prepare.py: the paper's datasets -> the project's jsonl formats (docs/CONTRACTS.md).

    python data/prepare.py {sft,rl,eval,all} --out data  # HUB -> data/{sft,rl}.jsonl, data/eval/
    python data/prepare.py eval --source code_generation_lite/test6.jsonl --lcb_start 2025-02-01

--source: a hub dataset id, a local .parquet, .jsonl or .json file or a folder of them. Eval also
reads raw GPQA and raw livecodebench/code_generation_lite rows (those in the paper's v6 window). A
bad row stops the run with one line: file, row, field, what is wrong. Departure: each 30K row gets
its own data_source's prompt; upstream gives a parquet file's rows the prompt of its first row's.
"""

import argparse
import base64
import datetime
import io
import json
import os
import pickle
import random
import re
import sys
import zlib
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
from data import prompts  # noqa: E402

HUB = {"sft": "Gen-Verse/Open-AgentRL-SFT-3K", "rl": "Gen-Verse/Open-AgentRL-30K",
       "eval": "Gen-Verse/Open-AgentRL-Eval"}
ROW_FILES = (".parquet", ".jsonl", ".json")
GROUND_TRUTH = "reward_model.ground_truth"
MAX_DECOMPRESSED = 1 << 30  # LiveCodeBench's largest test blobs are far below 1 GiB
LCB_WINDOW = (datetime.date(2025, 2, 1), datetime.date(2025, 5, 31))  # the paper's LCB v6 slice
BENCHMARKS = (("aime24", "aime(20)?24"), ("aime25", "aime(20)?25"), ("gpqa", "gpqa"),
              ("lcb", "livecodebench|lcb|codegenerationlite"))


class DataError(SystemExit):  # a malformed row stops the run with this one line
    def __init__(self, where, field, what):
        super().__init__(f"{where}: field '{field}': {what}")


def source_rows(source):
    """(row, "file: row i", path from the source's parent) per row of a file, folder or hub id."""
    top, files = source, [source]
    if not os.path.isfile(source):
        top, files = source if os.path.isdir(source) else download(source), []
        for d, dirs, names in os.walk(top):
            dirs[:] = sorted(x for x in dirs if not x.startswith("."))  # skip .cache, .git
            files += [os.path.join(d, n) for n in sorted(names) if n.endswith(ROW_FILES)]
        if not files:
            raise SystemExit(f"{source}: no .parquet, .jsonl or .json files found")
    root = os.path.dirname(os.path.abspath(top))  # top's own name tells the benchmark too
    for path in files:
        for i, row in read_rows(path):
            if not isinstance(row, dict):
                raise SystemExit(f"{path}: row {i}: not an object")
            yield row, f"{path}: row {i}", os.path.relpath(path, root)


def download(repo_id):
    if not re.fullmatch(r"[\w-]+/[\w.-]+", repo_id):
        raise SystemExit(f"{repo_id}: no such file or directory")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id=repo_id, repo_type="dataset",
                                 allow_patterns=["*" + e for e in ROW_FILES])
    except ImportError:
        raise SystemExit("downloading needs huggingface_hub (pip install huggingface_hub), "
                         "or pass --source DIR")
    except Exception as e:
        why = f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0]
        raise SystemExit(f"could not download {repo_id} from the Hugging Face hub ({why}); "
                         "download it elsewhere and pass --source DIR")


def read_rows(path):
    """(row number from 1, row) of a .parquet, .jsonl or .json file."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                             "or convert it to .jsonl")
        batches = pq.ParquetFile(path).iter_batches(batch_size=64)
        yield from enumerate((r for b in batches for r in b.to_pylist()), 1)
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:  # streamed: raw LiveCodeBench files are gigabytes
            for i, line in enumerate(f, 1):
                if line.strip():
                    yield i, loads(line, f"{path}: row {i}")
    else:
        with open(path, encoding="utf-8") as f:
            rows = loads(f.read(), path)
        if not isinstance(rows, list):
            raise SystemExit(f"{path}: a .json source must hold a list of rows")
        yield from enumerate(rows, 1)


def loads(text, where):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{where}: not JSON ({e.msg}, line {e.lineno})")


def write_jsonl(path, records):
    """Through a temporary file and a rename, so a crash never leaves half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(path + ".tmp", path)


def need(row, name, where, types=str):
    if row.get(name) is None:
        raise DataError(where, name, "missing")
    if not isinstance(row[name], types):
        raise DataError(where, name, f"unexpected type {type(row[name]).__name__}")
    return row[name]


def json_field(value, where, field):
    """Upstream files hold nested fields as structs or as JSON text; accept both."""
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise DataError(where, field, f"not valid JSON ({e.msg})")


def drop_none(x):
    """Parquet struct columns fill absent keys with None (one schema for all rows)."""
    if isinstance(x, dict):
        return {k: drop_none(v) for k, v in x.items() if v is not None}
    return [drop_none(v) for v in x] if isinstance(x, list) else x


class PlainUnpickler(pickle.Unpickler):
    """Refuses every class or function reference (the way a pickle runs code): plain data only."""
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain data is allowed")


def lcb_tests(value, where, field):
    """LiveCodeBench tests (JSON, or base64 of zlib of a pickle of JSON) -> (cases, test types)."""
    items = value or []
    try:
        items = json.loads(items) if isinstance(items, str) else items
    except json.JSONDecodeError:
        items = json_field(unpickle_blob(items, where, field), where, field)
    try:  # plain data only: a tuple, set, bytes or non-string key fails a JSON round trip
        plain = json.loads(json.dumps(items)) == items and isinstance(items, list)
    except (TypeError, ValueError, RecursionError):
        plain = False
    if not plain or not all(isinstance(c, dict) and isinstance(c.get("input"), str)
                            and isinstance(c.get("output"), str) for c in items):
        raise DataError(where, field, "expected a list of {'input': str, 'output': str, "
                        "'testtype': ...}, only plain data is allowed")
    cases = [{"input": c["input"], "output": c["output"]} for c in items]
    return cases, {c.get("testtype") for c in items}


def unpickle_blob(value, where, field):
    try:
        d = zlib.decompressobj()
        data = d.decompress(base64.b64decode(value, validate=True), MAX_DECOMPRESSED)
        if d.unconsumed_tail:  # a zip bomb would otherwise fill the memory
            raise ValueError(f"decompresses past {MAX_DECOMPRESSED} bytes")
        obj = PlainUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise DataError(where, field,
                        f"neither JSON nor base64+zlib+pickle ({type(e).__name__}: {e})")
    return obj.decode("utf-8", errors="replace") if isinstance(obj, bytes) else obj


def code_tests(gt, where, field=GROUND_TRUTH):
    """verl code ground truth -> the three test shapes of CONTRACTS.md."""
    gt = json_field(gt, where, field)
    if not isinstance(gt, dict):
        raise DataError(where, field, f"expected an object, got {type(gt).__name__}")
    if "inputs" not in gt and {"test_code", "entry_point", "import_prefix"} & gt.keys():  # asserts
        for key in ("test_code", "entry_point"):
            if not isinstance(gt.get(key), str) or not gt[key].strip():
                raise DataError(where, f"{field}.{key}",
                                "missing (assert-style tests need test_code and entry_point)")
        return {"fn_name": None, "cases": [], "import_prefix": gt.get("import_prefix") or "",
                "test_code": gt["test_code"], "entry_point": gt["entry_point"]}
    ins, outs, fn = gt.get("inputs"), gt.get("outputs"), gt.get("fn_name") or None
    if not isinstance(ins, list) or not isinstance(outs, list) or not ins or len(ins) != len(outs):
        raise DataError(where, field, "needs lists 'inputs' and 'outputs' of one non-zero length")
    if fn is None:  # stdin programs; a list of lines is one text
        ins, outs = ([("\n".join(map(str, x)) if isinstance(x, list) else x) for x in xs]
                     for xs in (ins, outs))
        if not all(isinstance(x, str) for x in ins + outs):
            raise DataError(where, field + ".inputs", "stdin tests need text inputs and outputs")
    elif all(isinstance(i, str) for i in ins):  # LiveCodeBench: already one JSON argument a line
        outs = [o if isinstance(o, str) else json.dumps(o) for o in outs]
    elif all(isinstance(i, list) for i in ins):  # TACO / APPS: each output in a list, [48]
        cases = [{"input": "\n".join(json.dumps(a) for a in i), "output": json.dumps(o)}
                 for i, o in zip(ins, outs)]
        return {"fn_name": fn, "wrapped": True, "cases": cases}
    else:
        raise DataError(where, field + ".inputs", "call-based inputs must all be argument lists")
    return {"fn_name": fn, "cases": [{"input": i, "output": o} for i, o in zip(ins, outs)]}


def convert_sft(row, where):
    msgs = json_field(need(row, "messages", where, (list, str)), where, "messages")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(where, "messages", "expected a non-empty list of messages")
    out = []
    for j, m in enumerate(msgs):
        f = f"messages[{j}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise DataError(where, f + ".role", "not one of system, user, assistant, tool")
        if not isinstance(m.get("content") or "", str):
            raise DataError(where, f + ".content", "not a string")
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if calls := json_field(m.get("tool_calls"), where, f + ".tool_calls"):
            msg["tool_calls"] = [tool_call(c, where, f"{f}.tool_calls[{k}]")
                                 for k, c in enumerate(calls)]
        msg |= {k: m[k] for k in ("name", "tool_call_id") if isinstance(m.get(k), str) and m[k]}
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(where, "messages", "no assistant message to train on")
    tools = json_field(need(row, "tools", where, (list, str)), where, "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(where, "tools", "expected a list of tool schemas")
    return {"messages": out, "tools": drop_none(tools)}


def tool_call(c, where, field):
    """An OpenAI tool call, its arguments as a dict (the SFT file has them as JSON text)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(where, field + ".function.name", "missing")
    args = json_field(fn.get("arguments"), where, field + ".function.arguments")
    if not isinstance(args, dict):
        raise DataError(where, field + ".function.arguments", "expected an object")
    call = {"type": "function", "function": {"name": fn["name"], "arguments": drop_none(args)}}
    return dict(call, id=c["id"]) if isinstance(c.get("id"), str) and c["id"] else call


def ground_truth(row, where):
    rm = json_field(need(row, "reward_model", where, (dict, str)), where, "reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise DataError(where, GROUND_TRUTH, "missing")
    return rm["ground_truth"]


def convert_rl(row, where):
    source = need(row, "data_source", where)
    msgs = json_field(need(row, "prompt", where, (list, str)), where, "prompt")
    turns = {}  # role -> the first message of that role with text
    for m in msgs if isinstance(msgs, list) else []:
        if isinstance(m, dict) and isinstance(m.get("content"), str) and m["content"].strip():
            turns.setdefault(m.get("role"), m["content"])
    if "user" not in turns:
        raise DataError(where, "prompt", "no user message with text")
    gt = ground_truth(row, where)
    rec = dict(prompt=prompts.rl(turns["user"], source), answer=None, kind="code", source=source)
    if "code" in source.lower():  # upstream's compute_score sends these rows to the code grader
        rec["tests"] = code_tests(gt, where)
    else:
        gt = gt[0] if isinstance(gt, list) and len(gt) == 1 else gt
        if isinstance(gt, bool) or not isinstance(gt, (str, int, float)) or not str(gt).strip():
            raise DataError(where, GROUND_TRUTH, "expected a non-empty answer string")
        rec.update(kind="math", answer=str(gt).strip())
    if "system" in turns:
        rec["system"] = turns["system"]
    extra = json_field(row.get("extra_info"), where, "extra_info")
    if isinstance(extra, dict) and extra.get("index") is not None:
        rec["id"] = extra["index"]
    return rec


def benchmark_of(rel, row):
    """aime24|aime25|gpqa|lcb by layout, folder/file names or data_source, else from data_source."""
    if "question_content" in row or "Correct Answer" in row:
        return "lcb" if "question_content" in row else "gpqa"
    for part in re.split(r"[\\/]", rel)[::-1] + [str(row.get("data_source") or "")]:
        t = re.sub(r"[^a-z0-9]", "", part.lower())
        for name, pattern in BENCHMARKS:
            if re.search(pattern, t):
                return name
    name = str(row.get("data_source") or os.path.splitext(os.path.basename(rel))[0]).lower()
    return re.sub(r"[^a-z0-9_]+", "_", name).strip("_") or "other"


def convert_aime(row, where):
    problem = next((k for k in ("Problem", "problem") if row.get(k) is not None), "Problem")
    key = next((k for k in ("Answer", "answer") if row.get(k) is not None), "Answer")
    value = need(row, key, where, (str, int, float))
    s = str(int(value) if isinstance(value, float) and value.is_integer() else value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[+-]?\d+", s):  # "033" is 33
        raise DataError(where, key, f"AIME answer {s[:40]!r} is not an integer")
    rec = {"prompt": prompts.aime(need(row, problem, where)), "answer": int(s), "kind": "math"}
    ident = row.get("ID", row.get("id"))
    return rec if ident is None else dict(rec, id=ident)


def convert_gpqa(row, where):
    if row.get("Question") is not None:  # raw GPQA, the problem laid out as in the Eval file
        question = need(row, "Question", where)
        keys = ("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
        options = [str(need(row, k, where, (str, int, float))).strip() for k in keys]
        right = options[0]
        random.Random(zlib.crc32(question.encode())).shuffle(options)  # seed fixed by the question
        letter = "ABCD"[options.index(right)]
        problem = question.strip() + "\n" + "\n".join(f"({x}) {o}" for x, o in zip("ABCD", options))
        domain = need(row, "High-level domain", where)
    else:  # Open-AgentRL-Eval: the options are in the problem text already
        letter = str(need(row, "solution", where)).strip().strip("()").strip().rstrip(".").upper()
        if not re.fullmatch(r"[A-Z]", letter):
            raise DataError(where, "solution", f"{row['solution'][:40]!r} is not an option letter")
        problem, domain = need(row, "problem", where), need(row, "domain", where)
    return {"prompt": prompts.gpqa(problem, domain), "answer": letter, "kind": "choice"}


def convert_lcb(row, where, window):
    """An Open-AgentRL-Eval or raw code_generation_lite row; None when dated outside the window."""
    if "question_content" not in row:
        gt = json_field(ground_truth(row, where), where, GROUND_TRUTH)
        if not isinstance(gt, dict) or "inputs" not in gt:
            raise DataError(where, GROUND_TRUTH, "expected an object with inputs and outputs")
        tests = code_tests(gt, where)
        return {"prompt": prompts.lcb(need(row, "problem", where), gt["inputs"], gt["outputs"]),
                "answer": None, "kind": "code", "tests": tests}
    day = row.get("contest_date")  # ISO text in the real files; a datetime when pyarrow made it one
    try:
        if not isinstance(day, datetime.datetime):
            day = datetime.datetime.fromisoformat(str(day).strip())
    except ValueError:
        raise DataError(where, "contest_date", f"{str(day)[:40]!r} is not an ISO date")
    if not window[0] <= day.date() <= window[1]:
        return None
    public, k1 = lcb_tests(row.get("public_test_cases"), where, "public_test_cases")
    private, k2 = lcb_tests(row.get("private_test_cases"), where, "private_test_cases")
    if not public + private:
        raise DataError(where, "public_test_cases", "no test cases")
    fn = None
    if "functional" in k1 | k2:
        meta = json_field(row.get("metadata") or "{}", where, "metadata")
        fn = meta.get("func_name") if isinstance(meta, dict) else None   # a list, a string: none
        if not isinstance(fn, str) or not fn:
            raise DataError(where, "metadata.func_name", "missing for a functional problem")
    # upstream has no map for raw rows: map_lcb's template, the public tests as its examples
    prompt = prompts.lcb(need(row, "question_content", where), [c["input"] for c in public],
                         [c["output"] for c in public])
    tests = {"fn_name": fn, "cases": public + private}
    rec = dict(prompt=prompt, answer=None, kind="code", tests=tests,
               source=f"livecodebench/{row.get('platform') or 'unknown'}")
    return dict(rec, id=row["question_id"]) if row.get("question_id") is not None else rec


def prepare_sft(source, out_dir, report=print):
    path = os.path.join(out_dir, "sft.jsonl")
    write_jsonl(path, recs := [convert_sft(row, where) for row, where, _ in source_rows(source)])
    report(f"wrote {len(recs)} SFT conversations to {path}")
    return path


def prepare_rl(source, out_dir, report=print):
    path = os.path.join(out_dir, "rl.jsonl")
    write_jsonl(path, recs := [convert_rl(row, where) for row, where, _ in source_rows(source)])
    kinds = sorted(Counter(f"{r['kind']}/{r['source']}" for r in recs).items())
    report(f"wrote {len(recs)} RL problems to {path} ({', '.join(f'{k} {n}' for k, n in kinds)})")
    return path


def prepare_eval(source, out_dir, report=print, lcb_start=LCB_WINDOW[0], lcb_end=LCB_WINDOW[1]):
    convert = {"aime24": convert_aime, "aime25": convert_aime, "gpqa": convert_gpqa,
               "lcb": lambda row, where: convert_lcb(row, where, (lcb_start, lcb_end))}
    recs = []
    for row, where, rel in source_rows(source):
        bench = benchmark_of(rel, row)
        rec = convert.get(bench, convert_rl)(row, where)  # an unknown benchmark: the verl layout
        recs.append(rec and dict(rec, source=rec.get("source") or row.get("data_source") or bench,
                                 benchmark=bench))
    if None in recs:
        report(f"dropped {recs.count(None)} LiveCodeBench rows dated outside "
               f"{lcb_start} .. {lcb_end}")
    paths = {}
    for bench in sorted({r["benchmark"] for r in recs if r}):
        paths[bench] = os.path.join(out_dir, "eval", f"{bench}.jsonl")
        write_jsonl(paths[bench], rows := [r for r in recs if r and r["benchmark"] == bench])
        report(f"wrote {len(rows)} {bench} problems to {paths[bench]}")
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("command", choices=["sft", "rl", "eval", "all"], help="the dataset to convert")
    ap.add_argument("--source", help="hub dataset id, local directory or file (none: the command's "
                    "dataset: " + ", ".join(f"{k} {v}" for k, v in HUB.items()) + ")")
    ap.add_argument("--out", default="data", help="output directory")
    ap.add_argument("--lcb_start", type=datetime.date.fromisoformat, default=LCB_WINDOW[0],
                    help="first contest day kept from raw code_generation_lite rows")
    ap.add_argument("--lcb_end", type=datetime.date.fromisoformat, default=LCB_WINDOW[1],
                    help="last contest day kept (inclusive)")
    args = ap.parse_args(argv)
    if args.command == "all" and args.source:
        ap.error("'all' reads the three hub datasets; convert a local copy one command at a time")
    for name in ("sft", "rl", "eval") if args.command == "all" else (args.command,):
        window = {"lcb_start": args.lcb_start, "lcb_end": args.lcb_end} if name == "eval" else {}
        prepare = {"sft": prepare_sft, "rl": prepare_rl, "eval": prepare_eval}[name]
        prepare(args.source or HUB[name], args.out, **window)


if __name__ == "__main__":
    main()
