"""model.py: the Qwen2 / Qwen3 decoder in plain PyTorch, shared by the sampler and both trainers.

What it holds
- `ModelConfig`, read from a Hugging Face `config.json` as transformers 4.x writes it
  (`rope_theta`, `rope_scaling`, `torch_dtype`: what the hub checkpoints ship) or as 5.x does
  (`rope_parameters`, `dtype`).
- `Transformer`: RMSNorm, rotary embeddings, grouped-query attention, Qwen3's per-head q/k
  RMSNorm, Qwen2's q/k/v biases, SwiGLU MLP, tied or untied embeddings. Parameter names are the
  Hugging Face ones, so a checkpoint's tensors load by name with no mapping table.
- `Transformer.from_pretrained` / `save_pretrained`: config.json + safetensors (sharded with an
  index file above a size threshold). Loading builds the module on the meta device and reads
  tensor by tensor straight onto the target device and dtype, so a 4B bf16 model never exists as
  an fp32 copy in host memory.
- `token_logprobs`: per-token log-probs (and entropy) computed in chunks of the sequence by a
  custom autograd function that recomputes each chunk's logits in the backward pass. Neither pass
  holds full-vocabulary fp32 logits for the whole sequence.

Forward inputs, besides `input_ids [B, T]`:
- `positions [B, T]`: explicit rotary positions (default 0..T-1, or restarting per sequence for
  packed input).
- `cu_seqlens [n+1]` (int32): packed variable-length input, B must be 1; attention stays within
  each sequence (flash-attn varlen on CUDA, one SDPA call per sequence elsewhere).
- `kv_cache`: any object with `attend(layer_idx, q, k, v) -> out`; q [B, T, Hq, D] and k, v
  [B, T, Hkv, D] arrive after RoPE and q/k-norm. The cache stores k, v and attends over all it
  holds. rollout.py implements the paged cache behind this seam.

Attention backend: flash-attn when it imports and the tensors are on CUDA in fp16/bf16, torch
SDPA otherwise. `model.attn_backend = "sdpa"` (or "flash") overrides the automatic choice.

Departures from the paper's stack: none in the math; the paper trains with verl/FSDP and samples
with vLLM, here one module does both, so sampler and trainer log-probs come from one
implementation.

Usage:
    python model.py DIR                        # load a checkpoint: parameters, load time, peak host memory
    python model.py --bench-memory chunked     # extra memory of token_logprobs, fwd+bwd, T=8192, V=151936
    python model.py --bench-memory full        # the same with full fp32 logits, for comparison
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # optional GPU kernels
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a broken CUDA build
    flash_attn_varlen_func = None

SUPPORTED_TYPES = ("qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -----------------------------------------------------------------------------
# config


@dataclass
class ModelConfig:
    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 always has q/k/v biases; Qwen3 has them when this is set
    dtype: str = "bfloat16"       # the dtype the checkpoint is stored in
    extra: dict = field(default_factory=dict)  # every other config.json key, written back on save

    @property
    def qkv_bias(self):
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def qk_norm(self):
        return self.model_type == "qwen3"

    @classmethod
    def from_dict(cls, d, source="config.json"):
        d = dict(d)
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise ValueError(f"{source}: model_type {model_type!r} is not supported (expected one of {SUPPORTED_TYPES})")
        # rotary: 5.x nests it in rope_parameters, 4.x has rope_theta + rope_scaling
        rope = d.pop("rope_parameters", None) or {}
        scaling = d.pop("rope_scaling", None) or {}
        theta = rope.get("rope_theta", d.pop("rope_theta", 10000.0))
        d.pop("rope_theta", None)
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise NotImplementedError(f"{source}: rope type {rope_type!r} is not implemented (only plain rotary)")
        if d.get("use_sliding_window"):
            raise NotImplementedError(f"{source}: sliding-window attention is not implemented")
        dtype = d.pop("dtype", None) or d.pop("torch_dtype", None) or "bfloat16"
        d.pop("torch_dtype", None)
        if "head_dim" not in d or d["head_dim"] is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        names = {f.name for f in fields(cls)} - {"extra", "rope_theta", "dtype"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        return cls(**known, rope_theta=float(theta), dtype=str(dtype), extra=d)

    def to_dict(self):
        """config.json as both transformers 4.x and 5.x read it."""
        d = dict(self.extra)
        d.update({f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "dtype")})
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        d.update(architectures=[arch], hidden_act="silu", torch_dtype=self.dtype, dtype=self.dtype,
                 rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        d.pop("layer_types", None)  # derived by transformers; stale if the layer count changed
        return d


# -----------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # x * rsqrt(mean(x^2) + eps) in fp32, then the weight in the input dtype (as the reference);
        # F.rms_norm is that formula in one call (identical values on CPU, fewer Python-level ops)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """positions [B, T] -> cos, sin [B, T, 1, head_dim] (fp32 math like the reference), sin with the
    rotate-half sign folded in: negative on the first half."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], -1).to(dtype)[:, :, None], torch.cat([-sin, sin], -1).to(dtype)[:, :, None]


def apply_rope(x, cos, sin):
    """x [B, T, H, D]; rotate-half convention: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    roll gives (x2, x1) and the sign sits in sin: the same values as cat(-x2, x1), one op fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def attention(q, k, v, cu_seqlens=None, backend="auto"):
    """Causal attention. q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]."""
    use_flash = backend == "flash" or (
        backend == "auto" and flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16))
    B, T = q.shape[:2]
    if use_flash:
        if flash_attn_varlen_func is None:
            raise RuntimeError("attn_backend='flash' but flash_attn is not installed")
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, max_len, max_len, causal=True)
        return out.view(B, T, *out.shape[1:])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:  # packed: one causal attention per sequence, never across sequences
        assert B == 1, "packed input (cu_seqlens) needs batch size 1"
        bounds = cu_seqlens.tolist()
        out = torch.cat([
            F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=True)
            for s, e in zip(bounds[:-1], bounds[1:])], dim=2)
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens=None, kv_cache=None, backend="auto"):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q, k, v)
        else:
            out = attention(q, k, v, cu_seqlens, backend)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cu_seqlens=None, kv_cache=None, backend="auto"):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, kv_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The `model.` prefix of the Hugging Face names: embeddings, blocks, final norm."""

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# -----------------------------------------------------------------------------
# chunked log-probs


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(target) and entropy from hidden states without a full [N, V] fp32 logits tensor.

    Forward walks over chunks of tokens and keeps only per-token results (log p, log-sum-exp,
    entropy). Backward recomputes the logits one chunk of the *vocabulary* at a time: for a column
    block Vc it needs only the saved per-token lse and entropy, writes that block of the weight
    gradient exactly (one matmul, no cross-chunk rounding in bf16) and accumulates the hidden-state
    gradient in fp32 ([N, D], small). Peak extra memory: a couple of [chunk, V] or [N, Vc] fp32
    blocks, each sized to `block_bytes`.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, want_entropy, block_bytes):
        # h [N, D], weight [V, D], targets [N] -> logp [N], entropy [N] (fp32)
        N, V = h.shape[0], weight.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=h.device)
        lse, ent = torch.empty_like(logp), torch.zeros_like(logp)
        chunk = max(1, block_bytes // (4 * V))
        for s in range(0, N, chunk):
            z = (h[s:s + chunk] @ weight.t()).float().div_(temperature)   # [c, V]
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            logp[s:s + chunk] = z.gather(1, targets[s:s + chunk, None]).squeeze(1) - lse[s:s + chunk]
            if want_entropy:  # H = lse - sum p z
                ent[s:s + chunk] = lse[s:s + chunk] - (torch.softmax(z, -1) * z).sum(-1)
        ctx.save_for_backward(h, weight, targets, lse, ent)
        ctx.temperature, ctx.want_entropy, ctx.block_bytes = temperature, want_entropy, block_bytes
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, targets, lse, ent = ctx.saved_tensors
        N, V = h.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        g_logp = g_logp.float()[:, None]                                   # [N, 1]
        g_ent = g_ent.float()[:, None] if ctx.want_entropy else None
        cols = max(1, ctx.block_bytes // (4 * N))
        for c in range(0, V, cols):
            w = weight[c:c + cols]                                          # [Vc, D]
            logp_all = (h @ w.t()).float().div_(ctx.temperature).sub_(lse[:, None])  # [N, Vc]
            p = logp_all.exp()
            # d log p[target] / dz = onehot - p ;  dH / dz = -p (log p + H)
            if g_ent is not None:
                gz = logp_all.add_(ent[:, None]).mul_(-g_ent).sub_(g_logp).mul_(p)
            else:
                gz = p.mul_(-g_logp)
            in_block = (targets >= c) & (targets < c + cols)
            rows = in_block.nonzero().squeeze(1)
            gz[rows, targets[rows] - c] += g_logp[rows, 0]
            gz = gz.div_(ctx.temperature).to(weight.dtype)
            if need_h:
                grad_h += (gz @ w).float()
            if need_w:
                grad_w[c:c + cols] = gz.t() @ h
        return (grad_h.to(h.dtype) if need_h else None), grad_w, None, None, None, None


# -----------------------------------------------------------------------------
# the model


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attn_backend = "auto"          # "auto" | "sdpa" | "flash"
        self.gradient_checkpointing = False  # recompute each block in backward

    # -- forward -------------------------------------------------------------

    def hidden(self, input_ids, positions=None, cu_seqlens=None, kv_cache=None):
        """input_ids [B, T] -> final-normed hidden states [B, T, D]."""
        B, T = input_ids.shape
        if positions is None:
            positions = default_positions(B, T, cu_seqlens, input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, cu_seqlens, kv_cache, self.attn_backend,
                                                      use_reentrant=False)
            else:
                x = layer(x, cos, sin, cu_seqlens, kv_cache, self.attn_backend)
        return self.model.norm(x)

    def forward(self, input_ids, positions=None, cu_seqlens=None, kv_cache=None):
        """input_ids [B, T] -> logits [B, T, V] (model dtype)."""
        return self.lm_head(self.hidden(input_ids, positions, cu_seqlens, kv_cache))

    def token_logprobs(self, input_ids, targets, positions=None, cu_seqlens=None, return_entropy=False,
                       temperature=1.0, block_bytes=2**27):
        """log p(targets[:, t] | input_ids[:, :t+1]) as fp32 [B, T]; with return_entropy also the
        entropy of each position's distribution [B, T]. Extra memory: a few fp32 blocks of
        `block_bytes` (128 MB) each, forward and backward, never the full [T, V] logits."""
        h = self.hidden(input_ids, positions, cu_seqlens)
        B, T, D = h.shape
        logp, ent = _ChunkedLogprobs.apply(h.reshape(B * T, D), self.lm_head.weight, targets.reshape(B * T),
                                           float(temperature), bool(return_entropy), int(block_bytes))
        logp = logp.view(B, T)
        return (logp, ent.view(B, T)) if return_entropy else logp

    # -- checkpoints -----------------------------------------------------------

    @classmethod
    def from_config(cls, config, device=None, dtype=torch.float32, seed=0):
        """A freshly initialised model (normal(0, 0.02) like transformers' initializer_range)."""
        torch.manual_seed(seed)
        with torch.device(device or "cpu"):
            model = cls(config)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=0.02)
        return model.to(dtype)

    @classmethod
    def from_pretrained(cls, path, device=None, dtype=None):
        """Load an HF checkpoint dir. dtype None: float32 on CPU, the checkpoint's dtype on CUDA."""
        from safetensors import safe_open
        device = torch.device(device or "cpu")
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
        with open(cfg_path) as f:
            config = ModelConfig.from_dict(json.load(f), source=cfg_path)
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else DTYPES.get(config.dtype, torch.bfloat16)
        with torch.device("meta"):
            model = cls(config)
        state = {}
        for file in checkpoint_files(path):
            with safe_open(file, framework="pt", device=str(device) if device.type != "cpu" else "cpu") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {k for k, _ in model.named_parameters()}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"{path}: checkpoint does not match the config: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        model.load_state_dict(state, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()

    def save_pretrained(self, path, max_shard_bytes=5 * 2**30):
        """config.json + safetensors, sharded with model.safetensors.index.json above max_shard_bytes."""
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        dtype_name = {v: k for k, v in DTYPES.items()}[next(iter(state.values())).dtype]
        config = self.config.to_dict()
        config.update(torch_dtype=dtype_name, dtype=dtype_name)
        shards, current, size = [], {}, 0
        for key, t in state.items():
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[key], size = t, size + nbytes
        shards.append(current)
        for stale in os.listdir(path):  # a re-save with another shard count must not leave old shards
            if stale.startswith("model") and (stale.endswith(".safetensors") or stale.endswith(".index.json")):
                os.remove(os.path.join(path, stale))
        if len(shards) == 1:
            save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def default_positions(B, T, cu_seqlens, device):
    """0..T-1 per row, or restarting at 0 at every packed sequence boundary."""
    if cu_seqlens is None:
        return torch.arange(T, device=device).expand(B, T)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return (torch.arange(T, device=device) - starts)[None]


def checkpoint_files(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def cu_seqlens_from_lengths(lengths, device=None):
    """[len0, len1, ...] -> int32 cumulative boundaries [0, len0, len0+len1, ...]."""
    return torch.tensor([0] + list(lengths), dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def _peak_rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def bench_logprobs_memory(variant, T=8192, V=151936, D=128):
    """Peak extra host memory of one forward+backward of per-token log-probs (Linux, CPU).
    variant "chunked" is token_logprobs' path (log-probs and entropy); "full" materialises [T, V]
    fp32 logits and computes log-probs only."""
    torch.manual_seed(0)
    h = torch.randn(T, D, requires_grad=True)
    w = (torch.randn(V, D) * 0.02).requires_grad_()
    targets = torch.randint(0, V, (T,))
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current RSS
        f.write("5")
    base = _peak_rss_bytes()
    if variant == "chunked":
        logp, ent = _ChunkedLogprobs.apply(h, w, targets, 1.0, True, 2**27)
        (logp.sum() + ent.sum()).backward()
    else:  # log-probs only (with entropy too it needs over 20 GiB)
        full = torch.log_softmax((h @ w.t()).float(), -1)
        full.gather(1, targets[:, None]).sum().backward()
    grads = (h.numel() + w.numel()) * 4  # the gradients themselves, needed by either variant
    return _peak_rss_bytes() - base - grads


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--bench-memory":
        # python model.py --bench-memory chunked|full   (run each in its own process)
        extra = bench_logprobs_memory(sys.argv[2])
        print(f"{sys.argv[2]}: extra peak memory, forward+backward, T=8192 V=151936: {extra / 2**30:.2f} GiB")
        raise SystemExit
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("Usage:")[1])
    t0 = time.time()
    m = Transformer.from_pretrained(sys.argv[1])
    print(f"loaded {m.config.model_type} with {m.num_params() / 1e6:.1f}M parameters in {time.time() - t0:.1f}s, "
          f"peak host memory {_peak_rss_bytes() / 2**30:.2f} GiB")
    ids = torch.randint(0, m.config.vocab_size, (1, 128))
    t0 = time.time()
    with torch.no_grad():
        m(ids)
    print(f"forward of 128 tokens: {time.time() - t0:.3f}s")
