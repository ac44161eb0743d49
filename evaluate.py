"""evaluate.py: measure a checkpoint the way the paper does; graders shared with rl.py.

Runs the agentic rollout n times per problem (AIME24/25, GPQA-Diamond, LiveCodeBench v6 from
data/prepare.py, or any project-format jsonl); reports per benchmark avg@n (the headline;
LiveCodeBench's pass@1), unbiased pass@k, maj@k (samples without an answer do not vote), tool use
and, with --verl_metrics, verl's bootstrap maj@k/mean and best@k/mean. Trajectories go to
<out>/trajectories.jsonl (one per rank), the summary to <out>/summary.json, Table 2's layout to
stdout; a rerun with the same --out skips finished problems. --filter_out FILE: the paper's
model-aware filtering (problems solved sometimes, tagged easy/medium/hard; FILE.hist.json).

    python evaluate.py --model DIR --benchmarks aime24,aime25,gpqa,lcb --n 32 \\
        --temperature 1.0 --top_p 0.6
    python evaluate.py --model DIR --data data/rl.jsonl --n 8 --top_p 1.0 \\
        --filter_out data/rl_filtered.jsonl
    torchrun --nproc_per_node 8 evaluate.py -- --model DIR --n 32      # problems split across ranks
    python evaluate.py                           # the toy task's held-out set, newest toy policy
    python evaluate.py --preset toy --model runs/toy/rl/step_000010 --n 4   # the toy, other flags

Departures from the paper: the math grader normalises both sides (\\dfrac, \\text{} units, "x = 5",
"1,000", "033") before its exact match; LiveCodeBench runs in this sandbox with lcb_runner's
comparison rules (machinery/code_grading.run_tests); "overall" is the unweighted mean of benchmarks.
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
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

from data import toy
from machinery import flags
from machinery.code_grading import run_tests  # the code grader's runner; evaluate.run_tests too
from machinery.final_answer import boxed_answer, final_answer_text, normalize_choice, normalize_math


@dataclass
class EvalConfig:
    model: str = ""                     # Hugging Face checkpoint directory
    benchmarks: str = "aime24,aime25,gpqa,lcb"   # <data_dir>/<name>.jsonl
    data: str = ""                      # a project-format jsonl; replaces --benchmarks
    data_dir: str = "data/eval"
    out: str = ""                       # default runs/eval/<model dir name>
    n: int = 32                         # samples per problem
    temperature: float = 1.0
    top_p: float = 0.6
    top_k: int = 0
    max_prompt_tokens: int = 2560
    max_response_tokens: int = 20480    # tool-reply tokens count too
    max_turns: int = 16
    max_parallel_calls: int = 1
    tool_output_chars: int = 256
    tool_timeout: float = 10.0
    tool_memory_mb: int = 1024
    enable_thinking: str = "default"    # Qwen3 hybrid template: default (its own) | true | false
    code_test_timeout: float = 6.0      # per test case
    pass_k: str = ""                    # e.g. "1,8,32"; default 1 and n
    verl_metrics: bool = False          # also verl's bootstrap maj@k/mean and best@k/mean
    limit: int = 0                      # first N problems of each benchmark (0: all)
    problems_per_batch: int = 0         # per rollout call, the unit of resuming (0: 256 samples)
    filter_out: str = ""                # model-aware filtering: write the kept problems here
    seed: int = 0
    dtype: str = ""                     # "" = bfloat16 on CUDA, float32 on CPU
    attn_backend: str = "auto"          # auto (flash-attn on CUDA if it imports) | sdpa | flash
    sandbox_workers: int = 0            # sandbox processes (0: this rank's share of the cores)
    sandbox_require: str = "default"    # default: run uid or Landlock, else stop | floor | all
    wandb_project: str = ""             # log config and summary to Weights & Biases ("": off)
    wandb_run: str = ""                 # the wandb run's name ("": wandb's own)


BENCHMARK_TITLES = {  # Table 2's (group, column) per benchmark
    "aime24": ("MATH", "AIME2024"), "aime25": ("MATH", "AIME2025"),
    "gpqa": ("Science", "GPQA-Diamond"), "lcb": ("Code", "LiveCodeBench-v6")}

# graders: never raise, linear in the response length
def score_math(response, answer):
    """The last box of the final answer equals the ground truth after normalisation."""
    try:
        pred = extract_pred({"kind": "math"}, response)
        return pred not in (None, "") and pred == normalize_math(answer)
    except Exception:
        return False


def score_choice(response, letter):
    """The boxed option letter is the right one ((B), \\text{B} allowed; uppercase, as asked)."""
    try:
        pred = extract_pred({"kind": "choice"}, response)
        return pred is not None and pred == str(letter).strip().strip("()").upper()
    except Exception:
        return False


def extract_program(response):
    """The final answer's last complete ```python block (an unclosed last one: the one before)."""
    text = final_answer_text(response)
    fences = re.finditer(r"```[ \t]*(?:python3?|py)[ \t]*\n", text, re.IGNORECASE)
    for start in reversed([m.end() for m in fences][-2:]):
        end = text.find("```", start)
        if end >= 0:
            return text[start:end]
    return None


def score_code(response, tests, timeout=6.0):
    """The fraction of tests the final answer's program passes (1.0 = solved), in the sandbox."""
    try:  # no program: run_tests fails every test unrun
        results = run_tests(extract_program(response), tests, timeout=timeout)
        return sum(results) / len(results) if results else 0.0
    except Exception:
        return 0.0


def score(problem, response, code_timeout=6.0):
    """1.0 / 0.0 for math and choice, the fraction of tests passed for code."""
    try:
        if problem["kind"] == "code":
            return score_code(response, problem["tests"], timeout=code_timeout)
        grader = {"math": score_math, "choice": score_choice}[problem["kind"]]
        return float(grader(response, problem["answer"]))
    except Exception:  # an unknown kind or a missing field scores 0
        return 0.0


def extract_pred(problem, response):
    """The normalised answer a response gives (what maj@k votes on); None for code or no box."""
    try:
        kind = problem.get("kind")
        boxed = None if kind == "code" else boxed_answer(response)
        if boxed is None:
            return None
        return normalize_choice(boxed) if kind == "choice" else normalize_math(boxed)
    except Exception:
        return None


def pass_at_k(n, c, k):
    """Unbiased pass@k, 1 - C(n-c, k) / C(n, k), in product form (no big binomials)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    return 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def maj_at_k(preds, corrects, k):
    """1.0 when the first k samples' most frequent answer is right. No answer, no vote; a tie goes
    to the answer seen first (most_common keeps insertion order)."""
    votes = Counter(p for p in preds[:k] if p is not None)
    return float(corrects[preds.index(votes.most_common(1)[0][0])]) if votes else 0.0


def verl_bootstrap(preds, corrects, k, draws=1000, seed=42):
    """verl's process_validation_metrics: (maj@k/mean, best@k/mean) over `draws` draws of k indices
    with replacement; no answer votes as "", the first most frequent scores its first occurrence."""
    import numpy as np
    rng = np.random.RandomState(seed)
    maj = best = 0.0
    for _ in range(draws):
        idx = rng.choice(len(preds), size=k, replace=True)
        vals = defaultdict(list)
        for i in idx:
            vals["" if preds[i] is None else preds[i]].append(corrects[i])
        maj += float(max(vals.values(), key=len)[0])
        best += float(max(corrects[i] for i in idx))
    return maj / draws, best / draws


def tool_stats(records):
    m = len(records)  # not 0: summarize calls it only with records
    statuses = Counter(s for r in records for s in r["call_status"])
    calls = sum(statuses.values())
    with_calls = [r for r in records if r["num_tool_calls"]]
    return {"tool_calls_per_response": calls / m,
            "responses_with_tool_calls": len(with_calls) / m,
            "tool_call_success": statuses["ok"] / calls if calls else None,
            "tool_call_status": {k: v / calls for k, v in sorted(statuses.items())},
            "turns": sum(r["num_turns"] for r in records) / m,
            "response_tokens": sum(r["response_tokens"] for r in records) / m,
            "tokens_before_first_call": (sum(r["tokens_before_first_call"] for r in with_calls)
                                         / len(with_calls) if with_calls else None),
            "tokens_per_call": (sum(r["sampled_tokens"] for r in with_calls) / calls
                                if calls else None),
            "finish_reasons": {k: v / m for k, v in
                               sorted(Counter(r["finish_reason"] for r in records).items())}}


def summarize(records, pass_k=None, verl=False):
    """Per-benchmark and overall metrics from graded records (one per trajectory)."""
    by_bench = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_bench[r["benchmark"]][r["uid"]].append(r)
    out = {}
    for bench in sorted(by_bench):
        groups = [sorted(g, key=lambda r: r["sample_index"]) for g in by_bench[bench].values()]
        n = min(map(len, groups))
        kind = groups[0][0]["kind"]
        flat = [r for g in groups for r in g]
        res = {"kind": kind, "problems": len(groups), "samples": len(flat), "n": n,
               f"avg@{n}": sum(r["correct"] for r in flat) / len(flat),
               "mean_score": sum(r["score"] for r in flat) / len(flat)}
        answers = [([r["pred"] for r in g], [r["correct"] for r in g]) for g in groups]
        for k in sorted({k for k in (pass_k or [1, n]) if 0 < k <= n}):
            res[f"pass@{k}"] = sum(pass_at_k(len(c), sum(c), k) for _, c in answers) / len(groups)
            if kind != "code":
                res[f"maj@{k}"] = sum(maj_at_k(p, c, k) for p, c in answers) / len(groups)
            if verl:
                both = [verl_bootstrap(p, c, k) for p, c in answers]
                if kind != "code":
                    res[f"verl_maj@{k}/mean"] = sum(b[0] for b in both) / len(groups)
                res[f"verl_best@{k}/mean"] = sum(b[1] for b in both) / len(groups)
        res["tools"] = tool_stats(flat)
        out[bench] = res
    overall = {}
    if out:
        for key in sorted(set().union(*out.values())):
            if re.match(r"^(avg|pass|maj|verl_\w+)@\d+(/mean)?$", key) or key == "mean_score":
                vals = [v[key] for v in out.values() if key in v]
                overall[key] = sum(vals) / len(vals)
        # the paper's number: avg@n (LiveCodeBench's pass@1 is the same quantity)
        overall.update(headline=sum(v[f"avg@{v['n']}"] for v in out.values()) / len(out),
                       problems=sum(v["problems"] for v in out.values()),
                       samples=sum(v["samples"] for v in out.values()), tools=tool_stats(records))
    return {"benchmarks": out, "overall": overall}


def markdown_table(summary, name="model"):
    """Table 2 of the paper (one row: this model), then the details per benchmark."""
    benches = summary["benchmarks"]
    order = ([b for b in BENCHMARK_TITLES if b in benches]
             + [b for b in benches if b not in BENCHMARK_TITLES])
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"
    num = lambda x: "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)
    titles = [BENCHMARK_TITLES.get(b, ("Other", b)) for b in order]  # (group, name)
    groups = [f"**{g}**" if i == 0 or g != titles[i - 1][0] else ""  # over its first column only
              for i, (g, _) in enumerate(titles)]
    avg = {b: pct(benches[b][f"avg@{benches[b]['n']}"]) for b in order}   # the headline
    lines = ["| | " + " | ".join(groups) + " |", "|---|" + "---|" * len(order),
             "| **Method** | " + " | ".join(f"**{t}**" for _, t in titles) + " |",
             "| *Agentic Reasoning* |" + " |" * len(order),
             f"| {name} | " + " | ".join(avg.values()) + " |", ""]
    cols = ["benchmark", "problems", "n", "avg@n", "pass@1", "pass@n", "maj@n", "calls/resp",
            "call ok", "turns", "resp tok", "tok before 1st call", "tok/call", "finish"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for b in order:
        s = benches[b]
        n, t = s["n"], s["tools"]
        row = [b, s["problems"], n, avg[b], pct(s.get("pass@1")), pct(s.get(f"pass@{n}")),
               pct(s.get(f"maj@{n}")), num(t["tool_calls_per_response"]),
               pct(t["tool_call_success"]), num(t["turns"]), num(t["response_tokens"]),
               num(t["tokens_before_first_call"]), num(t["tokens_per_call"]),
               ", ".join(f"{k} {100 * v:.0f}%" for k, v in t["finish_reasons"].items())]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    note = "avg@n, pass@k, maj@k and call ok in %; LiveCodeBench's headline is pass@1."
    return "\n".join(lines + ["", note])


def check_problem(p):
    """What is wrong with a project-format problem, or '' when nothing is."""
    if not isinstance(p, dict):
        return "a record must be a JSON object"
    if not isinstance(p.get("prompt"), str) or not p["prompt"]:
        return "field 'prompt': missing or not a non-empty string"
    if p.get("kind") not in ("math", "choice", "code"):
        return f"field 'kind': {p.get('kind')!r} is not math, choice or code"
    if p["kind"] != "code" and p.get("answer") in (None, ""):
        return "field 'answer': missing"
    if p.get("system") is not None and not isinstance(p["system"], str):
        return "field 'system': not a string"
    t = p["tests"] if isinstance(p.get("tests"), dict) else {}
    asserts = isinstance(t.get("test_code"), str) and isinstance(t.get("entry_point"), str)
    # a list of cases, empty only when assert-style test_code and its entry_point come instead
    if p["kind"] == "code" and not (isinstance(t.get("cases"), list) and (t["cases"] or asserts)):
        return ("field 'tests': needs {'fn_name', 'cases': [{'input', 'output'}, ...]}"
                " or assert-style test_code")
    return ""


def load_jsonl(path):
    """Project-format problems; a malformed line or none stops with file, line and reason."""
    problems = []
    for lineno, line in enumerate(open(path, encoding="utf-8"), 1):
        if line.strip():
            try:
                p = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: line {lineno}: not JSON ({e.msg})")
            if check_problem(p):
                raise SystemExit(f"{path}: line {lineno}: {check_problem(p)}")
            problems.append(p)
    if not problems:
        raise SystemExit(f"{path}: no problems")
    return problems


def with_uids(problems, default_benchmark="data"):
    """Each problem with 'benchmark' and a stable 'uid' (benchmark:index, what resuming matches)."""
    count, out = defaultdict(int), []
    for p in problems:
        b = p.get("benchmark") or p.get("source") or default_benchmark
        out.append(dict(p, benchmark=b, uid=p.get("uid") or f"{b}:{count[b]}"))
        count[b] += 1
    return out


def problem_files(cfg):
    """(benchmark, path) per problem file: (None, --data), else each of --benchmarks."""
    if cfg.data:
        return [(None, cfg.data)]
    names = [b.strip() for b in cfg.benchmarks.split(",") if b.strip()]
    return [(b, os.path.join(cfg.data_dir, f"{b}.jsonl")) for b in names]


def load_problems(cfg):
    problems = []
    for bench, path in problem_files(cfg):
        if not os.path.exists(path):
            hint = "" if cfg.data else " (write it with: python data/prepare.py eval --out data)"
            raise SystemExit(f"benchmark file {path} not found" + hint)
        rows = with_uids([dict(p, benchmark=bench) if bench else p for p in load_jsonl(path)],
                         os.path.splitext(os.path.basename(path))[0])
        seen = Counter()
        for p in rows:
            seen[p["benchmark"]] += 1
            if not cfg.limit or seen[p["benchmark"]] <= cfg.limit:
                problems.append(p)
    return problems


def grade_trajectory(problem, traj, cfg):
    """A trajectory dict plus what the summary needs, computed once and stored alongside."""
    text = traj.get("text", "")
    mask = traj.get("loss_mask") or []
    calls = traj.get("tool_calls") or []
    s = score(problem, text, code_timeout=cfg.code_test_timeout)
    before = (mask.index(0) if 0 in mask else len(mask)) if calls else 0  # mask 0: a tool reply
    return dict(traj, uid=problem["uid"], benchmark=problem["benchmark"], kind=problem["kind"],
                score=s, correct=s >= 1.0, pred=extract_pred(problem, text),
                num_tool_calls=len(calls), call_status=[c.get("status") for c in calls],
                response_tokens=len(traj.get("response_ids") or []), sampled_tokens=sum(mask),
                tokens_before_first_call=before)


def light(rec):  # what the summary and a resume need: no token ids, masks or texts
    heavy = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "text", "prompt")
    return {k: v for k, v in rec.items() if k not in heavy}


def read_done(paths, n):
    """uid -> n light records from earlier trajectory files (a torn line skipped; fewer: redone)."""
    seen = defaultdict(dict)
    for path in paths:
        for line in open(path, encoding="utf-8"):
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict) and "uid" in rec:
                seen[rec["uid"]][rec["sample_index"]] = light(rec)
    return {uid: [s[i] for i in range(n)] for uid, s in seen.items()
            if all(i in s for i in range(n))}


def evaluate(model, tokenizer, problems, cfg, out_dir=None, progress=True, engine=None):
    """Roll out, grade, summarise: (this rank's records, summary); rank r takes problems[r::world].
    out_dir: records appended to its trajectories[.rankR].jsonl, problems done there skipped."""
    import rollout
    import sandbox
    import torch
    import torch.distributed as dist
    from tqdm import tqdm
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = with_uids(problems)[rank::world]
    done = {}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        done = read_done(sorted(glob.glob(os.path.join(out_dir, "trajectories*.jsonl"))), cfg.n)
    records = [r for p in mine if p["uid"] in done for r in done[p["uid"]]]
    todo = [p for p in mine if p["uid"] not in done]
    bs = batch_problems(cfg.n, cfg.problems_per_batch)
    # the sampling and tool settings share their names; the seed goes per problem below
    rcfg = rollout.RolloutConfig(**{f.name: getattr(cfg, f.name)
                                    for f in fields(rollout.RolloutConfig) if f.name != "seed"})
    if engine is None and todo:  # one pool for every batch, sized for the largest
        longest = cfg.max_prompt_tokens + cfg.max_response_tokens
        engine = rollout.Engine(model, max_seq_lens=[longest] * bs * cfg.n)
    name = "trajectories.jsonl" if world == 1 else f"trajectories.rank{rank}.jsonl"
    path = os.path.join(out_dir, name) if out_dir else None
    quiet = not progress or rank != 0
    with (open(path, "a", encoding="utf-8") if path else nullcontext() as traj_file,
          tqdm(total=len(todo), desc="eval", disable=quiet, unit="problem") as bar):
        for start in range(0, len(todo), bs):
            batch = todo[start:start + bs]
            # a seed per problem from its uid: reruns, resumes and any rank split sample the same
            seeds = [(cfg.seed * 1_000_003 + zlib.crc32(p["uid"].encode())) % 2**31 for p in batch]
            with torch.no_grad():  # rl.py calls this with its training model
                trajs = rollout.rollout(model, tokenizer, batch, rcfg, sandbox=sandbox,
                                        seeds=seeds, engine=engine)
            new = [grade_trajectory(batch[t.problem_index],
                                    dict(t.to_dict(), prompt=tokenizer.decode(t.prompt_ids)), cfg)
                   for t in trajs]
            if traj_file:  # one write per batch, then fsync: a kill leaves at most one torn line
                kept = [light(r) if cfg.filter_out else r for r in new]
                traj_file.write("".join(json.dumps(r) + "\n" for r in kept))
                traj_file.flush()
                os.fsync(traj_file.fileno())
            records += new
            bar.update(len(batch))
    from machinery.distributed import gather_objects  # ranks finish far apart: a long timeout
    lights = [r for part in gather_objects([light(r) for r in records]) for r in part]
    if cfg.filter_out and rank == 0:  # every rank's samples are here: no second gather
        write_filtered(problems, lights, cfg.filter_out)
    ks = [int(k) for k in cfg.pass_k.split(",") if k.strip()] or None
    return records, summarize(lights, ks, cfg.verl_metrics)


def batch_problems(n, problems_per_batch):
    """Problems per rollout call: as given, else enough for 256 samples (the recipe's 8 x 32), at
    least 8: an Engine step costs about the same for 8 sequences as for the toy's 200."""
    return problems_per_batch or max(8, 256 // n)


def write_filtered(problems, records, out_path):
    """The paper's model-aware filtering: drop the problems solved in every sample or in none,
    tag the rest easy (pass rate >= 0.75), hard (<= 0.25) or medium; a histogram beside them."""
    from data.prepare import write_jsonl
    solved = defaultdict(list)
    for r in records:
        solved[r["uid"]].append(r["correct"])
    kept, hist = [], Counter()
    for p in with_uids(problems):
        rate = sum(solved[p["uid"]]) / len(solved[p["uid"]])
        tag = ("dropped_never_solved" if rate == 0 else "dropped_always_solved" if rate == 1 else
               "easy" if rate >= 0.75 else "hard" if rate <= 0.25 else "medium")
        hist[tag] += 1
        if not tag.startswith("dropped"):
            row = {k: v for k, v in p.items() if k != "uid"}
            kept.append(dict(row, pass_rate=rate, difficulty=tag))
    write_jsonl(out_path, kept)
    tags = ("easy", "medium", "hard", "dropped_always_solved", "dropped_never_solved")
    histogram = {"problems": len(problems), "kept": len(kept),
                 "difficulty": {t: hist[t] for t in tags}}
    with open(out_path + ".hist.json", "w") as f:
        json.dump(histogram, f, indent=2)
    print(f"kept {len(kept)} of {len(problems)} problems -> {out_path}: {histogram['difficulty']}")
    return histogram


def parse_config(argv):
    # `--preset toy` (and no arguments): the toy's held-out set as rl.py evaluates it, toy_policy()
    preset = dict(model="toy", data=toy.HELDOUT, out=os.path.join(toy.ROOT, "eval"), **toy.EVAL)
    return flags.parse_config(EvalConfig, argv, __doc__, presets={"toy": preset})


def check(cfg):  # every flag before anything is loaded or written: one line on a bad value
    flags.rule(cfg.model != "", "model", cfg.model, "required: a checkpoint directory")
    flags.ranges(cfg, {">= 0": "limit seed problems_per_batch", ">= 1": "n",
                        "> 0": "code_test_timeout"})
    flags.rollout(cfg)
    flags.choices(cfg, dtype=("", "float32", "bfloat16", "float16"),
                   attn_backend=("auto", "sdpa", "flash"))
    flags.output_dir(cfg, "out", optional=True)
    ks = cfg.pass_k.replace(",", " ").split()
    flags.rule(all(k.isdigit() and 0 < int(k) <= cfg.n for k in ks), "pass_k", cfg.pass_k,
                f"allowed: comma-separated k, each 1 to --n ({cfg.n})")
    flags.rule(cfg.data or cfg.benchmarks.strip(", "), "benchmarks", cfg.benchmarks,
                "allowed: names of <data_dir>/<name>.jsonl files, or --data FILE")
    flags.rule(not cfg.filter_out or cfg.n >= 2, "n", cfg.n,
                "allowed with --filter_out: at least 2 (it keeps problems solved only sometimes)")
    flags.input_file(cfg, "data", optional=True, skip=(toy.HELDOUT,))  # toy.ensure writes it
    flags.model_dir(cfg)


def toy_policy():
    """--model toy: the newest toy policy, the RL run's last checkpoint, else its SFT start."""
    rl_final = os.path.join(toy.ROOT, "rl", "final")
    return rl_final if os.path.exists(os.path.join(rl_final, "config.json")) else toy.sft_start()


def main(argv=None):
    from machinery.distributed import (allocator_defaults, barrier, compute_dtype, distributed,
                                       print0, resolve_model, same_model, start_sandbox)
    allocator_defaults()  # before CUDA starts
    from machinery import checkpoints, eval_resume, exits, run_log
    from model import DTYPES, Transformer, attention_path
    from transformers import AutoTokenizer
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_config(argv or ["--preset=toy"])
    check(cfg)
    if cfg.data == toy.HELDOUT:
        toy.ensure()
    if cfg.model == "toy":
        cfg.model = toy_policy()
        print(f"evaluate.py: the toy policy {cfg.model} on {cfg.data}")
    model_name = os.path.basename(os.path.normpath(cfg.model))
    out_dir = cfg.out or os.path.join("runs", "eval", model_name)
    say = (lambda why: f"evaluate.py: {why}; the finished problems are kept in {out_dir}, and "
           f"the same command goes on from there")
    problems = load_problems(cfg)  # a bad problem file stops it before anything is written
    with (exits.quiet_interrupt(say, out_dir), distributed() as (rank, world, device, _),
          checkpoints.claim(out_dir, "evaluate.py")):
        start_sandbox(cfg.sandbox_workers, cfg.sandbox_require, rank)
        cfg.model = same_model(resolve_model(cfg.model))  # every rank the same weights, or stop
        if rank == 0:
            this = sys.modules[__name__]  # its graders are part of the key
            eval_resume.reuse_or_start_fresh(out_dir, eval_resume.key(cfg, device, this))
        barrier()
        dtype = DTYPES[cfg.dtype] if cfg.dtype else compute_dtype(device)  # check()'s choices
        model = Transformer.from_pretrained(cfg.model, device=device, dtype=dtype).eval()
        model.attn_backend = cfg.attn_backend
        if device.type == "cuda" or cfg.attn_backend == "flash":
            print0(attention_path(cfg.attn_backend, device, dtype))
        metrics = run_log.Metrics(None, cfg, out_dir=out_dir)
        t0 = time.time()
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        records, summary = evaluate(model, tokenizer, problems, cfg, out_dir=out_dir)
        if rank == 0:
            summary.update(config=asdict(cfg), model=cfg.model, seconds=time.time() - t0)
            with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
            print(markdown_table(summary, model_name))
            print(f"\nwrote {out_dir}/summary.json and the trajectories beside it")
            metrics.log(step=0, overall=summary["overall"], benchmarks=summary["benchmarks"])
            metrics.finish(dict(overall=summary["overall"], seconds=summary["seconds"]))


if __name__ == "__main__":
    main()
    from machinery.exits import exit_worker
    exit_worker()
