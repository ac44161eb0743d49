"""scripts/gpu_check.py, the first command on a GPU machine, kept from rotting: its CPU mode (tiny shapes, the
torchrun rl.py and sft.py steps included) end to end, every row ok or skipped with a reason; and a failing row
does not stop the others."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check  # noqa: E402

ROWS = ["logits_fp32", "logits_bf16", "logprobs_fp32", "logprobs_bf16", "backward_no_sync", "generate_fp32",
        "graphs_vs_eager", "graph_pool", "fsdp_graph", "prefill_no_math", "memory_plan", "allocator", "decode_1",
        "decode_2", "rl_step", "sft_step"]
NEEDS_GPU = {"backward_no_sync", "graphs_vs_eager", "graph_pool", "fsdp_graph", "prefill_no_math"}


def test_cpu_mode_end_to_end(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu", f"--out={out}", f"--work={tmp_path / 'w'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ROWS
    for name, row in rows.items():
        assert row["status"] == ("skipped" if name in NEEDS_GPU else "ok"), (name, row)
        assert row["result"] and row["check"] in proc.stdout  # the table names every row
    assert report["mode"] == "cpu" and report["environment"]["torch"] == gpu_check.torch.__version__
    assert rows["generate_fp32"]["rows_identical"] == rows["generate_fp32"]["rows"]
    assert rows["logprobs_fp32"]["grad_rel_diff"] < 1e-4
    assert rows["decode_1"]["ours"]["decode"] > 0 and rows["decode_2"]["kv_pool_tokens"] > 0
    assert rows["rl_step"]["time"]["step"] > 0 and rows["rl_step"]["response_length"] > 0
    assert len(rows["sft_step"]["record_tokens"]) == 2 and rows["sft_step"]["tokens"] > 0
    # the plan where clipping dominates and where activations do; each stage's allocator settings
    assert list(rows["memory_plan"]["measured_gib"]) == ["clipping", "activations"]
    assert {v["settings"] for v in rows["allocator"]["stages"].values()} == {"expandable_segments:True"}
    assert "expandable_segments:True" in report["environment"]["allocator"]


def test_a_failing_row_is_reported_not_raised():
    def broken():
        raise ValueError("no such kernel")

    def mismatch():
        return dict(ok=False, result="3/4 rows identical")

    def gpu_only():
        raise gpu_check.Skip("CUDA only")

    rows = [gpu_check.run_row(name, name, fn) for name, fn in (("a", broken), ("b", mismatch), ("c", gpu_only))]
    assert [r["status"] for r in rows] == ["FAIL", "FAIL", "skipped"]
    assert rows[0]["result"] == "ValueError: no such kernel" and "raise ValueError" in rows[0]["traceback"]
    assert rows[2]["result"] == "CUDA only"
    assert "FAIL" in gpu_check.table(rows) and "3/4 rows identical" in gpu_check.table(rows)
