"""model.py against transformers' Qwen2/Qwen3 on random tiny configs, checkpoints, packing, log-probs."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from model import ModelConfig, Transformer, cu_seqlens_from_lengths



@pytest.fixture(autouse=True, scope="module")
def no_grad():
    """Inference in this file (tests that need gradients enable them locally); restored afterwards
    so the switch does not leak into other files."""
    torch.set_grad_enabled(False)
    yield
    torch.set_grad_enabled(True)


def hf_model(kind, tie, tmp_path, **kw):
    torch.manual_seed(0)
    common = dict(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=tie, rope_theta=5000.0)
    common.update(kw)
    cfg = Qwen3Config(head_dim=24, **common) if kind == "qwen3" else Qwen2Config(**common)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights and biases so every parameter matters
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path)
    return ref


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(kind, tie, tmp_path):
    ref = hf_model(kind, tie, tmp_path)
    model = Transformer.from_pretrained(str(tmp_path))
    assert model.config.model_type == kind
    assert hasattr(model.model.layers[0].self_attn, "q_norm") == (kind == "qwen3")
    ids = torch.randint(0, 211, (3, 29))
    diff = (ref(ids).logits - model(ids)).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("tie", [False, True])
def test_save_pretrained_loads_in_transformers(tie, tmp_path):
    hf_model("qwen3", tie, tmp_path / "src")
    model = Transformer.from_pretrained(str(tmp_path / "src"))
    model.save_pretrained(str(tmp_path / "dst"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst")).eval()
    ids = torch.randint(0, 211, (2, 13))
    assert (back(ids).logits - model(ids)).abs().max().item() < 1e-5


def test_sharded_checkpoint_round_trip(tmp_path):
    ref = hf_model("qwen3", False, tmp_path / "src")
    model = Transformer.from_pretrained(str(tmp_path / "src"))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_bytes=50_000)
    index = json.load(open(tmp_path / "sharded" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 2
    assert not os.path.exists(tmp_path / "sharded" / "model.safetensors")
    ids = torch.randint(0, 211, (1, 11))
    ours = Transformer.from_pretrained(str(tmp_path / "sharded"))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded")).eval()
    assert (ours(ids) - ref(ids).logits).abs().max() < 1e-4
    assert (theirs(ids).logits - ref(ids).logits).abs().max() < 1e-5


def test_config_both_generations():
    v4 = dict(model_type="qwen3", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=4, rope_theta=1e6, rope_scaling=None,
              torch_dtype="bfloat16", tie_word_embeddings=True, bos_token_id=1)
    v5 = dict(v4, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, dtype="bfloat16")
    del v5["rope_theta"], v5["rope_scaling"], v5["torch_dtype"]
    a, b = ModelConfig.from_dict(v4), ModelConfig.from_dict(v5)
    assert a.rope_theta == b.rope_theta == 1e6 and a.dtype == b.dtype == "bfloat16"
    assert a.extra["bos_token_id"] == 1
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelConfig.from_dict(dict(v4, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="llama"):
        ModelConfig.from_dict(dict(v4, model_type="llama"))


def test_packed_varlen_equals_per_sequence(tmp_path):
    hf_model("qwen3", True, tmp_path)
    model = Transformer.from_pretrained(str(tmp_path))
    lengths = [5, 12, 1, 9]
    seqs = [torch.randint(0, 211, (1, n)) for n in lengths]
    packed = model(torch.cat(seqs, dim=1), cu_seqlens=cu_seqlens_from_lengths(lengths))
    separate = torch.cat([model(s) for s in seqs], dim=1)
    assert (packed - separate).abs().max() < 1e-5


def test_explicit_positions_shift_rope(tmp_path):
    hf_model("qwen3", True, tmp_path)
    model = Transformer.from_pretrained(str(tmp_path))
    ids = torch.randint(0, 211, (1, 7))
    base = model(ids)
    assert (model(ids, positions=torch.arange(7)[None]) - base).abs().max() == 0
    assert (model(ids, positions=torch.arange(3, 10)[None]) - base).abs().max() < 1e-4  # relative positions


class RecordingCache:
    """A minimal cache behind the kv_cache seam: keeps k/v per layer, attends over all held."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, layer, q, k, v):
        if layer in self.k:
            k, v = torch.cat([self.k[layer], k], 1), torch.cat([self.v[layer], v], 1)
        self.k[layer], self.v[layer] = k, v
        T, S = q.shape[1], k.shape[1]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)


def test_kv_cache_seam_incremental_decode(tmp_path):
    hf_model("qwen2", False, tmp_path)
    model = Transformer.from_pretrained(str(tmp_path))
    ids = torch.randint(0, 211, (2, 10))
    full = model(ids)
    cache = RecordingCache()
    steps = [model(ids[:, :6], kv_cache=cache)]
    for t in range(6, 10):
        steps.append(model(ids[:, t:t + 1], positions=torch.full((2, 1), t), kv_cache=cache))
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_match_log_softmax(temperature, tmp_path):
    hf_model("qwen3", True, tmp_path)
    model = Transformer.from_pretrained(str(tmp_path))
    ids = torch.randint(0, 211, (2, 23))
    targets = torch.randint(0, 211, (2, 23))
    with torch.enable_grad():
        logp, ent = model.token_logprobs(ids, targets, return_entropy=True, temperature=temperature,
                                         block_bytes=4 * 211 * 5)
        (logp * torch.randn_like(logp)).sum().backward(retain_graph=True)  # noqa: just exercise
        model.zero_grad()
        w1, w2 = torch.randn(2, 23), torch.randn(2, 23)
        ((logp * w1).sum() + (ent * w2).sum()).backward()
        ours = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        full = torch.log_softmax(model(ids).float() / temperature, -1)
        ref_logp = full.gather(-1, targets[..., None]).squeeze(-1)
        ref_ent = -(full.exp() * full).sum(-1)
        ((ref_logp * w1).sum() + (ref_ent * w2).sum()).backward()
    assert (logp - ref_logp).abs().max() < 1e-5
    assert (ent - ref_ent).abs().max() < 1e-5
    for n, p in model.named_parameters():
        assert torch.allclose(ours[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_activation_checkpointing_same_gradients(tmp_path):
    hf_model("qwen3", False, tmp_path)
    model = Transformer.from_pretrained(str(tmp_path)).train()
    ids = torch.randint(0, 211, (2, 9))
    grads = []
    for ckpt in (False, True):
        model.gradient_checkpointing = ckpt
        model.zero_grad()
        with torch.enable_grad():
            model.token_logprobs(ids, ids.roll(-1, 1)).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_from_pretrained_dtype_and_meta_free(tmp_path):
    hf_model("qwen3", True, tmp_path)
    model = Transformer.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(str(tmp_path))


class CountingHostReads(torch.Tensor):
    """A tensor that counts the reads that copy its values to the host (each a sync on CUDA)."""
    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__):
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_packed_forward_reads_the_boundaries_once(backend, tmp_path, monkeypatch):
    """One host read per packed forward, not one per layer; flash-attn gets the longest length as an int."""
    import model as model_module
    seen = []

    def reference_flash(q, k, v, cu_q, cu_k, max_q, max_k, causal):  # the varlen kernel's contract, in SDPA
        seen.append((type(max_q), max_q))
        bounds = [int(x) for x in torch.Tensor.tolist(cu_q.as_subclass(torch.Tensor))]
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
            enable_gqa=True).transpose(0, 1) for s, e in zip(bounds, bounds[1:])])

    monkeypatch.setattr(model_module, "flash_attn_varlen_func", reference_flash)
    hf_model("qwen3", True, tmp_path, num_hidden_layers=4)
    model = Transformer.from_pretrained(str(tmp_path))
    model.attn_backend = backend
    lengths = [5, 12, 1, 9]
    seqs = [torch.randint(0, 211, (1, n)) for n in lengths]
    cu = cu_seqlens_from_lengths(lengths).as_subclass(CountingHostReads)
    CountingHostReads.reads = 0
    packed = model(torch.cat(seqs, dim=1), cu_seqlens=cu)
    assert CountingHostReads.reads == 1
    assert seen == ([(int, 12)] * 4 if backend == "flash" else [])
    assert (packed - torch.cat([model(s) for s in seqs], dim=1)).abs().max() < 1e-5


def test_the_attention_path_is_said_and_flash_without_flash_attn_is_an_error(monkeypatch):
    """A broken flash-attn import is never silent: attention_path() names the path and the import error;
    --attn_backend=flash without a working flash-attn stops at start-up."""
    import model
    monkeypatch.setattr(model, "flash_attn_varlen_func", None)
    monkeypatch.setattr(model, "FLASH_ERROR", "ImportError: libcudart.so.12: cannot open shared object file")
    line = model.attention_path("auto", "cuda", torch.bfloat16)
    assert line.startswith("attention: torch SDPA") and "libcudart.so.12" in line and "no CUDA graphs" in line
    with pytest.raises(RuntimeError, match="attn_backend='flash' but flash-attn does not import: "
                                           "ImportError: libcudart"):
        model.attention_path("flash", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="auto, sdpa or flash"):
        model.use_flash("triton", "cpu", torch.float32)
    monkeypatch.setattr(model, "flash_attn_varlen_func", lambda *a, **k: None)
    monkeypatch.setattr(model, "FLASH_ERROR", None)
    assert model.attention_path("auto", "cuda", torch.bfloat16).startswith("attention: flash-attn")
    assert "CPU" in model.attention_path("auto", "cpu", torch.float32).upper()
    assert "attn_backend=sdpa" in model.attention_path("sdpa", "cuda", torch.bfloat16)


def test_strict_sdpa_never_gives_a_mask_with_unequal_heads(tiny_ckpt, monkeypatch):
    """On CUDA (strict), a masked SDPA call gets K/V expanded to the query heads: no fused kernel
    takes a mask with GQA, and the math kernel would materialise fp32 [H, q, k] scores. Checked
    on CPU by forcing strict: a cached-prefix prefill through the Engine (its masked call), same
    tokens as the plain path."""
    import functools

    import rollout
    from model import sdpa
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        prefill = attn_mask is not None and q.shape[-2] > 1 and q.shape[-2] < k.shape[-2]
        calls.append((q.shape[-3], k.shape[-3], prefill))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    model = Transformer.from_pretrained(tiny_ckpt)
    prefix = list(range(5, 45))   # two blocks of 16 and more, shared by both prompts
    prompts = [prefix + [50, 51], prefix + [60, 61, 62]]
    run = functools.partial(rollout.generate, model, prompts, 4, max_prefill_tokens=43)
    plain = run()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(rollout, "sdpa", functools.partial(sdpa, strict=True))
    assert run() == plain
    masked = [(hq, hk) for hq, hk, cached_prefix in calls if cached_prefix]
    assert masked and all(hq == hk for hq, hk in masked)
