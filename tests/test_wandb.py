"""--wandb_project: what rl.py logs to Weights & Biases, read back from wandb's offline run files, is
metrics.jsonl: the config once, every line's numbers under the same names, the final summary; a resumed
run continues the same wandb run."""
import glob
import json
import os
import struct
import time
from types import SimpleNamespace

import pytest

import rl

pytest.importorskip("wandb")


def wandb_records(run_dir):
    """The protobuf records of every offline run file under run_dir, the runs in the order they started: the
    LevelDB log format wandb writes (a 7-byte ':W&B' header, then 32 KiB blocks of records with a 7-byte header
    each). Not in the order of the folder names: two runs started within one second share the name's timestamp,
    and wandb adds "-1" to the second one's, which sorts before the first's ('-' < '/')."""
    runs = [file_records(path) for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))]
    runs.sort(key=lambda recs: min(r.run.start_time.ToNanoseconds() for _, r in recs
                                   if r.WhichOneof("record_type") == "run"))
    return [item for recs in runs for item in recs]


def file_records(path):
    from wandb.proto import wandb_internal_pb2 as pb
    out = []
    data, pos, chunk = open(path, "rb").read(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append((path, record))
            chunk = b""
    return out


def unflatten(items):
    row = {}
    for key, value in items:
        node = row
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return row


def numbers(record, top=True):
    """The numeric leaves of a metrics line (what wandb can plot), without its step and the config."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict) and key != "config":
            inner = numbers(value, False)
            if inner:
                out[key] = inner
        elif isinstance(value, (int, float)) and not (top and key == "step"):
            out[key] = value
    return out


def test_wandb_offline_history_is_metrics_jsonl(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "kind": "math"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    # both runs start within one wall-clock second, as a quick tiny run on a fast machine can: wandb then names
    # the second run's folder with a "-1" suffix; the records must still be read in the order the runs started
    import wandb.sdk.wandb_init as wandb_init
    clock = iter(range(1, 1000))
    second = int(time.time())
    monkeypatch.setattr(wandb_init, "time", SimpleNamespace(**{k: getattr(time, k) for k in dir(time)
                                                               if not k.startswith("_")}))
    monkeypatch.setattr(wandb_init.time, "time", lambda: second + next(clock) / 1000)
    options = dict(model=tiny_ckpt, data=str(data), out_dir=str(out), steps=1, prompts_per_step=2, samples_per_prompt=2,
                   mini_batch_prompts=2, max_response_tokens=16, overlong_buffer=8, max_turns=2, save_every=1,
                   micro_batch_tokens=2048, logprob_micro_batch_tokens=2048, activation_checkpointing=False,
                   log_samples=0, wandb_project="demyagent-test", wandb_run="tiny")
    rl.train(rl.Config(**options))
    rl.train(rl.Config(**dict(options, steps=2, resume_override=True)))   # resumes at step 1: the same wandb run
    records = wandb_records(str(out))
    runs = {(r.run.run_id, r.run.display_name) for _, r in records if r.WhichOneof("record_type") == "run"}
    assert runs == {(open(out / "wandb_run_id").read(), "tiny")}   # both runs: one wandb run
    configs = [r.run.config for _, r in records if r.WhichOneof("record_type") == "run"]
    logged = {i.key: json.loads(i.value_json) for c in configs for i in c.update}
    assert {k: logged[k] for k in ("samples_per_prompt", "lr", "wandb_run")} == {
        "samples_per_prompt": 2, "lr": rl.Config.lr, "wandb_run": "tiny"}
    history = []
    for _, r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.append((items.pop("_step"), unflatten((k, v) for k, v in items.items() if not k.startswith("_"))))
    want = {}  # wandb keeps one row per step: a step's lines (its metrics, then its checkpoint's "save") merged
    for r in map(json.loads, open(out / "metrics.jsonl")):
        want.setdefault(r["step"], {}).update(numbers(r)) if numbers(r) else None
    assert [s for s, _ in history] == [1, 2] and dict(history) == want
    summary = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
               for _, r in records if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert summary["steps"] == 2   # the final summary, last written by the resumed run
