"""Host-memory figures of model.py (Linux, CPU), each run in its own process:
    python scripts/bench_memory.py logprobs chunked   # token_logprobs, fwd+bwd, T=8192, V=151936, entropy too
    python scripts/bench_memory.py logprobs full      # the same with full fp32 logits (log-probs only)
    python scripts/bench_memory.py load DIR           # from_pretrained: parameters, seconds, peak memory"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import Transformer, _ChunkedLogprobs  # noqa: E402


def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def logprobs(variant, T=8192, V=151936, D=128):
    torch.manual_seed(0)
    h, w = torch.randn(T, D, requires_grad=True), (torch.randn(V, D) * 0.02).requires_grad_()
    targets = torch.randint(0, V, (T,))
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current RSS
        f.write("5")
    base = peak_rss()
    if variant == "chunked":
        logp, ent = _ChunkedLogprobs.apply(h, w, targets, 1.0, True, 2**27)
        (logp.sum() + ent.sum()).backward()
    else:
        torch.log_softmax((h @ w.t()).float(), -1).gather(1, targets[:, None]).sum().backward()
    extra = peak_rss() - base - (h.numel() + w.numel()) * 4  # less the gradients either variant needs
    print(f"{variant}: extra peak memory, forward+backward, T={T} V={V}: {extra / 2**30:.2f} GiB")


def load(path):
    base, t0 = peak_rss(), time.time()
    m = Transformer.from_pretrained(path)
    print(f"loaded {m.config.model_type}, {m.num_params() / 1e6:.1f}M parameters in {time.time() - t0:.1f} s, "
          f"peak host memory {(peak_rss() - base) / 2**30:.2f} GiB above the process baseline")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("logprobs", "load"):
        raise SystemExit(__doc__)
    logprobs(sys.argv[2]) if sys.argv[1] == "logprobs" else load(sys.argv[2])
