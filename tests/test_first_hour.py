"""A user's first hour: the README's examples work as written, no run is lost or clobbered (a
lock on the output directory, a fresh start moves the old run aside, the toy SFT saves checkpoints
and resumes), bad input gets one line (a flag typo, a directory without a model, an out_dir that
cannot be written, a full disk), and nothing silently does something else than it says."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import evaluate
import rl
import sft
from machinery.checkpoints import checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_line(stop):
    message = str(stop.value.code)
    assert "\n" not in message and "Traceback" not in message, message
    return message


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def problems(tmp_path):
    path = tmp_path / "problems.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "kind": "math"}
            for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tiny_rl(tiny_ckpt, data, out, **kw):
    """A tiny run's flags: a few seconds on a CPU."""
    options = dict(model=tiny_ckpt, data=data, out_dir=str(out), steps=2, prompts_per_step=2,
                   samples_per_prompt=2, mini_batch_prompts=2, max_response_tokens=16,
                   overlong_buffer=8, max_turns=2, save_every=1, micro_batch_tokens=2048,
                   logprob_micro_batch_tokens=2048, activation_checkpointing=False, log_samples=0)
    options.update(kw)
    return [f"--{k}={v}" for k, v in options.items()]


# ------------------------------------------------------------------ 1: the README's examples
def test_resume_mismatch_advice_works_and_never_rewrites_a_finished_run(tiny_ckpt, problems,
                                                                        tmp_path, capsys):
    out = tmp_path / "run"
    rl.main(tiny_rl(tiny_ckpt, problems, out))                         # a finished run of 2 steps
    summary = (out / "summary.json").read_bytes()
    with pytest.raises(SystemExit) as stop:                           # the same out_dir, --steps 1
        rl.main(tiny_rl(tiny_ckpt, problems, out, steps=1))
    said = one_line(stop)
    assert "--steps is 1" in said and "pass another --out_dir" in said, said
    assert "--resume=false" in said, said
    # continuing anyway has nothing to train: refused, instead of a new summary
    with pytest.raises(SystemExit) as stop:
        rl.main(tiny_rl(tiny_ckpt, problems, out, steps=1, resume_override="true"))
    assert "nothing left to train" in one_line(stop)
    assert (out / "summary.json").read_bytes() == summary
    capsys.readouterr()
    # the advice: start over, the old run moved aside
    rl.main(tiny_rl(tiny_ckpt, problems, out, steps=1, resume="false"))
    assert f"the run that was there is now in {out}.replaced-1" in capsys.readouterr().out
    assert (tmp_path / "run.replaced-1" / "summary.json").read_bytes() == summary
    assert json.load(open(out / "summary.json"))["steps"] == 1
    assert [s for s, _ in checkpoints(str(out))] == [1]


# ------------------------------------------------------------------ 2: no run lost or clobbered
def test_a_second_run_into_one_out_dir_is_refused_and_a_killed_one_never_wedges_it(tiny_ckpt,
                                                                                  problems,
                                                                                  tmp_path):
    out = tmp_path / "run"
    flags = tiny_rl(tiny_ckpt, problems, out, steps=1000)
    first = subprocess.Popen([sys.executable, os.path.join(ROOT, "rl.py"), *flags], cwd=tmp_path,
                             env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        while not (out / "step_000001").exists() and first.poll() is None:
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended"
        with pytest.raises(SystemExit) as stop:   # a second run (another --steps): the lock first
            rl.main(tiny_rl(tiny_ckpt, problems, out, steps=2))
        said = one_line(stop)
        assert said.startswith(f"{out} is in use by another run (pid {first.pid} on "), said
        assert "rl.py" in said, said
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    newest = max(int(n[5:]) for n in os.listdir(out) if n.startswith("step_") and n[5:].isdigit())
    (out / ".tmp_step_999999" / "train_state").mkdir(parents=True)   # as a save killed midway
    # kill -9 left the lock file behind: the next run takes it, resumes and finishes
    rl.main(tiny_rl(tiny_ckpt, problems, out, steps=newest + 1, resume_override="true"))
    assert json.load(open(out / "summary.json"))["steps"] == newest + 1
    assert not [n for n in os.listdir(out) if n.startswith(".tmp_step_")]   # the leftover swept


def sft_records(path, n=24):
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_saves_as_it_goes_and_the_same_command_resumes(tiny_ckpt, tmp_path, monkeypatch,
                                                           capsys):
    toy = sft.parse_args(["--preset=toy"])
    assert 0 < toy.save_every <= 100   # the toy run (1,122 steps, 10-30 min) keeps its work
    out = tmp_path / "sft"
    argv = [f"--model={tiny_ckpt}", f"--data={sft_records(tmp_path / 'd.jsonl')}",
            f"--out_dir={out}", "--batch_size=4", "--max_steps=4", "--save_every=2",
            "--eval_size=0", "--max_len=256", "--micro_batch_tokens=1024", "--progress=false"]
    real_log_step = sft.log_step

    def ctrl_c_in_step_3(run, *args):
        if run.step == 3:
            raise KeyboardInterrupt
        return real_log_step(run, *args)
    monkeypatch.setattr(sft, "log_step", ctrl_c_in_step_3)
    with pytest.raises(SystemExit) as stop:
        sft.main(argv)
    assert stop.value.code == 130
    assert "the newest checkpoint is" in capsys.readouterr().err
    (out / ".tmp_step_000003" / "train_state").mkdir(parents=True)   # as a save killed midway
    monkeypatch.setattr(sft, "log_step", real_log_step)
    sft.main(argv)                                  # the same command: resumed, not started over
    assert f"resumed from {out / 'step_000002'} at step 2" in capsys.readouterr().out
    assert not (out / ".tmp_step_000003").exists()  # the leftover swept at start
    steps = [r["step"] for r in map(json.loads, open(out / "metrics.jsonl"))
             if r.get("event") == "train"]
    assert steps == [1, 2, 3, 4]


# ------------------------------------------------------------------ 3: one line, never a traceback
def test_a_flag_typo_is_one_line_naming_the_closest_flag():
    for main, argv, said in (
            (rl.parse_args, ["--step", "5"], "unrecognized argument --step: did you mean --steps?"),
            (sft.parse_args, ["--preset=toy", "--max-step=5"], "did you mean --max-steps?"),
            (evaluate.parse_config, ["--top_q=0.5"], "did you mean --top_p?")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert said in one_line(stop)


def test_paths_that_cannot_work_are_one_line_before_anything_is_written(in_tmp, tiny_ckpt,
                                                                       problems, monkeypatch):
    def refused(main, argv):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert sorted(os.listdir(in_tmp)) == ["empty", "file", "problems.jsonl", "readonly", "run"]
        return one_line(stop)

    for name in ("empty", "readonly", "run/step_000002", "run/final"):
        os.makedirs(name)
    open("run/final/config.json", "w").close()
    open("file", "w").close()
    real_access = os.access   # root writes anywhere: a read-only disk is what access() says of it
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: p != str(in_tmp / "readonly")
                        and real_access(p, mode, **kw))
    base = [f"--model={tiny_ckpt}", f"--data={problems}"]
    assert refused(rl.main, base + ["--model=empty"]) == (
        "--model='empty': holds no model (a Hugging Face directory has config.json and "
        "model.safetensors)")
    assert refused(evaluate.main, base + ["--model=run"]).endswith("; did you mean run/final?")
    assert refused(rl.main, base + ["--out_dir=file/run"]) == (
        f"--out_dir='file/run': {in_tmp / 'file'} is a file; allowed: a directory")
    said = refused(sft.main, ["--model=toy", f"--data={problems}", "--out_dir=readonly/run"])
    assert said.endswith("readonly cannot be written (a read-only disk, or another user's)")
    said = refused(evaluate.main, base + ["--out=file"])
    assert said.startswith("--out='file': allowed: a directory")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import chat
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    said = refused(chat.main, ["--model=run/fnial"])
    assert said.startswith("--model='run/fnial': no such directory")
    assert refused(chat.main, ["--model=empty"]).startswith("--model='empty': holds no model")


def test_a_full_disk_is_one_line_naming_the_file(tiny_ckpt, problems, tmp_path, monkeypatch):
    out = tmp_path / "run"
    file = out / ".tmp_step_000001" / "model.safetensors"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(file))
    monkeypatch.setattr(rl, "save_checkpoint", full)
    with pytest.raises(SystemExit) as stop:
        rl.main(tiny_rl(tiny_ckpt, problems, out, steps=1))
    assert one_line(stop) == (f"rl.py: stopped: {file}: the disk is full (No space left on "
                              f"device); no checkpoint yet: the same command starts again")

    def unnamed(*args, **kwargs):   # torch.save's words for it: no errno, no file
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter "
                           "failed writing file data/0: file write failed")
    from machinery import exits
    monkeypatch.setattr(rl, "save_checkpoint", unnamed)
    monkeypatch.setattr(exits.shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    with pytest.raises(SystemExit) as stop:
        rl.main(tiny_rl(tiny_ckpt, problems, out, steps=1, resume="false"))
    said = one_line(stop)
    assert said.startswith(f"rl.py: stopped: {out}: the disk is full (RuntimeError: [enforce"), said


# ------------------------------------------------------------------ 4: no silent wrong result
def test_evaluate_refuses_an_empty_problem_file(in_tmp, tiny_ckpt):
    open("empty.jsonl", "w").close()
    with pytest.raises(SystemExit, match=r"^empty\.jsonl: no problems$"):
        evaluate.main([f"--model={tiny_ckpt}", "--data=empty.jsonl"])
    assert os.listdir(in_tmp) == ["empty.jsonl"]


def test_epochs_with_the_toy_preset_does_what_it_says():
    cfg = rl.parse_args(["--preset=toy", "--epochs=3"])   # the preset's 20 steps yield to it
    assert (cfg.epochs, cfg.steps, cfg.prompts_per_step) == (3, 0, rl.TOY["prompts_per_step"])
    assert rl.parse_args(["--preset=toy", "--steps=7"]).steps == 7
    with pytest.raises(SystemExit) as stop:
        rl.parse_args(["--preset=toy", "--epochs=3", "--steps=7"])
    assert one_line(stop) == "--epochs=3: counts only when --steps is 0; pass one of the two"


def test_more_prompts_per_step_than_problems_is_refused(tiny_ckpt, problems, tmp_path):
    with pytest.raises(SystemExit) as stop:   # as verl's empty dataloader: steps would repeat
        rl.main(tiny_rl(tiny_ckpt, problems, tmp_path / "run", steps=1, prompts_per_step=8))
    assert one_line(stop).startswith("--prompts_per_step=8: allowed: at most the 4 problems of ")


# ------------------------------------------------------------------ 5: evaluate.py as easy as rl.py
def test_evaluate_toy_preset_keeps_the_toy_settings_and_rolls_out_in_one_call(in_tmp, monkeypatch):
    cfg = evaluate.parse_config(["--preset=toy", "--n=2"])
    from data import toy
    assert (cfg.n, cfg.data, cfg.max_response_tokens, cfg.top_p) == (2, toy.HELDOUT, 384, 0.6)
    import rollout
    calls, real = [], rollout.rollout
    monkeypatch.setattr(rollout, "rollout", lambda model, tok, batch, *a, **k:
                        calls.append(len(batch)) or real(model, tok, batch, *a, **k))
    evaluate.main(["--preset=toy", "--limit=12"])   # 36 problems, one sample each
    assert calls == [36]   # one rollout call (8 problems a call made the toy's 200 take 25)
    summary = json.load(open(os.path.join(toy.ROOT, "eval", "summary.json")))
    assert summary["overall"]["problems"] == 36


# ----------------------------------------------------------------------------- 6: --help
def test_help_shows_the_preset_values_and_the_examples_as_written(capsys):
    for main, argv in ((sft.parse_args, ["--preset", "toy", "--help"]),
                       (evaluate.parse_config, ["--preset", "toy", "--help"])):
        with pytest.raises(SystemExit):
            main(argv)
    text = capsys.readouterr().out
    assert "Qwen/Qwen3-4B-Instruct-2507 \\\n        --data data/sft.jsonl" in text   # as typed
    flat = " ".join(text.split())   # argparse wraps lines
    assert ("--max_response_tokens MAX_RESPONSE_TOKENS tool-reply tokens count too "
            "(default: 384)") in flat
    assert "(default: 'runs/toy/eval')" in flat
