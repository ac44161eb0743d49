"""machinery/flags.py: parse_config (one dataclass, --name=value) and the rules a stage checks its
flags, model directory and SFT data by before anything loads. A value that cannot work stops the
run with one line naming the flag, the value and what is allowed, not a traceback minutes later."""

import argparse
import dataclasses
import difflib
import inspect
import io
import json
import math
import os
import struct
import tokenize


def _bool(text):
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes")


def _field_comments(cls):
    """field -> the comment on its line in the class source (its --help text); {} without source."""
    try:
        tokens = tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline)
    except (OSError, TypeError):
        return {}
    return {t.line.split(":")[0].strip(): t.string.lstrip("# ").replace("%", "%%")
            for t in tokens if t.type == tokenize.COMMENT}


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage it would print is --help's first 40 lines)."""

    def error(self, message):
        raise SystemExit(f"{self.prog}: {message} (--help lists every flag)")


def parse_config(cls, argv, doc="", presets=None):
    """A `cls` dataclass from --name value / --name=value flags ('-' and '_' alike; a bare bool
    flag means true). presets: {name: {field: value}}, `--preset NAME` sets those defaults under
    the explicit flags. `--` (torchrun's separator) is skipped; --help lists every default with
    its field's comment. An unknown flag stops it with one line naming the closest one."""
    argv = [a for a in argv if a != "--"]
    values = {}
    p = Parser(description=doc, allow_abbrev=False,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    if presets:  # a first pass reads --preset alone, so its values become the defaults --help shows
        pre = Parser(add_help=False, allow_abbrev=False)
        pre.add_argument("--preset", choices=sorted(presets))
        values = presets.get(pre.parse_known_args(argv)[0].preset) or {}
        p.add_argument("--preset", choices=sorted(presets), help="named preset of defaults")
    comments, known = _field_comments(cls), ["--preset"]
    for f in dataclasses.fields(cls):
        default = values.get(f.name, f.default)
        names = sorted({f"--{f.name}", f"--{f.name.replace('_', '-')}"})
        kind = (dict(type=_bool, nargs="?", const=True) if type(f.default) is bool
                else dict(type=type(f.default)))
        help_text = f"{comments.get(f.name, '')} (default: {default!r})".lstrip()
        p.add_argument(*names, dest=f.name, default=default, help=help_text, **kind)
        known += names
    args, unknown = p.parse_known_args(argv)
    if unknown:
        flag = next((a for a in unknown if a.startswith("-")), unknown[0])
        close = difflib.get_close_matches(flag.split("=")[0], known, 1)
        p.error(f"unrecognized argument {flag}" + (f": did you mean {close[0]}?" if close else ""))
    return cls(**{k: v for k, v in vars(args).items() if k != "preset"})


def named(argv):
    """The fields an argv names ('-' and '_' alike)."""
    return {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}


def refuse(name, value, allowed):
    shown = repr(value) if isinstance(value, str) else value
    raise SystemExit(f"--{name}={shown}: {allowed}")


def _allows(value, rule):
    """rule: '>= x', '> x', or an interval '[a, b)' (round brackets: open ends)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
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
    """The named field is a file that exists ('' allowed when optional; skip: files the stage writes
    itself). hint is said when the path is the flag's default, which the user may not know."""
    path = getattr(cfg, name)
    if (optional and path == "") or path in skip:
        return
    default = {f.name: f.default for f in dataclasses.fields(cfg)}.get(name)
    if not (isinstance(path, str) and os.path.isfile(path)):
        refuse(name, path, "no such file" + (hint if path == default else ""))


def looks_local(path):
    """Written as a path or in an existing directory: a directory the user meant, not a hub id."""
    return path.startswith(("./", "../", "/", "~", "runs/")) or os.path.isdir(os.path.dirname(path))


def model_dir(cfg, name="model", skip=("toy",)):
    """The named field is a model directory (config.json and safetensors weights; a run's out_dir:
    the checkpoint inside it is named), or a hub id (downloaded later)."""
    path = getattr(cfg, name)
    if path in skip or not (os.path.isdir(path) or looks_local(path)):
        return
    if not os.path.isdir(path):
        refuse(name, path, "no such directory (a hub id looks like owner/name)")
    has = lambda d, *files: any(os.path.exists(os.path.join(path, d, f)) for f in files)
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not (has("", "config.json") and has("", *weights)):
        inside = sorted(d for d in os.listdir(path) if has(d, "config.json"))
        best = "final" if "final" in inside else inside[-1] if inside else None
        hint = f"; did you mean {os.path.join(path, best)}?" if best else ""
        refuse(name, path, "holds no model (a Hugging Face directory has config.json and "
               "model.safetensors)" + hint)


def output_dir(cfg, name, optional=False):
    """The named field can be a directory this process may make and write ('' if optional)."""
    path = getattr(cfg, name)
    if optional and path == "":
        return
    if not path or os.path.isfile(path):
        refuse(name, path, "allowed: a directory (one that does not exist yet is made)")
    above = os.path.abspath(path)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        refuse(name, path, f"{above} is a file; allowed: a directory")
    if not os.access(above, os.W_OK):
        refuse(name, path, f"{above} cannot be written (a read-only disk, or another user's)")


def rollout(cfg):
    """The sampling, tool and sandbox flags (those that cfg has)."""
    ranges(cfg, {">= 0": " ".join(n for n in ("temperature", "top_k", "tool_output_chars",
                                              "sandbox_workers") if hasattr(cfg, n)),
                 "(0, 1]": "top_p", "> 0": "tool_timeout",
                 ">= 1": "max_prompt_tokens max_response_tokens max_turns max_parallel_calls "
                         "tool_memory_mb"})
    choices(cfg, enable_thinking=("default", "true", "false"))
    if hasattr(cfg, "sandbox_require"):        # the pool's own rule: one meaning per value
        from machinery.sandbox_pool import required
        try:
            required(cfg.sandbox_require)
        except ValueError as exc:
            refuse("sandbox_require", cfg.sandbox_require, str(exc).split("; not ")[0])


# ---------------------------------------------------------------- the model's files
def damaged_weights(path):
    """What is wrong with a Hugging Face directory's safetensors files ("FILE: what"), else None:
    each file must hold its header and every tensor the header lists (a truncated copy does not)."""
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        try:
            with open(file, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n)) if 8 + n <= size else None
        except (struct.error, ValueError, UnicodeDecodeError):
            header = None
        if header is None:
            return f"{file}: truncated or not a safetensors file ({size} bytes, no whole header)"
        end = 8 + n + max([t["data_offsets"][1] for k, t in header.items()
                           if k != "__metadata__"], default=0)
        if size < end:
            return f"{file}: truncated ({size} of {end} bytes)"
    return None


# ---------------------------------------------------------------- sft.py's data file
class DataError(ValueError):
    """A record the trainer cannot use; the message names file, line and field."""


ROLES = ("system", "user", "assistant", "tool")


def check_record(record, where):
    """-> (messages, tools), or a DataError naming the field that is wrong."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages: expected a non-empty list, got {str(record)[:80]}")
    tools = record.get("tools")
    if isinstance(tools, str):  # parquet exports often keep the tool list as JSON text
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: tools: a string that is not valid JSON ({e})") from None
    schemas = isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    if tools is not None and not schemas:
        raise DataError(f"{where}: tools: expected a list of tool schemas, got {str(tools)[:80]}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{i}].role: expected one of {ROLES}, "
                            f"got {str(m)[:80]}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m["role"] == "assistant")):
            raise DataError(f"{where}: messages[{i}].content: expected a string, "
                            f"got {content!r:.80}")
        for j, call in enumerate(m.get("tool_calls") or []):
            name = f"{where}: messages[{i}].tool_calls[{j}].function"
            fn = call.get("function", call) if isinstance(call, dict) else None
            if m["role"] != "assistant" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str):
                raise DataError(f"{name}.name: expected a string on an assistant message")
            if not isinstance(fn.get("arguments"), (str, dict)):
                raise DataError(f"{name}.arguments: expected an object")
    roles = [m["role"] for m in messages]
    if roles[0] == "assistant" or "assistant" not in roles:
        raise DataError(f"{where}: messages: no assistant message after a prompt, so nothing "
                        f"to learn")
    return messages, tools


def records(path):
    """(messages, tools, "FILE:LINE") of each record of an SFT data file, checked (check_record)."""
    for lineno, line in enumerate(open(path, encoding="utf-8"), 1):
        where = f"{path}:{lineno}"
        try:
            if line.strip():
                yield *check_record(json.loads(line), where), where
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e})") from None


def check_data(path):
    """Every record's JSON and fields, before anything is written (sft.load_data renders them)."""
    for _ in records(path):
        pass
