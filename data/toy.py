"""data/toy.py: the toy tool-use task behind the CPU demo, and every toy helper of the pipeline.

Arithmetic a million-parameter model cannot do in its head, solved by the paper's loop: Python in
a <tool_call>, read the <tool_response>, box the number. SFT mixes `tool` (one correct call),
`guess` (no call, a wrong boxed estimate: the commonest, so RL learns from reward alone whether to
call) and `retry` (a buggy call, the real error, a fixed call) trajectories, with real tool output.
    python -m data.toy --out data/toy        # writes sft.jsonl, train.jsonl, heldout.jsonl
"""

import argparse
import hashlib
import math
import os
import random

KINDS = ("mul", "triple", "squares")
ROOT = "runs/toy"  # the toy presets of sft.py and rl.py write under ./runs/toy
DATA = os.path.join(ROOT, "data")
SFT_DATA, TRAIN, HELDOUT = (os.path.join(DATA, f + ".jsonl") for f in ("sft", "train", "heldout"))
SHIPPED_SFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_sft")
LIMITS = dict(max_prompt_tokens=512, max_response_tokens=384, max_turns=3)  # short trajectories
EVAL = dict(n=1, temperature=1.0, top_p=0.6, **LIMITS)  # the paper's sampling, one sample a problem


def make_problem(rng, kind, digits=3):
    """A problem in the RL/eval format plus the code that solves it (`code`). A kind's numbers
    have one width, so every copy (operands into the code, the output into the box) spans a fixed
    distance: a model trained from scratch learns those in minutes, varying ones far later."""
    if digits < 2:
        raise ValueError(f"digits must be at least 2, not {digits}")
    top = 10 ** digits - 1
    if kind == "mul":  # a * b with 2 * digits digits: a, b >= sqrt(10 ** (2 * digits - 1))
        lo = math.isqrt(10 ** (2 * digits - 1) - 1) + 1
        a, b = rng.randint(lo, top), rng.randint(lo, top)
        expr = f"{a} * {b}"
    elif kind == "triple":  # a * b * c of (digits - 1)-digit operands: 3 * (digits - 1) digits
        width = 3 * (digits - 1)
        lo = math.ceil(10 ** ((width - 1) / 3))
        while lo ** 3 < 10 ** (width - 1):  # float rounding of the cube root
            lo += 1
        a, b, c = (rng.randint(lo, 10 ** (digits - 1) - 1) for _ in range(3))
        expr = f"{a} * {b} * {c}"
    elif kind == "squares":  # a ** 2 + b ** 2 with 2 * digits + 1 digits
        lo = math.isqrt(10 ** (2 * digits) // 2 - 1) + 1
        a, b = rng.randint(lo, top), rng.randint(lo, top)
        expr = f"{a}**2 + {b}**2"
    else:
        raise ValueError(f"unknown toy kind {kind!r} (expected one of {KINDS})")
    prompt = f"Use the code tool, then give the final answer in \\boxed{{}}. What is {expr}?"
    return {"prompt": prompt, "answer": eval(expr), "kind": "math", "source": f"toy-{kind}",
            "code": f"print({expr})"}


def is_heldout(problem):
    """20% of problems, by a hash of the problem text, so the splits never overlap."""
    return int(hashlib.sha256(problem["prompt"].encode()).hexdigest()[:8], 16) % 1000 < 200


def make_problems(n, split, seed=0, digits=3):
    """n distinct problems from `split` ("train" or "heldout"), the KINDS in rotation."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    rng, out = random.Random(f"{split}-{seed}"), {}  # prompt -> problem
    for _ in range(100 * n + 10_000):  # draws allowed
        if len(out) == n:
            break
        p = make_problem(rng, KINDS[len(out) % len(KINDS)], digits)
        if is_heldout(p) == (split == "heldout"):
            out.setdefault(p["prompt"], p)
    if len(out) < n:
        raise ValueError(f"cannot draw {n} distinct {split} problems of {digits} digits: "
                         "raise --digits or lower n")
    return list(out.values())


def _guess(rng, answer):
    """A head estimate: the leading digits right, the rest made up, never the exact answer."""
    s = str(answer)
    keep = max(1, len(s) // 2)
    while True:
        g = (str(rng.randint(0, 9)) if len(s) == 1
             else s[:keep] + "".join(rng.choice("0123456789") for _ in s[keep:]))
        if g != s:
            return int(g)


def _buggy(rng, code):
    """The same code with one realistic mistake that makes Python raise."""
    return rng.choice([code.replace("print(", "pritn(", 1),
                       code.replace("print(", "print ", 1) + ")",
                       code.replace("print(", "print(x + ", 1)])


def make_sft_records(problems, seed=0, mix=(0.35, 0.45, 0.2)):
    """{"messages", "tools"} trajectories; `mix` = shares of tool / guess / retry trajectories."""
    import sandbox
    from data.prompts import CODE_INTERPRETER
    rng = random.Random(f"sft-{seed}")
    styles = rng.choices(["tool", "guess", "retry"], weights=mix, k=len(problems))
    plans = [{"tool": [p["code"]], "guess": [], "retry": [_buggy(rng, p["code"]), p["code"]]}[style]
             for p, style in zip(problems, styles)]  # codes to call; _buggy draws for every style
    codes = [c for plan in plans for c in plan]
    results = iter(sandbox.run_many([sandbox.prepare_code(c) for c in codes], timeout=10.0))
    records = []
    for p, style, plan in zip(problems, styles, plans):
        messages = [{"role": "user", "content": p["prompt"]}]
        for code in plan:
            reply = sandbox.format_tool_output(next(results), max_chars=256)  # rollout's default
            call = {"name": "code_interpreter", "arguments": {"code": code}}
            messages += [{"role": "assistant", "content": "",
                          "tool_calls": [{"type": "function", "function": call}]},
                         {"role": "tool", "content": reply}]
        # a guess restates the expression (a copy, as in the tool call), then guesses
        text = (f"{p['code'][len('print('):-1]} is about \\boxed{{{_guess(rng, p['answer'])}}}."
                if style == "guess" else f"The answer is \\boxed{{{reply.strip()}}}.")
        messages.append({"role": "assistant", "content": text})
        records.append({"messages": messages, "tools": [CODE_INTERPRETER], "style": style})
    return records


def build(out, n_sft=6000, n_train=2000, n_heldout=200, seed=0, digits=3, sft=True):
    """Write sft.jsonl (if `sft`: it runs every call in the sandbox), train.jsonl, heldout.jsonl
    into `out`; the RL problems follow the SFT ones in one draw, so they never repeat them."""
    train = make_problems(n_sft + n_train, "train", seed, digits=digits)
    heldout = make_problems(n_heldout, "heldout", seed=0, digits=digits)  # fixed across seeds
    files = {"sft.jsonl": make_sft_records(train[:n_sft], seed)} if sft else {}
    files.update({"train.jsonl": train[n_sft:], "heldout.jsonl": heldout})
    from data.prepare import write_jsonl
    for name, rows in files.items():  # without "code": no solution leaks into the data
        write_jsonl(os.path.join(out, name), [{k: r[k] for k in r if k != "code"} for r in rows])
    return [os.path.join(out, name) for name in files]


def ensure(sft=False, base_dir=None, seed=0):
    """Write what the toy pipeline reads when missing: problems, SFT data (sft), base (base_dir)."""
    if not all(os.path.exists(p) for p in ([TRAIN, HELDOUT] + [SFT_DATA] * sft)):
        build(DATA, seed=seed, sft=sft)
    if base_dir and not os.path.exists(os.path.join(base_dir, "config.json")):
        from data.tiny import build_tiny_checkpoint
        build_tiny_checkpoint(base_dir, seed=seed)


def sft_start():
    """The toy SFT start: runs/toy/sft/final when `python sft.py` made one, else the shipped one."""
    trained = os.path.join(ROOT, "sft", "final")
    return trained if os.path.exists(os.path.join(trained, "config.json")) else SHIPPED_SFT


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/toy")
    for flag in ("--n-sft", "--n-train", "--n-heldout", "--seed", "--digits"):
        ap.add_argument(flag, type=int)  # default: build's
    for path in build(**{k: v for k, v in vars(ap.parse_args()).items() if v is not None}):
        print("wrote", path)
