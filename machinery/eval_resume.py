"""machinery/eval_resume.py: evaluate.py reuses the samples in --out only when all that makes or
grades them is unchanged (model, settings, problems, graders' source: <out>/resume_key.json); else
it moves them aside (trajectories*.jsonl.replaced) and starts fresh; one line says which and why."""

import glob
import hashlib
import inspect
import json
import os

# the EvalConfig fields that change what is sampled or how it is graded
SETTINGS = ("n", "temperature", "top_p", "top_k", "max_prompt_tokens", "max_response_tokens",
            "max_turns", "max_parallel_calls", "tool_output_chars", "tool_timeout",
            "tool_memory_mb", "enable_thinking", "code_test_timeout", "seed", "dtype",
            "attn_backend")


def digest(paths=(), texts=()):
    """sha256 over each file's name and bytes, then the texts."""
    h = hashlib.sha256()
    for path in paths:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    for text in texts:
        h.update(text.encode() + b"\0")
    return h.hexdigest()


def key(cfg, device, e):
    """What --out's samples must have been made with to be reused. e: the evaluate module (passed
    in: under `python evaluate.py` it is __main__), for its problem files and graders' source."""
    from machinery import code_grading, final_answer
    problems = [path for _, path in e.problem_files(cfg)]
    model = sorted(p for p in glob.glob(os.path.join(cfg.model, "*")) if os.path.isfile(p))
    graders = [final_answer, e.score_math, e.score_choice, e.extract_program, e.score_code, e.score,
               e.extract_pred, code_grading]
    return {"model weights": digest(model), "problem files": digest(problems),
            "sampling settings": dict({k: getattr(cfg, k) for k in SETTINGS}, device=device.type),
            "grader": digest(texts=[inspect.getsource(g) for g in graders])}


def reuse_or_start_fresh(out_dir, current):
    """Rank 0, before any rollout: keep out_dir's trajectories of this key, else move them aside."""
    path = os.path.join(out_dir, "resume_key.json")
    old = sorted(glob.glob(os.path.join(out_dir, "trajectories*.jsonl")))
    saved = json.load(open(path)) if os.path.exists(path) else None
    current = json.loads(json.dumps(current))  # as it reads back
    if old and saved == current:
        print(f"evaluate.py: reusing the finished problems in {out_dir}: the same model weights, "
              f"sampling settings, problem files and grader", flush=True)
        return
    if old:
        why = "no record of what made them" if saved is None else differences(saved, current)
        for f in old:
            os.replace(f, f + ".replaced")
        print(f"evaluate.py: {out_dir} holds samples of another evaluation ({why}); starting "
              f"fresh (the old ones are now trajectories*.jsonl.replaced)", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(current, f, indent=1)


def differences(saved, current):
    """'model weights differ; sampling settings differ: top_p 0.6 -> 0.9'."""
    said = []
    for part, now in current.items():
        before = saved.get(part)
        if isinstance(now, dict) and isinstance(before, dict):
            changed = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in {**before, **now}
                       if before.get(k) != now.get(k)]  # a setting gone counts too
            said += [f"{part} differ: " + ", ".join(changed)] if changed else []
        elif before != now:
            said.append(f"{part} differ")
    return "; ".join(said)
