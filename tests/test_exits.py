"""What a user meets when a run is stopped or repeated: Ctrl-C prints one line (where the newest checkpoint is,
and that the same command resumes), no traceback, and leaves no `final` for an unfinished run; evaluate.py
reuses the samples in an --out only when they come from the same model, settings, problems and grader."""
import json
import os
import signal
import subprocess
import sys

import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH4 = os.path.join(ROOT, "data", "fixtures", "bench4.jsonl")


def test_ctrl_c_says_one_line_and_the_same_command_resumes(tiny_ckpt, tmp_path):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "kind": "math"})
                            + "\n" for i in range(8)))
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "rl.py"), f"--model={tiny_ckpt}", f"--data={data}",
           f"--out_dir={out}", "--steps=1000", "--prompts_per_step=2", "--samples_per_prompt=2",
           "--mini_batch_prompts=2", "--max_response_tokens=16", "--overlong_buffer=8", "--max_turns=2",
           "--save_every=1", "--micro_batch_tokens=2048", "--logprob_micro_batch_tokens=2048",
           "--activation_checkpointing=false", "--log_samples=0", "--sandbox_workers=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def interrupt_once(ready):
        """Run cmd until ready() holds, then Ctrl-C it; its exit status and what it printed."""
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        lines = []
        for line in proc.stdout:   # every step prints a line, so this loop sees each new checkpoint
            lines.append(line)
            if ready(lines):
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=120)
        return proc.returncode, "".join(lines) + rest

    code, printed = interrupt_once(lambda lines: os.path.exists(out / "step_000001"))
    lines = printed.strip().splitlines()
    last_step = max(i for i, line in enumerate(lines) if line.startswith("step "))
    assert code == 130, printed
    assert "Traceback" not in printed and "CancelledError" not in printed, printed
    assert len(lines) == last_step + 2, printed          # after the steps' lines: one line
    assert lines[-1].startswith("rl.py: interrupted; the newest checkpoint is "), printed
    assert lines[-1].endswith("; the same command resumes from it"), printed
    assert not os.path.lexists(out / "final")   # the run did not finish
    newest = lines[-1].split("checkpoint is ")[1].split(" (step ")[0]
    code, printed = interrupt_once(lambda lines: "resumed from" in lines[-1])
    assert f"resumed from {newest} at step " in printed and code == 130, printed
    assert not os.path.lexists(out / "final")


def tiny_evaluation(model, out, *flags):
    evaluate.main([f"--model={model}", f"--data={BENCH4}", "--n=1", "--max_response_tokens=16", "--max_turns=1",
                   f"--out={out}", "--tool_timeout=2", "--code_test_timeout=2", *flags])
    return [json.loads(line)["text"] for line in open(os.path.join(out, "trajectories.jsonl"))]


def test_evaluate_reuses_only_the_same_evaluation(tiny_ckpt, tmp_path, capsys):
    from data.tiny import build_tiny_checkpoint
    other = build_tiny_checkpoint(str(tmp_path / "other"), seed=1)
    out = str(tmp_path / "eval")
    first = tiny_evaluation(tiny_ckpt, out)
    assert "reusing" not in capsys.readouterr().out
    assert tiny_evaluation(tiny_ckpt, out) == first                 # the same evaluation: every sample reused
    assert "reusing the finished problems in" in capsys.readouterr().out
    second = tiny_evaluation(other, out)                             # another model into the same --out
    said = capsys.readouterr().out
    assert "holds samples of another evaluation (model weights differ); starting fresh" in said, said
    assert second != first and len(second) == len(first)
    assert os.path.exists(os.path.join(out, "trajectories.jsonl.replaced"))
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["model"] == other
    tiny_evaluation(other, out, "--top_p=0.9")
    assert "(sampling settings differ: top_p 0.6 -> 0.9)" in capsys.readouterr().out


def test_a_torchrun_worker_leaves_without_the_interpreter_teardown(tmp_path):
    """A torchrun worker's teardown could abort on a gloo thread still holding the last
    collective's tensors: exit_worker leaves with os._exit(0) once Python threads have ended and
    atexit handlers have run, as at a normal exit. In one process it returns."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import atexit, threading, time\nfrom machinery import exits\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread ended', flush=True))).start()\n"
        "exits.exit_worker()\n"
        "print('returned', flush=True)\n")
    for world, expected in (("2", "thread ended\natexit ran\n"), ("1", "returned\nthread ended\natexit ran\n")):
        env = dict(os.environ, PYTHONPATH=ROOT, WORLD_SIZE=world)
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout) == (0, expected), done.stderr
