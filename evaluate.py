"""evaluate.py: measure a checkpoint the way the paper does.

What it does
  Loads problems (the paper's benchmarks as written by `data/prepare.py eval`, or any jsonl
  in the project format), runs the agentic rollout (rollout.py: reasoning, code-tool calls
  in the sandbox, tool replies fed back) n times per problem, grades every response, and
  reports per benchmark and overall:
    avg@n    mean accuracy over all n samples (the paper's headline number, "average@32")
    pass@k   the unbiased estimator 1 - C(n-c, k) / C(n, k)  (k = 1 and n by default)
    maj@k    accuracy of the majority answer among the first k samples (math and choice)
    tool use tool calls per response, share of calls that ran without error, turns,
             response tokens, tokens before the first call and per call, finish reasons:
             the numbers behind the paper's deliberative-vs-reactive analysis
  LiveCodeBench's number is pass@1 over problems (a response counts when it passes every
  test), which is avg@n with the all-tests-pass criterion.

  Every trajectory goes to <out>/trajectories.jsonl (one file per rank under torchrun), the
  summary (with the config used) to <out>/summary.json, and a Markdown table laid out like
  the paper's Table 2 is printed. An interrupted run started again with the same --out
  skips the problems whose n trajectories are already in the file.

Graders (the public API, also used by rl.py and data/prepare.py filter)
  score_math(response, answer)      the paper's strict grader: the last \\boxed{...} (nested
                                    braces) within the last 100 characters of the final
                                    answer, Minerva-style normalisation of both sides,
                                    exact match
  score_choice(response, letter)    the boxed option letter, exact uppercase match
  score_code(response, tests)       the last ```python block of the final answer, run in
                                    the sandbox against every test; fraction passed
  score(problem, response)          dispatch on problem["kind"]
  The "final answer" is the text after the last tool response. Graders never raise and
  run in time linear in the response length.

Departures from the paper
  - The paper's strict grader compares the boxed string with the ground truth as is; this
    one normalises both sides first (\\dfrac -> \\frac, \\text{} and units dropped, "x = 5"
    -> "5", "1,000" -> "1000", spaces, zero-padded integers), so it is slightly more lenient.
  - The paper scored LiveCodeBench with the official LiveCodeBench harness on saved
    rollouts; here the same tests run in this project's sandbox (sandbox.run_tests).
  - maj@k ignores responses without an extractable answer (they do not vote).
  - "overall" is the unweighted mean over benchmarks.

Commands
  python evaluate.py --model DIR --benchmarks aime24,aime25,gpqa,lcb --n 32 \\
      --temperature 1.0 --top-p 0.6                      # the paper's protocol (defaults)
  python evaluate.py --model DIR --data FILE.jsonl --n 4 --limit 10    # any benchmark
  torchrun --nproc_per_node 8 evaluate.py -- --model DIR --n 32   # problems split across ranks
      (the "--" stops torchrun from reading --n as an abbreviation of its own --nnodes)
  python evaluate.py                                     # the toy task (see toy_arguments)
  Every field of EvalConfig below is an option: --name=value or --name value
  (--top-p and --top_p both work).
"""

import glob
import json
import math
import os
import re
import sys
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, fields


@dataclass
class EvalConfig:
    model: str = ""                     # checkpoint dir (Hugging Face layout)
    benchmarks: str = "aime24,aime25,gpqa,lcb"   # names of <data_dir>/<name>.jsonl
    data: str = ""                      # a project-format jsonl; replaces --benchmarks
    data_dir: str = "data/eval"         # where `data/prepare.py eval` wrote the benchmarks
    out: str = ""                       # output dir; default runs/eval/<model dir name>
    n: int = 32                         # samples per problem
    temperature: float = 1.0
    top_p: float = 0.6
    top_k: int = 0
    max_prompt_tokens: int = 2560
    max_response_tokens: int = 20480    # counts tool-reply tokens too, as in the paper
    max_turns: int = 16
    tool_output_chars: int = 256
    tool_timeout: float = 10.0
    tool_memory_mb: int = 1024
    code_test_timeout: float = 6.0      # per test case when grading code
    pass_k: str = ""                    # e.g. "1,8,32"; default 1 and n
    limit: int = 0                      # first N problems of each benchmark (0: all)
    problems_per_batch: int = 8         # problems per rollout call; also the resume step
    seed: int = 0
    dtype: str = ""                     # "" = bfloat16 on CUDA, float32 on CPU


def toy_arguments():
    """`python evaluate.py` alone: the toy pipeline's held-out set (written if missing) with the
    sampling settings `python rl.py` evaluates with, on the newest toy policy: the RL run's last
    checkpoint, else the SFT start rl.py would use (a `python sft.py` run, else the shipped one)."""
    import rl
    cfg = rl.parse_args([])
    rl.write_toy_problems(cfg)
    last = rl.latest_checkpoint(cfg)
    model = os.path.join(last, "model") if last else rl.toy_sft_start(cfg)
    if model is None:
        raise SystemExit("no toy checkpoint yet: run `python sft.py` or `python rl.py` first")
    print(f"evaluate.py: the toy task, {model} on {cfg.eval_data}")
    return [f"--model={model}", f"--data={cfg.eval_data}", f"--n={cfg.eval_n}",
            f"--temperature={cfg.eval_temperature}", f"--top_p={cfg.eval_top_p}",
            f"--max_prompt_tokens={cfg.max_prompt_tokens}", f"--max_response_tokens={cfg.max_response_tokens}",
            f"--max_turns={cfg.max_turns}", f"--out={os.path.join(os.path.dirname(cfg.out_dir), 'eval')}"]


BENCHMARK_TITLES = {  # Table 2 of the paper: (group, column title)
    "aime24": ("MATH", "AIME2024"),
    "aime25": ("MATH", "AIME2025"),
    "gpqa": ("Science", "GPQA-Diamond"),
    "lcb": ("Code", "LiveCodeBench-v6"),
}

# --------------------------------------------------------------------------------------
# answer extraction

BOX_WINDOW = 100  # the paper's strict grader only looks at the last 100 characters
END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def final_answer_text(response):
    """The part of a response after the last tool reply: the model's final answer turn."""
    if not isinstance(response, str):
        response = "" if response is None else str(response)
    cut = response.rfind("</tool_response>")
    text = response[cut + len("</tool_response>"):] if cut >= 0 else response
    # A decoded response may end with the end-of-turn token; it is not part of the answer.
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for m in END_MARKERS:
            if text.endswith(m):
                text = text[: -len(m)].rstrip()
                changed = True
    return text


def last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}) in text, braces balanced; None when
    there is none or the last one is never closed (no fallback to an earlier box)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j]
    return None


def boxed_answer(response, window=BOX_WINDOW):
    text = final_answer_text(response)
    return last_boxed(text[-window:] if window else text)


# --------------------------------------------------------------------------------------
# normalisation (Minerva-style, written for this project)

# Unit and filler words dropped when they follow a value ("5 cm", "12\text{ ways}").
UNIT_WORDS = (
    "degrees degree cm centimeters centimetres mm meters metres meter metre km kilometers "
    "inches inch feet foot ft miles mile mph hours hour hrs minutes minute mins seconds "
    "second sec dollars dollar cents cent units unit square sq ways points students "
    "people days day years year pounds lbs grams gram kg liters litres ml"
).split()
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_TEXT_UNIT = re.compile(_TEXT_CMD.pattern + r"(?:\^\{?[23]\}?)?")  # \text{cm}^2
_TRAILING_UNIT = re.compile(r"(?:\s|\\ |~)*(?<![A-Za-z\\])(?:" + "|".join(UNIT_WORDS) + r")\b(?:\^\{?[23]\}?)?\s*$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_INT = re.compile(r"^[+-]?\d+$")


# Short unit symbols, dropped only inside \text{} where they cannot be a variable.
TEXT_ONLY_UNITS = ("m", "s", "g", "h", "l", "min", "cm^2")


def _is_unit(words):
    words = words.strip().strip(".").lower()
    return words == "" or all(w in UNIT_WORDS or w in TEXT_ONLY_UNITS
                              for w in re.split(r"[\s~]+", words))


def normalize_math(answer):
    """Canonical string for exact matching. Bounded input: box contents are short."""
    s = str(answer)[:2000].strip()
    s = s.split("=")[-1]                                 # "x = 5" -> " 5"
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for t in ("^{\\circ}", "^\\circ", "\\circ", "\\%", "%", "\\$", "$", "\\!"):
        s = s.replace(t, "")
    # \text{...}: a unit after a value goes; any other text is unwrapped ("\text{(A)}").
    rest = _TEXT_UNIT.sub(lambda m: "" if _is_unit(m.group(1)) else m.group(0), s).strip()
    if rest and rest != s.strip():
        s = rest
    s = _TEXT_CMD.sub(lambda m: m.group(1), s)
    s = _TRAILING_UNIT.sub("", s)
    for t in ("\\,", "\\;", "\\:", "\\ ", "~"):
        s = s.replace(t, "")
    s = re.sub(r"\s+", "", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = s.replace("{,}", "")
    # shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt3 -> \sqrt{3}
    s = re.sub(r"\\frac([0-9a-zA-Z])([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt([0-9a-zA-Z])", r"\\sqrt{\1}", s)
    s = s.rstrip(".")
    if _INT.match(s):
        s = str(int(s))                                  # "033" -> "33", "+5" -> "5"
    return s


def normalize_choice(answer):
    s = _TEXT_CMD.sub(lambda m: m.group(1), str(answer)[:200])
    s = re.sub(r"[\s$]", "", s)
    s = s.strip("()[]{}.:*")
    return s


# --------------------------------------------------------------------------------------
# graders


def score_math(response, answer, window=BOX_WINDOW):
    """True when the last box of the final answer equals the ground truth after
    normalisation. Never raises."""
    try:
        boxed = boxed_answer(response, window)
        if boxed is None:
            return False
        pred = normalize_math(boxed)
        return pred != "" and pred == normalize_math(answer)
    except Exception:
        return False


def score_choice(response, letter, window=BOX_WINDOW):
    """True when the boxed option letter (wrappers such as (B), \\text{B} allowed) is the
    right one. Case matters: the prompt asks for the uppercase letter. Never raises."""
    try:
        boxed = boxed_answer(response, window)
        if boxed is None:
            return False
        return normalize_choice(boxed) == str(letter).strip().strip("()").upper()
    except Exception:
        return False


_FENCE_OPEN = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n", re.IGNORECASE)


def extract_program(response):
    """The last complete ```python block of the final answer, or None. Linear time: only
    the last two opening fences can matter (a later unclosed block falls back to the one
    before it, which is closed by construction)."""
    text = final_answer_text(response)
    opens = [m.end() for m in _FENCE_OPEN.finditer(text)]
    for start in reversed(opens[-2:]):
        end = text.find("```", start)
        if end >= 0:
            return text[start:end]
    return None


def score_code(response, tests, timeout=6.0):
    """Fraction of tests the program in the final answer passes (1.0 = solved). Never
    raises; runs each test in the sandbox with `timeout` seconds."""
    try:
        cases = tests["cases"]
        if not cases:
            return 0.0
        program = extract_program(response)
        if program is None or not program.strip():
            return 0.0
        import sandbox
        results = sandbox.run_tests(program, tests, timeout=timeout)
        return sum(1 for r in results if r) / len(cases)
    except Exception:
        return 0.0


def score(problem, response, code_timeout=6.0):
    """1.0 / 0.0 for math and choice, the fraction of tests passed for code."""
    try:
        kind = problem.get("kind")
        if kind == "math":
            return float(score_math(response, problem["answer"]))
        if kind == "choice":
            return float(score_choice(response, problem["answer"]))
        if kind == "code":
            return score_code(response, problem["tests"], timeout=code_timeout)
    except Exception:
        pass
    return 0.0


def extract_pred(problem, response):
    """The normalised answer a response gives (what maj@k votes on); None for code or when
    there is no box."""
    try:
        if problem.get("kind") == "code":
            return None
        boxed = boxed_answer(response)
        if boxed is None:
            return None
        return normalize_choice(boxed) if problem.get("kind") == "choice" else normalize_math(boxed)
    except Exception:
        return None


# --------------------------------------------------------------------------------------
# metrics


def pass_at_k(n, c, k):
    """Unbiased pass@k (Chen et al. 2021): chance that k of the n samples, drawn without
    replacement, hold at least one of the c correct ones. Product form, no big binomials."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def maj_at_k(preds, corrects, k):
    """1.0 when the most frequent answer among the first k samples is right. Samples without
    an answer do not vote; ties go to the answer seen first."""
    votes = Counter()
    first = {}
    for i, p in enumerate(preds[:k]):
        if p is None:
            continue
        votes[p] += 1
        first.setdefault(p, i)
    if not votes:
        return 0.0
    best = max(votes, key=lambda p: (votes[p], -first[p]))
    return 1.0 if corrects[first[best]] else 0.0


def tool_stats(records):
    """Tool-use statistics over a list of graded trajectory records."""
    m = len(records)
    if m == 0:
        return {}
    calls = [r["num_tool_calls"] for r in records]
    statuses = [s for r in records for s in r["call_status"]]
    with_calls = [r for r in records if r["num_tool_calls"] > 0]
    total_calls = sum(calls)
    status_count = Counter(statuses)
    finish = Counter(r["finish_reason"] for r in records)
    return {
        "tool_calls_per_response": total_calls / m,
        "responses_with_tool_calls": len(with_calls) / m,
        "tool_call_success": status_count["ok"] / total_calls if total_calls else None,
        "tool_call_status": {k: v / total_calls for k, v in sorted(status_count.items())},
        "turns": sum(r["num_turns"] for r in records) / m,
        "response_tokens": sum(r["response_tokens"] for r in records) / m,
        "tokens_before_first_call": (sum(r["tokens_before_first_call"] for r in with_calls)
                                     / len(with_calls)) if with_calls else None,
        "tokens_per_call": (sum(r["sampled_tokens"] for r in with_calls) / total_calls)
                           if total_calls else None,
        "finish_reasons": {k: v / m for k, v in sorted(finish.items())},
    }


def summarize(records, pass_k=None):
    """Per-benchmark and overall metrics from graded records (one per trajectory)."""
    by_bench = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_bench[r["benchmark"]][r["uid"]].append(r)
    out = {}
    for bench in sorted(by_bench):
        problems = by_bench[bench]
        groups = [sorted(g, key=lambda r: r["sample_index"]) for g in problems.values()]
        n = min(len(g) for g in groups)
        ks = sorted({k for k in (pass_k or [1, n]) if 0 < k <= n})
        kind = groups[0][0]["kind"]
        flat = [r for g in groups for r in g]
        res = {
            "kind": kind,
            "problems": len(groups),
            "samples": len(flat),
            "n": n,
            f"avg@{n}": sum(r["correct"] for r in flat) / len(flat),
            "mean_score": sum(r["score"] for r in flat) / len(flat),
        }
        for k in ks:
            res[f"pass@{k}"] = sum(
                pass_at_k(len(g), sum(r["correct"] for r in g), k) for g in groups) / len(groups)
        if kind != "code":
            for k in ks:
                res[f"maj@{k}"] = sum(
                    maj_at_k([r["pred"] for r in g], [r["correct"] for r in g], k)
                    for g in groups) / len(groups)
        res["tools"] = tool_stats(flat)
        out[bench] = res
    overall = {}
    if out:
        keys = set().union(*(set(v) for v in out.values()))
        for key in sorted(keys):
            if re.match(r"^(avg|pass|maj)@\d+$", key) or key == "mean_score":
                vals = [v[key] for v in out.values() if key in v]
                overall[key] = sum(vals) / len(vals)
        overall["headline"] = sum(headline(v) for v in out.values()) / len(out)
        overall["problems"] = sum(v["problems"] for v in out.values())
        overall["samples"] = sum(v["samples"] for v in out.values())
        overall["tools"] = tool_stats(records)
    return {"benchmarks": out, "overall": overall}


def headline(bench_summary):
    """The number the paper reports: avg@n (LiveCodeBench: pass@1, the same quantity)."""
    return bench_summary[f"avg@{bench_summary['n']}"]


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x):
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


def markdown_table(summary, name="model"):
    """Table 2 of the paper (one row, this model), then the details per benchmark."""
    benches = list(summary["benchmarks"])
    known = [b for b in BENCHMARK_TITLES if b in benches]
    order = known + [b for b in benches if b not in BENCHMARK_TITLES]
    groups, titles = [], []
    last_group = None
    for b in order:
        group, title = BENCHMARK_TITLES.get(b, ("Other", b))
        groups.append(f"**{group}**" if group != last_group else "")
        last_group = group
        titles.append(f"**{title}**")
    lines = [
        "| | " + " | ".join(groups) + " |",
        "|---|" + "---|" * len(order),
        "| **Method** | " + " | ".join(titles) + " |",
        "| *Agentic Reasoning* |" + " |" * len(order),
        f"| {name} | " + " | ".join(_pct(headline(summary["benchmarks"][b])) for b in order) + " |",
        "",
    ]
    cols = ["benchmark", "problems", "n", "avg@n", "pass@1", "pass@n", "maj@n", "calls/resp",
            "call ok", "turns", "resp tok", "tok before 1st call", "tok/call", "finish"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for b in order:
        s = summary["benchmarks"][b]
        t = s["tools"]
        n = s["n"]
        finish = ", ".join(f"{k} {100 * v:.0f}%" for k, v in t["finish_reasons"].items())
        row = [b, s["problems"], n, _pct(s[f"avg@{n}"]), _pct(s.get("pass@1")),
               _pct(s.get(f"pass@{n}")), _pct(s.get(f"maj@{n}")),
               _num(t["tool_calls_per_response"]), _pct(t["tool_call_success"]),
               _num(t["turns"]), _num(t["response_tokens"]),
               _num(t["tokens_before_first_call"]), _num(t["tokens_per_call"]), finish]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    lines.append("")
    lines.append("avg@n, pass@k, maj@k and call ok in %; LiveCodeBench's headline is pass@1.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# problems and records

HEAVY_KEYS = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "text")


def load_jsonl(path):
    """Project-format problems; a malformed line stops with file, line and reason."""
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: line {lineno}: not JSON ({e.msg})")
            why = check_problem(p)
            if why:
                raise SystemExit(f"{path}: line {lineno}: {why}")
            problems.append(p)
    return problems


def check_problem(p):
    """What is wrong with a project-format problem, or '' when nothing is."""
    if not isinstance(p, dict):
        return "a record must be a JSON object"
    if not isinstance(p.get("prompt"), str) or not p["prompt"]:
        return "field 'prompt': missing or not a non-empty string"
    kind = p.get("kind")
    if kind not in ("math", "choice", "code"):
        return f"field 'kind': {kind!r} is not math, choice or code"
    if kind in ("math", "choice") and p.get("answer") in (None, ""):
        return "field 'answer': missing"
    if kind == "code":
        t = p.get("tests")
        if not isinstance(t, dict) or not isinstance(t.get("cases"), list) or not t["cases"]:
            return "field 'tests': needs {'fn_name': ..., 'cases': [{'input', 'output'}, ...]}"
    return ""


def load_problems(cfg):
    """Problems with 'benchmark' and a stable 'uid' added (uid = benchmark:index, the key
    that resuming matches on)."""
    if cfg.data:
        sources = [(None, cfg.data)]
    else:
        names = [b.strip() for b in cfg.benchmarks.split(",") if b.strip()]
        sources = [(b, os.path.join(cfg.data_dir, f"{b}.jsonl")) for b in names]
    problems = []
    for bench, path in sources:
        if not os.path.exists(path):
            hint = "" if cfg.data else " (write it with: python data/prepare.py eval --out data)"
            raise SystemExit(f"benchmark file {path} not found{hint}")
        rows = load_jsonl(path)
        count = defaultdict(int)
        for p in rows:
            b = bench or p.get("benchmark") or p.get("source") or os.path.splitext(os.path.basename(path))[0]
            i = count[b]
            count[b] += 1
            if cfg.limit and i >= cfg.limit:
                continue
            problems.append(dict(p, benchmark=b, uid=p.get("uid") or f"{b}:{i}"))
    return problems


def grade_trajectory(problem, traj, cfg):
    """A trajectory dict plus what the summary needs, computed once and stored alongside
    (so resumed runs and files written without token ids still summarise)."""
    text = traj.get("text", "")
    s = score(problem, text, code_timeout=cfg.code_test_timeout)
    mask = traj.get("loss_mask") or []
    calls = traj.get("tool_calls") or []
    if calls:
        first_forced = mask.index(0) if 0 in mask else len(mask)
    else:
        first_forced = 0
    rec = dict(traj)
    rec.update(
        uid=problem["uid"],
        benchmark=problem["benchmark"],
        kind=problem["kind"],
        score=s,
        correct=s >= 1.0,
        pred=extract_pred(problem, text),
        num_tool_calls=len(calls),
        call_status=[c.get("status") for c in calls],
        response_tokens=len(traj.get("response_ids") or []),
        sampled_tokens=sum(mask),
        tokens_before_first_call=first_forced,
    )
    return rec


def light(rec):
    return {k: v for k, v in rec.items() if k not in HEAVY_KEYS}


def read_done(paths, n):
    """uid -> list of n light records, from earlier trajectory files. A torn last line (the
    run was killed while writing) is skipped; a problem with fewer than n samples is redone."""
    seen = defaultdict(dict)
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and "uid" in rec:
                    seen[rec["uid"]][rec["sample_index"]] = light(rec)
    return {uid: [s[i] for i in range(n)] for uid, s in seen.items()
            if all(i in s for i in range(n))}


def dist_info():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return 0, 1


def rollout_config(cfg):
    import rollout
    return rollout.RolloutConfig(
        n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        max_prompt_tokens=cfg.max_prompt_tokens, max_response_tokens=cfg.max_response_tokens,
        max_turns=cfg.max_turns, tool_output_chars=cfg.tool_output_chars,
        tool_timeout=cfg.tool_timeout, tool_memory_mb=cfg.tool_memory_mb, seed=cfg.seed)


def evaluate(model, tokenizer, problems, config, out_dir=None, progress=True):
    """Roll out, grade and summarise. Returns (trajectory dicts, summary).

    problems: project-format dicts; 'benchmark' (default: 'source' or 'data') and 'uid'
    (default: benchmark:index) are filled in when missing. config: an EvalConfig (or any
    object with its fields). Under torch.distributed every rank takes problems[rank::world],
    the graded records are gathered, and every rank returns the same summary; the
    trajectories returned are this rank's. With out_dir, trajectories are appended to
    out_dir/trajectories[.rankR].jsonl as each batch finishes, and problems already complete
    there are not run again (their records come back without token ids).
    """
    import dataclasses
    import rollout
    import sandbox
    import torch
    from tqdm import tqdm

    cfg = config
    rank, world = dist_info()
    count = defaultdict(int)
    items = []
    for p in problems:
        b = p.get("benchmark") or p.get("source") or "data"
        uid = p.get("uid") or f"{b}:{count[b]}"
        count[b] += 1
        items.append(dict(p, benchmark=b, uid=uid))
    mine = items[rank::world]

    done, traj_file = {}, None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        done = read_done(sorted(glob.glob(os.path.join(out_dir, "trajectories*.jsonl"))), cfg.n)
        name = "trajectories.jsonl" if world == 1 else f"trajectories.rank{rank}.jsonl"
        traj_file = open(os.path.join(out_dir, name), "a", encoding="utf-8")

    records = [r for p in mine if p["uid"] in done for r in done[p["uid"]]]
    todo = [p for p in mine if p["uid"] not in done]
    rcfg = rollout_config(cfg)
    bs = max(1, cfg.problems_per_batch)
    bar = tqdm(total=len(todo), desc=f"eval rank {rank}" if world > 1 else "eval",
               disable=not progress or rank != 0, unit="problem")
    try:
        for start in range(0, len(todo), bs):
            batch = todo[start:start + bs]
            # a seed per batch from its first problem: reruns and resumes sample the same
            seed = None if cfg.seed is None else (cfg.seed * 1_000_003 + zlib.crc32(batch[0]["uid"].encode())) % 2**31
            with torch.no_grad():  # rl.py calls this with its training model
                trajs = rollout.rollout(model, tokenizer, batch, dataclasses.replace(rcfg, seed=seed),
                                        sandbox=sandbox)
            new = [grade_trajectory(batch[t.problem_index], t.to_dict(), cfg) for t in trajs]
            if traj_file:
                # one write per batch, then fsync: a kill leaves at most one torn line
                traj_file.write("".join(json.dumps(r) + "\n" for r in new))
                traj_file.flush()
                os.fsync(traj_file.fileno())
            records.extend(new)
            bar.update(len(batch))
    finally:
        bar.close()
        if traj_file:
            traj_file.close()

    lights = [light(r) for r in records]
    if world > 1:
        import torch.distributed as dist
        gathered = [None] * world
        dist.all_gather_object(gathered, lights)  # every rank gets the summary
        lights = [r for part in gathered for r in part]
    ks = [int(k) for k in str(cfg.pass_k).split(",") if k.strip()] if cfg.pass_k else None
    summary = summarize(lights, ks)
    return records, summary


# --------------------------------------------------------------------------------------
# command line


def load_checkpoint(path, dtype=""):
    """(model, tokenizer) from a Hugging Face checkpoint dir, on this rank's GPU or the CPU."""
    import torch
    from model import Transformer
    from transformers import AutoTokenizer
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if cuda else torch.float32)
    model = Transformer.from_pretrained(path, device=device, dtype=dt)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def parse_config(argv, cls=EvalConfig):
    """--name=value / --name value for every field of cls; '-' and '_' are the same."""
    types = {f.name: f.type for f in fields(cls)}
    values = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # torchrun's separator, harmless here
            i += 1
            continue
        if arg in ("-h", "--help"):
            print(__doc__)
            for f in fields(cls):
                print(f"  --{f.name}={f.default!r}")
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise SystemExit(f"unexpected argument {arg!r} (options look like --name=value)")
        key, eq, val = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in types:
            raise SystemExit(f"unknown option --{key}; known: " + ", ".join(types))
        if not eq:
            if types[key] is bool and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                val = "true"
            elif i + 1 < len(argv):
                i += 1
                val = argv[i]
            else:
                raise SystemExit(f"option --{key} needs a value")
        t = types[key]
        try:
            if t is bool:
                if val.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError
                values[key] = val.lower() in ("1", "true", "yes")
            else:
                values[key] = t(val)
        except ValueError:
            raise SystemExit(f"option --{key}: {val!r} is not a {t.__name__}")
        i += 1
    return cls(**values)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = toy_arguments()
    cfg = parse_config(argv)
    if not cfg.model:
        raise SystemExit("--model DIR is required (a Hugging Face checkpoint directory)")

    import torch
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    problems = load_problems(cfg)
    out_dir = cfg.out or os.path.join("runs", "eval", os.path.basename(os.path.normpath(cfg.model)))
    model, tokenizer = load_checkpoint(cfg.model, cfg.dtype)

    t0 = time.time()
    _, summary = evaluate(model, tokenizer, problems, cfg, out_dir=out_dir)
    if rank == 0:
        summary["config"] = asdict(cfg)
        summary["model"] = cfg.model
        summary["seconds"] = time.time() - t0
        with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        print(markdown_table(summary, os.path.basename(os.path.normpath(cfg.model))))
        print(f"\nwrote {out_dir}/summary.json and the trajectories beside it")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
