"""checks.py: the rules a stage's flags are checked by before it loads a model or writes a file
(rl.check, sft.check, evaluate.check, scripts/chat.py). A value that cannot work stops the run
with one line naming the flag, the value and what is allowed, instead of a traceback minutes
later (a ZeroDivisionError after the held-out evaluation, an empty result that exits 0)."""

import dataclasses
import math
import os


def refuse(name, value, allowed):
    """Stop with one line: --name=value and what is allowed."""
    shown = repr(value) if isinstance(value, str) else value
    raise SystemExit(f"--{name}={shown}: {allowed}")


def _number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _allows(value, rule):
    """rule: '>= x', '> x', or an interval '[a, b)' (round brackets: open ends)."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
        return False
    if rule.startswith(">"):
        low = float(rule.lstrip(">="))
        return value >= low if rule.startswith(">=") else value > low
    low, high = (float(x) for x in rule[1:-1].split(","))
    return ((low < value if rule[0] == "(" else low <= value)
            and (value < high if rule[-1] == ")" else value <= high))


def ranges(cfg, table):
    """table: {rule: 'field field ...'}; each field a finite number its rule allows."""
    for allowed, names in table.items():
        for name in names.split():
            value = getattr(cfg, name)
            if not _allows(value, allowed):
                kind = "an integer" if isinstance(value, int) else "a number"
                where = "in " if allowed[0] in "[(" else ""   # an interval
                refuse(name, value, f"allowed: {kind} {where}{allowed}")


def choices(cfg, **allowed):
    """Each named field one of its choices."""
    for name, options in allowed.items():
        if getattr(cfg, name) not in options:
            refuse(name, getattr(cfg, name), "allowed: " + " | ".join(map(repr, options)))


def rule(ok, name, value, allowed):
    """A rule of its own (a multiple, a bound set by another flag)."""
    if not ok:
        refuse(name, value, allowed)


def world():
    """The processes of this run, known before torch.distributed is set up (torchrun's env)."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else int(os.getenv("WORLD_SIZE", "1"))


def input_file(cfg, name, optional=False, skip=(), hint=""):
    """The named field is a file that exists ('' allowed when optional; paths in skip allowed:
    files the stage writes itself, as the toy task's). hint is said when the path is the flag's
    default: the user gave no such flag and may not know the default."""
    path = getattr(cfg, name)
    if (optional and path == "") or path in skip:
        return
    default = {f.name: f.default for f in dataclasses.fields(cfg)}.get(name)
    if not (isinstance(path, str) and os.path.isfile(path)):
        refuse(name, path, "no such file" + (hint if path == default else ""))


def output_dir(cfg, name):
    """The named field can be a directory: not empty, not an existing file."""
    path = getattr(cfg, name)
    if not path or os.path.isfile(path):
        refuse(name, path, "allowed: a directory (one that does not exist yet is made)")


def rollout(cfg):
    """The sampling, tool and sandbox flags (those that cfg has)."""
    ranges(cfg, {">= 0": " ".join(n for n in ("temperature", "top_k", "tool_output_chars",
                                              "sandbox_workers") if hasattr(cfg, n)),
                 "(0, 1]": "top_p", "> 0": "tool_timeout",
                 ">= 1": "max_prompt_tokens max_response_tokens max_turns max_parallel_calls "
                         "tool_memory_mb"})
    choices(cfg, enable_thinking=("default", "true", "false"))
    if hasattr(cfg, "sandbox_require"):
        from sandbox_pool import LAYERS
        names = set(cfg.sandbox_require.split(",")) - {""}
        if cfg.sandbox_require not in ("floor", "all") and (not names or names - set(LAYERS)):
            refuse("sandbox_require", cfg.sandbox_require,
                   f"allowed: 'floor' | 'all' | names of {sorted(LAYERS)}, comma-separated")
