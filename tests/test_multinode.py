"""Several nodes: two torchrun launches on 127.0.0.1 stand for two nodes (gloo, one process each),
in separate working directories or on a shared out_dir; and each check of
machinery/distributed.py and machinery/checkpoints.py with faked ranks and environments."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from machinery import checkpoints as checkpoint
from machinery import distributed as common
from machinery import distributed as multinode
import rl
from test_rl import as_args, max_diff, metrics, small_run, tool_policy, weights  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(node, port, cwd, script, args, nodes=2):
    """One "node": torchrun with one process, rendezvous at 127.0.0.1:port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
           "--nproc_per_node=1", f"--node_rank={node}", "--master_addr=127.0.0.1",
           f"--master_port={port}", os.path.join(ROOT, script), "--", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill_node(proc):
    """SIGKILL a node: its torchrun agent and the workers it started (each in a session of its
    own, so not in the agent's process group)."""
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    for pid in [proc.pid, *map(int, workers.stdout.split())]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def nodes(cwds, script, args):
    """Both nodes started; on the way out, any still running are killed."""
    port = free_port()
    procs = [launch(n, port, cwd, script, args) for n, cwd in enumerate(cwds)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                kill_node(p)
                p.communicate()


def two_nodes(cwds, script, args, timeout=240):
    with nodes(cwds, script, args) as procs:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], outs


# ----------------------------------------------------------------- two "nodes" on one machine

def test_nodes_without_a_shared_disk_stop_at_start_up(tmp_path):
    """The toy preset from two working directories: rank 1 sees neither rank 0's out_dir nor the
    problems rank 0 built; both stop at once with one line naming the rank and what it misses
    (before: the run trained, ended 0, and left checkpoints nobody could resume)."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for c in cwds:
        c.mkdir()
    codes, outs = two_nodes(cwds, "rl.py", ["--preset=toy", "--steps=1", "--eval_data="])
    assert codes[0] != 0 and codes[1] != 0, outs[0][-2000:]
    line = [x for x in outs[0].splitlines() if "cannot see" in x]
    assert line, outs[0][-3000:]
    assert "rank 1 (" in line[0] and "out_dir runs/toy/rl" in line[0], line[0]
    assert "runs/toy/data/train.jsonl (missing)" in line[0], line[0]
    assert not (cwds[1] / "runs" / "toy" / "rl").exists()


def test_nodes_that_would_evaluate_different_weights_stop(tiny_ckpt, tool_policy, tmp_path):
    """The same --model path names another model on each node's disk (each its own newest
    policy): both stop with one line naming each rank's weights hash, instead of reporting the
    mean of two models under one name."""
    import shutil
    from data.tiny import build_tiny_checkpoint
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(tiny_ckpt, cwds[0] / "runs" / "policy")
    build_tiny_checkpoint(str(cwds[1] / "runs" / "policy"), seed=1)
    args = ["--model=runs/policy", f"--data={tool_policy[2]}", "--n=1", "--limit=1",
            "--max_response_tokens=8", "--out=runs/eval", "--sandbox_workers=1"]
    codes, outs = two_nodes(cwds, "evaluate.py", args)
    assert codes[0] != 0 and codes[1] != 0, outs[0][-2000:]
    line = [x for x in outs[0].splitlines() if "different models" in x]
    assert line and "rank 0" in line[0] and "rank 1 (" in line[0], outs[0][-3000:]


@pytest.fixture(scope="module")
def one_node_two_processes(tool_policy, tmp_path_factory):
    """Three steps on one node with two processes: the run the two nodes must reproduce."""
    out = tmp_path_factory.mktemp("one_node")
    options = small_run(tool_policy, out, steps=3, save_every=1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "rl.py", *as_args(options)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


def test_sampler_logprobs_equal_the_trainers_after_an_update(one_node_two_processes):
    """The CPU sampler multiplies by cached transposed weights; FSDP2 gathers updated weights into
    the same storage with the same version counter, so after step 1's update the cache was
    stale whenever the allocator handed back the same address (from step 3 here: mismatch_max
    0.04). Every step's sampler log-probs must be the trainer's to rounding."""
    steps = metrics(one_node_two_processes)
    assert sorted(steps) == [1, 2, 3]
    for step, row in steps.items():
        assert row["mismatch_max"] < 1e-4, (step, row["mismatch_max"])


def test_two_nodes_match_one_node_and_resume_after_a_node_is_killed(one_node_two_processes,
                                                                     tool_policy, tmp_path):
    """Two nodes on a shared out_dir: node 1 is killed once step 1 is saved, node 0 stops too;
    the same command on both nodes resumes from step 1, and step 2 is the one-node run's (which
    goes on to a third step: the steps before are the same)."""
    out = tmp_path / "shared"
    args = as_args(small_run(tool_policy, out, steps=2, save_every=1))
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for c in cwds:
        c.mkdir()
    with nodes(cwds, "rl.py", args) as procs:
        deadline = time.time() + 180
        while (time.time() < deadline and procs[1].poll() is None
               and not (out / "step_000001").exists()):
            time.sleep(0.05)
        kill_node(procs[1])
        t_kill = time.time()
        first = procs[0].communicate(timeout=120)[0]
        stopped_in = time.time() - t_kill
    assert (out / "step_000001").exists() and procs[0].returncode != 0, first[-2000:]
    assert not (out / "step_000002").exists()
    print(f"node 0 stopped {stopped_in:.1f} s after node 1 was killed")
    codes, outs = two_nodes(cwds, "rl.py", args)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "resumed from" in outs[0] and "at step 1" in outs[0]
    a, b = metrics(str(out))[2], metrics(one_node_two_processes)[2]
    assert a["reward"] == b["reward"] and a["response_length"] == b["response_length"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert max_diff(weights(str(out), 2), weights(one_node_two_processes, 2)) < 1e-6
    assert not [n for n in os.listdir(out) if n.startswith(".tmp_step_")]


# ----------------------------------------------------------------- faked ranks and environments

def test_srun_without_torchrun_is_refused(monkeypatch):
    """`srun python rl.py` gives every task SLURM_PROCID and no RANK: each would train alone on
    the same out_dir. Refused in one line that says how to launch; one Slurm task runs."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(common.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(common.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(common.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    with pytest.raises(SystemExit, match=r"Slurm task 1 of 8 without torchrun.*srun .*torchrun"):
        common.setup_distributed()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")   # srun -n 1 python rl.py
    assert common.setup_distributed()[:2] == (0, 1)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")        # python rl.py in a batch script
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert common.setup_distributed()[:2] == (0, 1)


def test_collective_timeout_is_an_option_with_a_training_default(monkeypatch):
    """A stuck node stops the job after --dist_timeout minutes (default 30, was 2 hours)."""
    seen = {}
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(common.dist, "init_process_group", lambda backend, **kw: seen.update(kw))
    monkeypatch.setattr(common.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(common.dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    common.setup_distributed()
    assert seen["timeout"].total_seconds() == 30 * 60
    common.setup_distributed(timeout_minutes=5)
    assert seen["timeout"].total_seconds() == 5 * 60
    asked = {}

    @contextlib.contextmanager
    def fake(device="auto", timeout_minutes=None):
        asked["minutes"] = timeout_minutes
        raise SystemExit("stop here")
        yield
    monkeypatch.setattr(rl, "distributed", fake)
    with pytest.raises(SystemExit):
        rl.train(rl.parse_args(["--preset=toy", "--dist_timeout=7"]))
    assert asked["minutes"] == 7.0


def test_evaluation_gathers_on_a_long_timeout_group(tiny_ckpt, monkeypatch, tmp_path):
    """evaluate()'s results gather waits as long as the slowest rank's share needs, on a gloo
    group with its own timeout, not the training collectives' (faked rank 0 of 2)."""
    import evaluate
    from model import Transformer
    from transformers import AutoTokenizer
    calls = []
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append(("new_group", kw)) or "G")

    def gather(parts, obj, group=None):
        calls.append(("gather", group))
        parts[:] = [obj, []]
    monkeypatch.setattr(dist, "all_gather_object", gather)
    common._gather_groups.clear()
    problems = [{"prompt": "What is 1 + 1?", "answer": "2", "kind": "math"}]
    cfg = evaluate.EvalConfig(n=1, max_response_tokens=4, max_turns=1, problems_per_batch=1)
    model = Transformer.from_pretrained(tiny_ckpt).eval()
    evaluate.evaluate(model, AutoTokenizer.from_pretrained(tiny_ckpt), problems, cfg,
                      progress=False)
    common._gather_groups.clear()
    assert ("gather", "G") in calls
    made = [kw for name, kw in calls if name == "new_group"]
    assert made[0]["backend"] == "gloo" and made[0]["timeout"] > 4 * common.DIST_TIMEOUT


def test_every_rank_must_evaluate_the_same_model(tiny_ckpt, tmp_path, monkeypatch):
    """Two ranks that resolved different models (each its own disk's newest policy) stop with one
    line naming both paths and weight hashes; the same model on both passes."""
    import shutil
    from data.tiny import build_tiny_checkpoint
    other = build_tiny_checkpoint(str(tmp_path / "other"), seed=1)
    rank1 = {}
    monkeypatch.setattr(multinode, "all_gather_list",
                        lambda items: list(items) + [rank1["view"]])
    rank1["view"] = (other, multinode.weights_hash(other), "node1:/w")
    with pytest.raises(SystemExit, match=r"different models: rank 0 .*tiny.*; rank 1 \(node1"):
        multinode.same_model(tiny_ckpt)
    copy = shutil.copytree(tiny_ckpt, str(tmp_path / "copy"))
    rank1["view"] = (tiny_ckpt, multinode.weights_hash(copy), "node1:/w")
    assert multinode.same_model(tiny_ckpt) == tiny_ckpt


def test_batch_that_does_not_split_says_what_would(monkeypatch):
    """16 problems per mini-batch on 24 processes: the error says which world sizes work and
    which settings would work on 24."""
    @contextlib.contextmanager
    def fake(device="auto", timeout_minutes=None):
        yield 0, 24, torch.device("cpu"), True
    monkeypatch.setattr(rl, "distributed", fake)
    monkeypatch.setenv("WORLD_SIZE", "24")   # torchrun's; checked before anything is loaded
    # no process group yet, as at startup (tests calling setup_distributed leave a world of one)
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    with pytest.raises(SystemExit) as e:
        rl.train(rl.Config())
    assert "run 1, 2, 4, 8, 16 processes" in str(e.value)
    assert "--mini_batch_prompts 24 --prompts_per_step 96" in str(e.value)


def test_hub_ids_are_downloaded_once_per_node(monkeypatch):
    """Local rank 0 of each node downloads (its own cache), the node's other ranks read it."""
    import huggingface_hub
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda path, local_files_only=False: calls.append(local_files_only) or "/c")
    monkeypatch.setattr(common.dist, "get_rank", lambda: 8)   # global rank 8: node 1's first
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert common.resolve_model("owner/model") == "/c" and calls == [False]
    calls.clear()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert common.resolve_model("owner/model") == "/c" and calls == [True]


def test_a_mistyped_local_path_is_not_taken_for_a_hub_id(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(path, local_files_only=False):
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache\nmore")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setattr(common.dist, "get_rank", lambda: 0)
    for path in ("runs/nope", "./nope", "/nope/model", str(tmp_path / "nope")):
        with pytest.raises(SystemExit, match="no such directory") as e:
            common.resolve_model(path)
        assert "\n" not in str(e.value) and path in str(e.value)
    with pytest.raises(SystemExit, match="could not be fetched .*LocalEntryNotFoundError") as e:
        common.resolve_model("owner/model")
    assert "\n" not in str(e.value)


def test_a_truncated_model_file_is_named(tiny_ckpt, tmp_path):
    import shutil
    path = shutil.copytree(tiny_ckpt, str(tmp_path / "m"))
    file = os.path.join(path, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)
    with pytest.raises(SystemExit, match=r"model.safetensors: truncated \(\d+ of \d+ bytes\)"):
        common.resolve_model(path)
    os.truncate(file, 5)
    with pytest.raises(SystemExit, match="model.safetensors: truncated or not a safetensors"):
        common.resolve_model(path)


@pytest.fixture
def saved_run(tiny_ckpt, tmp_path):
    """Checkpoints of steps 1 and 2 of a tiny model in one process, both keeping train_state."""
    from model import Transformer
    from transformers import AutoTokenizer
    out = str(tmp_path / "run")
    with common.distributed():
        model = Transformer.from_pretrained(tiny_ckpt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tok = AutoTokenizer.from_pretrained(tiny_ckpt)
        for step in (1, 2):
            model(torch.zeros(1, 3, dtype=torch.long)).float().sum().backward()
            opt.step()
            checkpoint.save_checkpoint(out, step, model, opt, tok, {"config": {}}, keep=2)
        yield out


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(saved_run, capsys):
    state = os.path.join(saved_run, "step_000002", "train_state")
    shard = [n for n in os.listdir(os.path.join(state, "dcp")) if n.endswith(".distcp")][0]
    os.truncate(os.path.join(state, "dcp", shard), 100)
    assert checkpoint.latest_resumable(saved_run).endswith("step_000001")
    said = capsys.readouterr().out
    assert f"{shard}: truncated" in said and "resuming from" in said
    os.truncate(os.path.join(state, "trainer.pt"), 10)
    assert checkpoint.damaged(os.path.join(saved_run, "step_000002")).endswith(
        "trainer.pt: unreadable (RuntimeError)")
    for name in ("trainer.pt", "rng_rank0.pt"):  # the older one damaged too: nothing to resume
        path = os.path.join(saved_run, "step_000001", "train_state", name)
        os.truncate(path, 10)
    stop = r"cannot resume: .*step_000002.*trainer.pt: unread.*no older whole"
    with pytest.raises(SystemExit, match=stop):
        checkpoint.latest_resumable(saved_run)


def test_resume_is_rank_0s_decision_or_an_error(saved_run, monkeypatch):
    """Rank 1 on another disk: when rank 0 sees no checkpoint but rank 1 does, or rank 1 cannot
    read the one rank 0 chose, every rank stops with one line instead of a per-disk accident."""
    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 1)
    # rank 0's view as it arrives on rank 1 (a tuple: what rank 1 sends; else the list of old)
    monkeypatch.setattr(checkpoint, "broadcast_object",
                        lambda obj: (None, []) if isinstance(obj, tuple) else [])
    monkeypatch.setattr(checkpoint, "all_gather_list",
                        lambda items: [("node0", [], False)] + list(items), raising=False)
    with pytest.raises(SystemExit, match=r"rank 1 on .* sees .*step_000002, rank 0 none"):
        checkpoint.latest_resumable(saved_run)
    elsewhere = "/elsewhere/step_000009"
    monkeypatch.setattr(checkpoint, "broadcast_object",
                        lambda obj: (elsewhere, []) if isinstance(obj, tuple) else [(9, elsewhere)])
    with pytest.raises(SystemExit, match=f"rank 1 on .* cannot read {elsewhere}"):
        checkpoint.latest_resumable(saved_run)


def test_transposed_weights_are_remade_after_an_optimizer_step():
    """FSDP2 gathers a step's new weights into the same storage and keeps the version counter
    (as _unsafe_preserve_version_counter does here): the CPU sampler's transposed copies must
    still follow the update the optimizer made (on the shards: another tensor)."""
    from machinery import fast_sampling as fastkv
    from model import Linear
    lin = Linear(4, 3)
    shard = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([shard], lr=1.0)
    copies = fastkv.transposed_weights(lin)
    shard.grad = torch.ones(2)
    opt.step()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(lin.weight):
        lin.weight.add_(1.0)
    copies = fastkv.transposed_weights(lin, copies)
    assert torch.equal(copies[lin][1], lin.weight.detach().t())
    again = fastkv.transposed_weights(lin, copies)   # no update since: the same copy, not remade
    assert again[lin][1] is copies[lin][1]


def test_a_checkpoint_not_written_whole_is_not_put_in_place(saved_run, tiny_ckpt, monkeypatch):
    """save_checkpoint reads its checkpoint back before renaming it into place: a trainer.pt
    written short (a full disk) stops the run naming the file; step 2 stays the one to resume."""
    from model import Transformer
    from transformers import AutoTokenizer
    model = Transformer.from_pretrained(tiny_ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = torch.save

    def short(obj, f, *args, **kwargs):
        real(obj, f, *args, **kwargs)
        if str(f).endswith("trainer.pt"):
            os.truncate(f, 10)
    monkeypatch.setattr(checkpoint.torch, "save", short)
    with pytest.raises(SystemExit, match=r"step 3 was not written whole: .*trainer.pt: unread"):
        checkpoint.save_checkpoint(saved_run, 3, model, opt, AutoTokenizer.from_pretrained(
            tiny_ckpt), {"config": {}}, keep=2)
    monkeypatch.undo()
    assert checkpoint.latest_resumable(saved_run).endswith("step_000002")
    assert os.readlink(os.path.join(saved_run, "final")) == "step_000002"


@pytest.mark.parametrize("stage", ["rl", "sft", "evaluate"])
def test_each_stage_sets_the_allocator_before_cuda(stage, tiny_ckpt, tmp_path, monkeypatch):
    """Expandable segments are asked for before CUDA can start in each stage's entry (distributed
    set-up is the first to touch CUDA), unless the user set the allocator's options."""
    import importlib
    module, seen, names = importlib.import_module(stage), [], ("PYTORCH_ALLOC_CONF",
                                                                  "PYTORCH_CUDA_ALLOC_CONF")

    def first_cuda(*args, **kwargs):
        seen.append([os.environ.get(k) for k in names])
        raise SystemExit("stop before CUDA")
    monkeypatch.setattr(common, "setup_distributed", first_cuda)
    data = tmp_path / "problems.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2", "kind": "math"}\n')
    argv = {"rl": [], "sft": [], "evaluate": [f"--model={tiny_ckpt}", f"--data={data}"]}[stage]
    for user in ({}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}):
        for name in names:
            monkeypatch.setenv(name, "")   # so that monkeypatch removes what the stage sets
            monkeypatch.delenv(name)
        for name, value in user.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit, match="stop before CUDA"):
            module.main(argv)
    assert seen == [["expandable_segments:True", None], [None, "max_split_size_mb:256"]]


def test_the_allocator_reads_the_setting():
    """torch 2.13's allocator reads the name allocator_defaults sets (its settings, as parsed)."""
    code = ("from machinery.distributed import allocator_defaults; allocator_defaults(); "
            "import torch; print(torch._C._accelerator_getAllocatorSettings())")
    env = {k: v for k, v in ENV.items() if not k.endswith("ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120).stdout
    assert out.strip() == "expandable_segments:True"


def test_saved_weights_take_the_asked_dtype(tiny_ckpt, tmp_path):
    """--save_dtype: "auto" saves in the dtype the base was stored in, a name in that dtype, None
    as the model is (fp32 on CPU)."""
    import json
    from safetensors import safe_open
    from model import Transformer
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    with common.distributed():
        model = Transformer.from_pretrained(tiny_ckpt)        # stored fp32, loaded fp32 on CPU
        model.config.dtype = "bfloat16"                       # as if the base were stored bf16
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step, dtype in ((1, "auto"), (2, "float16"), (3, None)):
            checkpoint.save_checkpoint(str(tmp_path), step, model, opt, tok, {"config": {}},
                                       dtype=dtype, keep=3)
    for step, want in ((1, "bfloat16"), (2, "float16"), (3, "float32")):
        path = tmp_path / f"step_{step:06d}"
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {f"torch.{want}"}
        assert json.load(open(path / "config.json"))["dtype"] == want
