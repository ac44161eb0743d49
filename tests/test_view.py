"""scripts/view.py: the run page holds every kept trajectory as stored, splits responses into blocks, and parses."""
import gzip
import json
import os
import random
from html.parser import HTMLParser

import pytest

from scripts import view

VOID = {"meta", "br", "hr", "img", "input", "link"}
CODE = 'x = 2 + 3\nprint(x < 9, "</script><!--")'


class Page(HTMLParser):
    """Strict enough for the page: every tag closed in order; the JSON scripts by id; the visible text."""

    def __init__(self, text):
        super().__init__()
        self.stack, self.scripts, self.text, self.errors = [], {}, [], []
        self.feed(text)
        self.close()
        assert not self.errors and not self.stack, (self.errors, self.stack)

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1][0] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
            return
        self.stack.pop()

    def handle_data(self, data):
        tag, attrs = self.stack[-1] if self.stack else ("", {})
        if tag == "script" and attrs.get("type") == "application/json":
            self.scripts[attrs["id"]] = json.loads(data)
        elif tag not in ("script", "style"):
            self.text.append(data)


def make_record(tok, uid, sample, step=None, rl=True, rng=random.Random(0)):
    """A trajectory record in the shared format: a reasoning turn with a tool call, the forced reply, an answer."""
    prompt = f"<|im_start|>user\nWhat is 2 + 3? (problem {uid}) \U0001F600<|im_end|>\n<|im_start|>assistant\n"
    call = json.dumps({"name": "code_interpreter", "arguments": {"code": CODE}})
    parts = [(f"Let me compute \U0001F389 sample {sample}.\n<tool_call>\n{call}\n</tool_call><|im_end|>", 1),
             ("\n<|im_start|>user\n<tool_response>\nTrue </script>\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n", 0),
             (f"The answer is \\boxed{{{5 + sample % 2}}}.<|im_end|>", 1)]
    ids, mask = [], []
    for text, m in parts:
        new = tok.encode(text, add_special_tokens=False)
        ids, mask = ids + new, mask + [m] * len(new)
    logprobs = [-round(rng.random(), 6) if m else 0.0 for m in mask]
    correct = sample % 2 == 0
    rec = dict(problem_index=int(uid[-1]), sample_index=sample, prompt_ids=tok.encode(prompt, add_special_tokens=False),
               response_ids=ids, loss_mask=mask, logprobs=logprobs, text=tok.decode(ids, skip_special_tokens=False),
               tool_calls=[{"name": "code_interpreter", "arguments": {"code": CODE}, "status": "ok",
                           "output": "True </script>\n", "turn": 0}], num_turns=2,
               finish_reason="stop", uid=uid, benchmark="toy", kind="math", score=float(correct), correct=correct,
               pred=str(5 + sample % 2), num_tool_calls=1, call_status=["ok"], response_tokens=len(ids),
               sampled_tokens=sum(mask), tokens_before_first_call=mask.index(0))
    if rl:
        trainer = [lp + (0.5 if i == 3 else 1e-4 * i) if m else 0.0 for i, (lp, m) in enumerate(zip(logprobs, mask))]
        rec.update(step=step, reward=1.0 if correct else -1.0, advantage=0.7 if correct else -0.7,
                   trainer_logprobs=trainer, prompt=prompt)
    return rec


def write_jsonl(path, records):
    with (gzip.open(path, "wt", encoding="utf-8") if path.endswith(".gz") else open(path, "w")) as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def build(run_dir, *args):
    out = os.path.join(run_dir, "page.html")
    view.main([str(run_dir), "--out", out, *args])
    text = open(out, encoding="utf-8").read()
    return text, Page(text)


def embedded(page):
    return sorted((d["record"] for d in page.scripts.values()), key=lambda r: (r.get("step") or 0, r["uid"],
                                                                               r["sample_index"]))


@pytest.fixture
def rl_run(tmp_path, tiny_tokenizer, tiny_ckpt):
    run = tmp_path / "rl"
    os.makedirs(run / "trajectories")
    os.symlink(tiny_ckpt, run / "final")   # where a finished run keeps its tokenizer
    steps = [dict(event="step", step=s, reward=0.1 * s, accuracy=0.5, tool_calls_per_traj=1.0, response_length=40.0,
                  entropy=0.3, clip_high=0.0, clip_low=0.01, time={"step": 1.0}) for s in (1, 2, 3)]
    steps[2]["eval"] = {"step": 3, "accuracy": 0.75}
    write_jsonl(str(run / "metrics.jsonl"), [{"event": "start", "step": 0, "config": {}}] + steps)
    records = {s: [make_record(tiny_tokenizer, f"p{g}", k, step=s) for g in range(2) for k in range(2)] for s in (1, 3)}
    write_jsonl(str(run / "trajectories" / "step_000001.jsonl.gz"), records[1])
    write_jsonl(str(run / "trajectories" / "step_000003.jsonl"), records[3])
    return run, records[1] + records[3]


def test_rl_page_holds_every_trajectory_as_stored(rl_run):
    run, records = rl_run
    text, page = build(run)
    assert embedded(page) == records   # every kept trajectory; its text, masks, log-probs exactly as stored
    visible = "".join(page.text)
    for needle in (CODE, "True </script>", "Let me compute \U0001F389 sample 1.", "\\boxed{6}.", "reward +1.000",
                   "adv -0.700", "What is 2 + 3? (problem p1) \U0001F600", "step 3 · 2 groups · 4 trajectories"):
        assert needle in visible, needle
    convs = visible.split("Trajectories")[1]
    for prompt in {r["prompt"] for r in records}:
        convs = convs.replace(prompt, "")
    assert "<|im_end|>" not in convs and "<|im_start|>" not in convs   # the conversation without the scaffolding
    for d in page.scripts.values():   # token strings: one per token, multi-byte characters whole
        assert len(d["pieces"]) == len(d["record"]["response_ids"]) and "".join(d["pieces"]) == d["record"]["text"]
        assert not any("\ufffd" in p for p in d["pieces"])
    # curves: the metrics present, clip_dual absent from the file is skipped, the eval point drawn
    assert all(f">{k}" in text for k in ("reward", "entropy", "clip_high", "clip_low")) and ">clip_dual" not in text
    assert text.count('class="ev"') == 1 and text.count('<svg class="chart"') == 7
    assert "http://" not in text and "https://" not in text and "<link" not in text   # nothing fetched
    # steps chosen: --steps, and at most --max_steps spread evenly
    assert {r["step"] for r in embedded(build(run, "--steps", "2-3")[1])} == {3}
    assert view.choose_steps(list(range(1, 101)), "", 5) == [1, 26, 51, 75, 100]
    sizes = dict.fromkeys(range(1, 101), 10)
    assert view.choose_steps(list(range(1, 101)), "", 5, sizes, 30) == [1, 51, 100]   # fewer, to stay under budget
    assert view.choose_steps(list(range(1, 101)), "", 5, sizes, 1) == [100]
    assert view.data_size(str(run / "trajectories" / "step_000001.jsonl.gz")) == sum(
        len(json.dumps(r)) + 1 for r in records[:4])


def test_eval_dir_and_no_tokenizer(tmp_path, tiny_tokenizer, tiny_ckpt):
    run = tmp_path / "eval"
    os.makedirs(run)
    recs = [make_record(tiny_tokenizer, f"q{g}", k, rl=False) for g in range(3) for k in range(2)]
    write_jsonl(str(run / "trajectories.rank0.jsonl"), recs[:3])
    write_jsonl(str(run / "trajectories.rank1.jsonl"), recs[3:])
    overall = {"avg@2": 0.5, "pass@2": 1.0, "headline": 0.5, "tools": {"tool_calls_per_response": 1.0}}
    json.dump({"benchmarks": {"toy": overall}, "overall": overall, "model": tiny_ckpt}, open(run / "summary.json", "w"))
    text, page = build(run)
    assert embedded(page) == sorted(recs, key=lambda r: (r["uid"], r["sample_index"]))
    visible = "".join(page.text)
    assert "score 1.00 correct" in visible and "score 0.00 wrong" in visible and "reward" not in visible
    assert "What is 2 + 3? (problem q2) \U0001F600" in visible   # the prompt decoded from prompt_ids
    assert "pass@2" in visible and f"tokenizer: {os.path.relpath(tiny_ckpt)}" in visible
    os.remove(run / "summary.json")   # no tokenizer anywhere: text blocks only, said on the page
    text, page = build(run)
    assert embedded(page) == sorted(recs, key=lambda r: (r["uid"], r["sample_index"]))
    assert "token strings unavailable" in text and all(d["pieces"] is None for d in page.scripts.values())
    assert CODE in "".join(page.text)


def test_response_blocks():
    calls = [{"status": "ok", "turn": 0}, {"status": "error", "turn": 0}, {"status": "bad_call", "turn": 1},
             {"status": "bad_call", "turn": 2}]
    text = ('<think>hm</think>\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "a"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "code_interpreter", "arguments": "{\\"code\\": \\"b\\"}"}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\nE\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n<tool_call>\nnot json\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
            'bad\n</tool_response><|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"code": "print<|im_end|>\n'
            '<|im_start|>user\n<tool_response>\nError: not closed with </tool_call>.\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\nso <tool_call>\n{"name": "code_int')
    blocks = view.response_blocks(text, calls)
    assert [(k, t, c and c["status"]) for k, t, c in blocks] == [
        ("text", "<think>hm</think>", None), ("call", "a", "ok"), ("call", "b", "error"), ("reply", "1", None),
        ("reply", "E", None), ("call", "not json", "bad_call"), ("reply", "bad", None),
        ("call", '{"code": "print', "bad_call"), ("reply", "Error: not closed with </tool_call>.", None),
        ("text", "so", None),
        ("call", '{"name": "code_int', None)]   # cut by the length budget: shown raw, not run


def test_page_from_a_short_toy_run(tmp_path, monkeypatch):
    import dataclasses
    import rl
    if "save_trajectories" not in {f.name for f in dataclasses.fields(rl.Config)}:
        pytest.skip("rl.py does not keep trajectories yet (--save_trajectories)")
    from data import toy
    monkeypatch.chdir(tmp_path)   # the toy preset writes under ./runs/toy
    toy.build(toy.DATA, n_train=8, n_heldout=4, sft=False)
    rl.train(rl.parse_args(["--preset=toy", "--steps=2", "--prompts_per_step=2", "--samples_per_prompt=2",
                            "--mini_batch_prompts=2", "--save_trajectories=1"]))
    run = tmp_path / "runs" / "toy" / "rl"
    records = [r for s in (1, 2) for r in view.read_jsonl(str(run / "trajectories" / f"step_{s:06d}.jsonl.gz"))]
    assert len(records) == 4 and all("trainer_logprobs" in r and "advantage" in r for r in records)
    text, page = build(run)
    assert embedded(page) == sorted(records, key=lambda r: (r["step"], r["uid"], r["sample_index"]))
    assert all("".join(d["pieces"]) == d["record"]["text"] for d in page.scripts.values())
    visible = "".join(page.text)
    for r in records:
        assert f"reward {r['reward']:+.3f}" in visible
        for kind, block, _ in view.response_blocks(r["text"], r["tool_calls"]):
            assert block in visible, (kind, block)
    assert text.count('class="ev"') == 2   # held-out accuracy before and after
    text, page = build(run / "eval" / "step_000002")   # the run's held-out evaluation, an evaluate.py directory
    assert len(page.scripts) == 4 and "tokenizer: " in "".join(page.text)


def test_token_view_outlines_only_gaps_above_rounding(tmp_path, tiny_tokenizer):
    """On CPU the trainer and the sampler agree to ~1e-6, below the 4 significant digits rl.py stores: the token
    view then outlines nothing and says so, instead of ranking rounding noise."""
    rec = make_record(tiny_tokenizer, "p0", 0, step=1)
    sampled = [i for i, m in enumerate(rec["loss_mask"]) if m]
    rec["trainer_logprobs"] = [lp + 1e-6 if m else 0.0 for lp, m in zip(rec["logprobs"], rec["loss_mask"])]
    run = tmp_path / "rl"
    os.makedirs(run / "trajectories")
    write_jsonl(str(run / "trajectories" / "step_000001.jsonl"), [rec])
    _, page = build(run)
    (shown,) = page.scripts.values()
    assert shown["outlined"] == [] and "agree to rounding (largest |diff| 1e-06" in shown["note"]
    assert "max |trainer-sampler| 1e-06 (rounding)" in "".join(page.text)
    rec["trainer_logprobs"][sampled[2]] -= 0.25   # one real gap: outlined alone
    assert view.gaps(rec, 20) == ([sampled[2]], "top 1 by |trainer - sampler| log-prob")


def test_evaluation_table_in_percent_as_the_terminal():
    overall = {"avg@4": 0.5, "pass@4": 0.75, "maj@4": 0.25, "headline": 0.5, "mean_score": 0.625, "problems": 8}
    table = view.summary_table({"overall": overall, "benchmarks": {"toy": overall}})
    assert "<th>avg@4 (%)</th>" in table and "<th>mean_score</th>" in table
    assert "<td>50.0</td><td>75.0</td><td>25.0</td><td>50.0</td><td>0.625</td><td>8</td>" in table


def test_a_narrower_page_never_replaces_the_default_one(rl_run, tmp_path, capsys):
    run, _ = rl_run
    view.main([str(run)])
    full = (run / "view.html").read_bytes()
    view.main([str(run), "--steps", "3"])   # fewer steps: a page of its own, the line says so
    assert (run / "view.html").read_bytes() == full
    assert "wrote " + str(run / "view_steps_3.html") in capsys.readouterr().out
    assert {r["step"] for r in embedded(Page((run / "view_steps_3.html").read_text()))} == {3}
    view.main([str(run), "--max_steps", "1"])
    assert (run / "view.html").read_bytes() == full and (run / "view_max_steps_1.html").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"empty: nothing to show \(no metrics.jsonl, summary"):
        view.main([str(empty)])
    assert os.listdir(empty) == []
