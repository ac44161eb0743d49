"""machinery/run_log.py: what a run leaves to be watched by: metrics.jsonl (and Weights & Biases),
rl.py's step record and line, kept trajectories for scripts/view.py, the learning curve."""

import gzip
import json
import os
import secrets
from dataclasses import asdict

import torch.distributed as dist

from machinery.distributed import all_reduce, print0


class Metrics:
    """metrics.jsonl on rank 0 (path None: none); a resume drops the lines past its step. With
    config.wandb_project rank 0 also logs every line's numbers to wandb ("time/rollout")."""

    def __init__(self, path, config, step=0, out_dir=None):
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.path, self.wandb = path if rank0 else None, None
        if rank0 and getattr(config, "wandb_project", ""):
            self.wandb = start_wandb(config, out_dir or os.path.dirname(path), step)
        if self.path is None:
            return
        kept = []
        if step and os.path.exists(path):
            for line in open(path):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by the kill
                if rec.get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        self.log(event="resume" if step else "start", step=step, config=asdict(config))

    def log(self, **record):
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        numbers = flat_numbers({k: v for k, v in record.items() if k not in ("step", "config")})
        if self.wandb and numbers:
            self.wandb.log(numbers, step=record.get("step", 0))

    def finish(self, summary=None):
        if self.wandb:
            self.wandb.summary.update(flat_numbers(summary or {}))
            self.wandb.finish()
            self.wandb = None


def flat_numbers(record, prefix=""):
    """{"time": {"rollout": 1.5}, "event": "step"} -> {"time/rollout": 1.5}: the numbers only."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flat_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):  # bools too; strings and None are not plotted
            out[prefix + key] = value
    return out


def start_wandb(config, out_dir, step):
    """wandb.init, the run's id kept in out_dir/wandb_run_id: a resumed run continues that run."""
    try:
        import wandb
    except ImportError:
        raise SystemExit("--wandb_project needs the wandb package: pip install wandb") from None
    id_file = os.path.join(out_dir, "wandb_run_id")
    resumed = step and os.path.exists(id_file)
    run_id = open(id_file).read().strip() if resumed else secrets.token_hex(4)
    os.makedirs(out_dir, exist_ok=True)
    with open(id_file, "w") as f:
        f.write(run_id)
    return wandb.init(project=config.wandb_project, name=getattr(config, "wandb_run", "") or None,
                      id=run_id, resume="allow", dir=out_dir, config=asdict(config))


def write_trajectories(out_dir, step, records):
    """records into out_dir/trajectories/step_NNNNNN.jsonl.gz by problem and sample, a line each."""
    folder = os.path.join(out_dir, "trajectories")
    os.makedirs(folder, exist_ok=True)
    # a lone surrogate (a call's "\ud800") is no UTF-8: written as that escape, it reads back as is
    with gzip.open(os.path.join(folder, f"step_{step:06d}.jsonl.gz"), "wt", encoding="utf-8",
                   errors="backslashreplace") as f:
        for r in sorted(records, key=lambda r: (r["problem_index"], r["sample_index"])):
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")


def learning_curve(out_dir):
    """Reward, accuracy and tool calls by step from metrics.jsonl: a table, and with matplotlib
    (optional) out_dir/learning_curve.png."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("event") == "step"]
    keys = {"reward": "mean reward", "accuracy": "accuracy of the step's samples",
            "tool_calls_per_traj": "tool calls per trajectory"}
    lines = ["step  " + "  ".join(f"{k:>19}" for k in keys)]
    lines += [f"{r['step']:>4}  " + "  ".join(f"{r[k]:>19.3f}" for k in keys) for r in rows]
    table = "\n".join(lines)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return table
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, (k, title) in zip(axes, keys.items()):
        ax.plot([r["step"] for r in rows], [r[k] for r in rows])
        ax.set(xlabel="step", title=title)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "learning_curve.png"), dpi=100)
    plt.close(fig)
    return table


def step_metrics(step, everyone, groups, updates, mismatch, device, engine_stats):
    """One metrics line: rewards, tool use, lengths, the loss stats (means over the updates), the
    mismatch (rl.sampler_mismatch), the KV pool (peak use: max over ranks; preemptions: sum)."""
    n, calls = len(everyone), sum(s["tool_calls"] for s in everyone)
    preemptions = all_reduce([engine_stats["preemptions"]], device)[0]
    kv_peak = all_reduce([engine_stats["kv_peak_tokens"]], device, dist.ReduceOp.MAX)[0]
    mean = lambda key: sum(s[key] for s in everyone) / n
    rec = {"event": "step", "step": step, "reward": mean("reward"), "accuracy": mean("correct"),
           "score": mean("score"), "tool_calls_per_traj": calls / n,
           "tool_call_success": sum(s["tool_ok"] for s in everyone) / calls if calls else None,
           "response_length": mean("length"),
           "response_length_max": max(s["length"] for s in everyone),
           "truncated": sum(s["finish"] == "length" for s in everyone) / n,
           "max_turns_hit": sum(s["finish"] == "max_turns" for s in everyone) / n,
           "groups_all_equal": sum(max(g) == min(g) for g in groups.values()) / len(groups),
           **mismatch, "updates": len(updates), "kv_pool_tokens": engine_stats["kv_pool_tokens"],
           "preemptions": int(preemptions), "kv_peak_tokens": int(kv_peak)}
    for k in ("loss", "clip_high", "clip_low", "clip_dual", "approx_kl", "ref_kl", "grad_norm"):
        if vals := [u[k] for u in updates if k in u]:
            rec[k] = sum(vals) / len(vals)
    if updates:
        rec["grad_norm_max"] = max(u["grad_norm"] for u in updates)
    return rec


def print_step(rec, samples, cfg):
    t = rec["time"]
    clips = "/".join(f"{rec.get(k, 0):.3f}" for k in ("clip_high", "clip_low", "clip_dual"))
    print0(f"step {rec['step']}: reward {rec['reward']:+.3f} acc {rec['accuracy']:.3f} calls/traj "
           f"{rec['tool_calls_per_traj']:.2f} len {rec['response_length']:.0f} loss "
           f"{rec.get('loss', 0):+.4f} gnorm {rec.get('grad_norm', 0):.3f} clip h/l/d {clips} "
           f"mismatch {rec['mismatch_mean']:.2e} | rollout {t['rollout']:.1f}s (sandbox "
           f"{t['sandbox']:.1f}) score {t['score']:.1f}s old-lp {t['old_logprob']:.1f}s update "
           f"{t['update']:.1f}s step {t['step']:.1f}s")
    for s in samples[:cfg.log_samples]:
        print0(f"  sample (reward {s['reward']:+.2f}): {s['text'][:300]!r}")
