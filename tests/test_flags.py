"""Every stage checks its whole configuration before it loads a model or writes a file: each impossible or
contradictory value stops it with one line naming the flag, the value and what is allowed. Each stage's main runs
in an empty working directory, which must stay empty."""
import dataclasses
import json
import os
import sys

import pytest

import evaluate
import rl
import sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one impossible value per numeric flag, as typed on the command line
RL_BAD = dict(
    seed="-1", steps="-1", weight_decay="-0.1", grad_clip="-1", clip_high="-0.1", entropy_coef="-1", kl_coef="-1",
    tis_cap="-1", adv_eps="-1", tool_bonus_per_turn="-0.1", overlong_buffer="-1", overlong_factor="-1",
    eval_every="-1", eval_temperature="-1", eval_limit="-1", save_every="-1", log_samples="-1",
    save_trajectories="-1", epochs="0", prompts_per_step="0", mini_batch_prompts="0", ppo_epochs="0",
    micro_batch_tokens="0", logprob_micro_batch_tokens="0", score_workers="0", eval_n="0", keep_checkpoints="0",
    samples_per_prompt="1", clip_c="1", lr="0", dist_timeout="0", temperature="0", code_test_timeout="0",
    clip_low="1", beta1="1", beta2="-0.1", tool_bonus_cap="1", eval_top_p="0",
    kv_memory_utilization="1.5", top_p="1.5", top_k="-1",
    max_prompt_tokens="0", max_response_tokens="0", max_turns="0", max_parallel_calls="0", tool_output_chars="-1",
    tool_timeout="0", tool_memory_mb="0", sandbox_workers="-1")
RL_MORE = [  # more impossible numbers, bad choices and contradictions: (flags, the flag named)
    (["--model=runs/nope"], "model"),   # a mistyped local path, not a hub id to download
    (["--prompts_per_step=0"], "prompts_per_step"), (["--samples_per_prompt=0"], "samples_per_prompt"),
    (["--lr=nan"], "lr"), (["--tool_timeout=inf"], "tool_timeout"), (["--loss_agg=mean"], "loss_agg"),
    (["--attn_backend=xformers"], "attn_backend"), (["--save_dtype=int8"], "save_dtype"),
    (["--enable_thinking=maybe"], "enable_thinking"), (["--sandbox_require=landlock,bogus"], "sandbox_require"),
    (["--prompts_per_step=6", "--mini_batch_prompts=4"], "prompts_per_step"),
    (["--max_response_tokens=100", "--overlong_buffer=200"], "overlong_buffer"),
    (["--data=missing.jsonl"], "data"), (["--eval_data=missing.jsonl"], "eval_data")]
SFT_BAD = dict(seed="-1", weight_decay="-1", grad_clip="-1", max_steps="-1", eval_size="-1", eval_every="-1",
               save_every="-1", epochs="0", batch_size="0", keep_train_state="0", log_every="0", max_len="1",
               lr="0", dist_timeout="-5", warmup_ratio="1", beta1="1", beta2="-0.5", micro_batch_tokens="100")
SFT_MORE = [(["--model=./nope"], "model"), (["--too_long=wrap"], "too_long"),
            (["--attn_backend=xformers"], "attn_backend"),
            (["--save_dtype=int8"], "save_dtype"), (["--device=tpu"], "device"), (["--lr=inf"], "lr"),
            (["--data=missing.jsonl"], "data"), (["--model=toy", "--data=missing.jsonl"], "data")]
EVAL_BAD = dict(n="0", temperature="-1", top_p="0", top_k="-1", max_prompt_tokens="0", max_response_tokens="0",
                max_turns="0", max_parallel_calls="0", tool_output_chars="-1", tool_timeout="0", tool_memory_mb="0",
                code_test_timeout="0", limit="-1", problems_per_batch="-1", seed="-1", sandbox_workers="-1")
EVAL_MORE = [(["--model=runs/nope"], "model"), (["--pass_k=1,64"], "pass_k"),
             (["--pass_k=one"], "pass_k"), (["--dtype=int4"], "dtype"),
             (["--attn_backend=xformers"], "attn_backend"), (["--enable_thinking=maybe"], "enable_thinking"),
             (["--sandbox_require=nothing"], "sandbox_require"), (["--n=1", "--filter_out=kept.jsonl"], "n"),
             (["--data=", "--benchmarks=,"], "benchmarks"), (["--data=missing.jsonl"], "data"), (["--model="], "model")]


def numeric_fields(cls):
    return {f.name for f in dataclasses.fields(cls) if type(f.default) in (int, float)}


def refused(main, argv, flag, cwd):
    """main(argv) stops with one line that names --flag, and the empty cwd stays empty."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    message = str(stop.value.code)
    assert message.startswith(f"--{flag}="), message
    assert any(word in message for word in ("allowed", "no such", "required", "no CUDA")), message
    assert "\n" not in message, message
    assert os.listdir(cwd) == [], (argv, os.listdir(cwd))
    return message


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.fixture
def problems(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2", "kind": "math"}) + "\n")
    return str(path)


def test_every_numeric_flag_is_checked():
    assert set(RL_BAD) == numeric_fields(rl.Config)
    assert set(SFT_BAD) == numeric_fields(sft.Config)
    assert set(EVAL_BAD) == numeric_fields(evaluate.EvalConfig)


def test_rl_refuses_each_bad_value_before_any_work(empty_cwd, problems, monkeypatch):
    monkeypatch.setattr(rl, "distributed", None)   # reached only past the checks
    base = ["--model=unused", f"--data={problems}", "--out_dir=run"]
    cases = [([f"--{k}={v}"], k) for k, v in RL_BAD.items()] + RL_MORE
    said = [refused(rl.main, base + flags, flag, empty_cwd) for flags, flag in cases]
    assert said[len(RL_BAD)] == "--model='runs/nope': no such directory (a hub id looks like owner/name)"
    assert said[len(RL_BAD) + 1] == "--prompts_per_step=0: allowed: an integer >= 1"
    assert said[-2] == "--data='missing.jsonl': no such file"
    assert refused(rl.main, ["--steps=5"], "data", empty_cwd) == \
        "--data='data/rl.jsonl': no such file (data/prepare.py rl; or --preset toy)"


def test_sft_refuses_each_bad_value_before_any_work(empty_cwd, problems, monkeypatch):
    monkeypatch.setattr(sft, "distributed", None)
    base = ["--model=unused", f"--data={problems}", "--out_dir=run"]
    cases = [([f"--{k}={v}"], k) for k, v in SFT_BAD.items()] + SFT_MORE
    said = [refused(sft.main, base + flags, flag, empty_cwd) for flags, flag in cases]
    assert said[list(SFT_BAD).index("micro_batch_tokens")] == \
        "--micro_batch_tokens=100: allowed: at least --max_len"


def test_sft_checks_its_data_before_writing(empty_cwd, tmp_path):
    """--model toy builds a base model into out_dir: not before the data file has been read through."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n{not json\n")
    with pytest.raises(SystemExit, match=r"^bad SFT data: .*bad\.jsonl:2: not valid JSON"):
        sft.main(["--model=toy", f"--data={bad}"])
    assert os.listdir(empty_cwd) == []


def test_evaluate_refuses_each_bad_value_before_any_work(empty_cwd, problems, monkeypatch):
    from machinery import distributed
    monkeypatch.setattr(distributed, "distributed", None)
    base = ["--model=unused", f"--data={problems}"]
    cases = [([f"--{k}={v}"], k) for k, v in EVAL_BAD.items()] + EVAL_MORE
    said = [refused(evaluate.main, base + flags, flag, empty_cwd) for flags, flag in cases]
    assert said[0] == "--n=0: allowed: an integer >= 1"
    assert said[2] == "--top_p=0.0: allowed: a number in (0, 1]"


def test_chat_refuses_bad_values(empty_cwd):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import chat
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    for flags, flag in ((["--top_p=0"], "top_p"), (["--max_turns=0"], "max_turns"), (["--device=tpu"], "device"),
                        (["--model="], "model")):
        refused(chat.main, ["--model=unused"] + flags, flag, empty_cwd)
