"""model.py: the Qwen2 / Qwen3 decoder in plain PyTorch, shared by the sampler and both trainers.

RMSNorm, rotary embeddings, grouped-query attention, Qwen3's q/k RMSNorm, Qwen2's q/k/v biases,
SwiGLU, tied or untied embeddings; q/k/v and gate/up each one matmul (fused, as vLLM does); Hugging
Face checkpoints in and out. Packed input: input_ids [1, N] plus cu_seqlens. `kv_cache`: any object
with attend(layer, q, k, v) -> out (rollout.py's paged KV caches).

No departure from the paper's math. Its vLLM sampling and verl training run here on the same
weights with other attention kernels: log-probs agree to rounding (rl.py's sampler_mismatch).
"""

import json
import os
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # optional GPU kernels (rollout.py uses the paged-KV one)
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    FLASH_ERROR = None
except Exception as e:  # ImportError or a broken CUDA build: never silent, attention_path() says it
    flash_attn_varlen_func = flash_attn_with_kvcache = None
    FLASH_ERROR = f"{type(e).__name__}: {e}"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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
    attention_bias: bool = False  # Qwen2 always has q/k/v biases; Qwen3 when this is set
    dtype: str = "bfloat16"       # the dtype the checkpoint is stored in
    extra: dict = field(default_factory=dict)  # every other config.json key, written back on save

    @classmethod
    def from_dict(cls, d, source="config.json"):
        d = dict(d)
        if d.get("model_type") not in ("qwen2", "qwen3"):
            raise ValueError(f"{source}: model_type {d.get('model_type')!r} is not supported "
                             "(expected qwen2 or qwen3)")
        rope = d.pop("rope_parameters", None) or {}       # 5.x
        scaling = d.pop("rope_scaling", None) or {}       # 4.x, with rope_theta at the top
        theta = rope.get("rope_theta", d.pop("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise NotImplementedError(f"{source}: rope type {rope_type!r} is not implemented "
                                      "(only plain rotary)")
        if d.get("use_sliding_window"):
            raise NotImplementedError(f"{source}: sliding-window attention is not implemented")
        torch_dtype = d.pop("torch_dtype", None)
        dtype = d.pop("dtype", None) or torch_dtype or "bfloat16"
        d["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        names = {f.name for f in fields(cls)} - {"extra", "rope_theta", "dtype"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        return cls(**known, rope_theta=float(theta), dtype=str(dtype), extra=d)

    def to_dict(self):
        """config.json as both transformers 4.x and 5.x read it."""
        d = dict(self.extra, **{f.name: getattr(self, f.name) for f in fields(self)
                                if f.name not in ("extra", "dtype")})
        architecture = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        d.update(architectures=[architecture], hidden_act="silu",
                 torch_dtype=self.dtype, dtype=self.dtype, rope_scaling=None,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        d.pop("layer_types", None)  # derived by transformers; stale if the layer count changed
        return d


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        # normalised in fp32, the weight applied in the input dtype, as the reference; fp32: one op
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """positions [B, T] -> cos, sin [B, T, 1, D]; sin carries rotate-half's sign (Attention)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    freqs = positions[..., None].float() * (1.0 / theta ** exponents)  # [B, T, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat([cos, cos], -1).to(dtype)[:, :, None]
    sin = torch.cat([-sin, sin], -1).to(dtype)[:, :, None]
    return cos, sin


def use_flash(backend, device, dtype):
    """Whether attention runs flash-attn: backend "flash" (an error without a working flash-attn),
    "sdpa", or "auto" (flash-attn when it imports, on CUDA, in bf16/fp16)."""
    if backend not in ("auto", "sdpa", "flash"):
        raise ValueError(f"attn_backend must be auto, sdpa or flash, not {backend!r}")
    if backend == "flash" and flash_attn_varlen_func is None:
        raise RuntimeError(f"attn_backend='flash' but flash-attn does not import: {FLASH_ERROR}")
    if backend != "auto":
        return backend == "flash"
    return (flash_attn_varlen_func is not None and torch.device(device).type == "cuda"
            and dtype in (torch.float16, torch.bfloat16))


def attention_path(backend, device, dtype):
    """One line: which attention runs here and why (what the stages print once at start-up)."""
    if use_flash(backend, device, dtype):
        return ("attention: flash-attn (varlen training, paged KV decode in blocks of 256 "
                "with CUDA graphs)")
    if backend != "auto":
        why = f"attn_backend={backend}"
    elif torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        why = f"flash-attn does not import ({FLASH_ERROR})"
    else:
        why = f"flash-attn needs CUDA in bf16/fp16, here {torch.device(device).type} {dtype}"
    return (f"attention: torch SDPA, {why}; rollout KV blocks of 16, no CUDA graphs, "
            "half the KV budget for row buffers")


def sdpa(q, k, v, mask=None, strict=None):
    """SDPA over [B, H, T, D] with GQA, causal unless given a boolean mask (True: attend). strict
    (default: on CUDA) keeps it off the math kernel's fp32 [H, q, k] scores (tens of GB): K/V are
    expanded where no fused kernel takes GQA (a mask, fp32); a long call's fallback is an error."""
    strict = q.is_cuda if strict is None else strict
    groups = q.shape[1] // k.shape[1]
    if strict and groups > 1 and (mask is not None or q.dtype == torch.float32):
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    args = dict(attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[1] != q.shape[1])
    if not (strict and q.is_cuda and q.shape[2] * k.shape[2] >= 1 << 22):
        return F.scaled_dot_product_attention(q, k, v, **args)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        return F.scaled_dot_product_attention(q, k, v, **args)


def attention(q, k, v, packed=None, backend="auto"):
    """Causal attention, q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]. packed: None or
    (cu_seqlens on the device, the same boundaries as a host list, the longest sequence)."""
    B, T = q.shape[:2]
    if use_flash(backend, q.device, q.dtype):
        if packed is None:  # each of the B rows one sequence of length T
            packed = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device), None, T
        cu, _, longest = packed
        out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                     cu, cu, longest, longest, causal=True)
        return out.view(B, T, *out.shape[1:])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                                 # [B, H, T, D]
    bounds = [0, T] if packed is None else packed[1]  # one causal attention per packed sequence
    out = [sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in zip(bounds, bounds[1:])]
    return torch.cat(out, 2).transpose(1, 2)


class Linear(nn.Linear):
    """Multiplies by `weight_t`, a contiguous [in, out] copy of the weight, while one is set (CPU
    decode: fast_sampling.CpuForward): MKL then skips repacking W (8% of the rollout bench)."""
    weight_t = None

    def forward(self, x):
        if self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        flat, wt = x.reshape(-1, x.shape[-1]), self.weight_t
        out = flat @ wt if self.bias is None else torch.addmm(self.bias, flat, wt)
        return out.view(*x.shape[:-1], out.shape[-1])


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        qkv_size = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_size,
                               bias=cfg.model_type == "qwen2" or cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, packed=None, kv_cache=None, backend="auto"):
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = qkv.split([self.n_heads + self.n_kv, self.n_kv], dim=2)
        # q and k heads normalised and rotated together: half the small ops
        if hasattr(self, "q_norm"):
            weight = torch.cat([self.q_norm.weight.expand(self.n_heads, -1),
                                self.k_norm.weight.expand(self.n_kv, -1)])
            qk = weight * F.rms_norm(qk.float(), (self.head_dim,), eps=self.q_norm.eps).to(qk.dtype)
        # rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); roll: (x2, x1), sin: the sign
        qk = qk * cos + qk.roll(self.head_dim // 2, -1) * sin
        q, k = qk.split([self.n_heads, self.n_kv], dim=2)
        out = (attention(q, k, v, packed, backend) if kv_cache is None
               else kv_cache.attend(self.layer_idx, q, k, v))
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, packed=None, kv_cache=None, backend="auto"):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, packed, kv_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(target) and entropy, a chunk of tokens at a time: never a full [N, V] fp32 logits
    tensor. Backward recomputes the logits a vocabulary block at a time: each weight-gradient block
    one matmul (no cross-chunk rounding in bf16), the hidden-state gradient summed in fp32."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, want_entropy, block_bytes):
        N, V = h.shape[0], weight.shape[0]          # h [N, D], weight [V, D], targets [N]
        logp = torch.empty(N, dtype=torch.float32, device=h.device)
        lse, ent = torch.empty_like(logp), torch.zeros_like(logp)
        chunk = max(1, block_bytes // (4 * V))
        for s in range(0, N, chunk):
            z = (h[s:s + chunk] @ weight.t()).float().div_(temperature)   # [c, V]
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            logp[s:s + chunk] = z.gather(1, targets[s:s + chunk, None])[:, 0] - lse[s:s + chunk]
            if want_entropy:                                         # H = lse - sum p z
                ent[s:s + chunk] = lse[s:s + chunk] - (torch.softmax(z, -1) * z).sum(-1)
        ctx.save_for_backward(h, weight, targets, lse, ent)
        ctx.temperature, ctx.block_bytes = temperature, block_bytes
        # an output nobody differentiates gets None in backward, not a tensor of zeros
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, targets, lse, ent = ctx.saved_tensors
        N, V = h.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        g_logp = torch.zeros(N, 1, device=h.device) if g_logp is None else g_logp.float()[:, None]
        g_ent = None if g_ent is None else g_ent.float()[:, None]
        cols = max(1, ctx.block_bytes // (4 * N))
        for c in range(0, V, cols):
            w = weight[c:c + cols]                                        # [Vc, D]
            logp_all = (h @ w.t()).float().div_(ctx.temperature).sub_(lse[:, None])   # [N, Vc]
            p = logp_all.exp()
            # d log p[target] / dz = onehot - p;  dH / dz = -p (log p + H)
            gz = (p.mul_(-g_logp) if g_ent is None
                  else logp_all.add_(ent[:, None]).mul_(-g_ent).sub_(g_logp).mul_(p))
            # + g_logp at each row's target if in this block (a masked scatter: no host sync)
            inside = (targets >= c) & (targets < c + w.shape[0])
            index = (targets - c).clamp(0, w.shape[0] - 1)[:, None]
            gz.scatter_add_(1, index, g_logp * inside[:, None])
            gz = gz.div_(ctx.temperature).to(weight.dtype)
            if need_h:
                grad_h += (gz @ w).float()
            if need_w:
                grad_w[c:c + cols] = gz.t() @ h
        return (grad_h.to(h.dtype) if need_h else None), grad_w, None, None, None, None


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(dict(  # the `model.` prefix of the Hugging Face names
            embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers)),
            norm=RMSNorm(config.hidden_size, config.rms_norm_eps)))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.attn_backend = "auto"           # "auto" | "sdpa" | "flash"
        self.gradient_checkpointing = False  # recompute each block in backward
        self.bare_blocks = False  # call each block's forward itself: no module hooks (FSDP's)

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden(self, input_ids, positions=None, cu_seqlens=None, kv_cache=None):
        """input_ids [B, T] -> final-normed hidden states [B, T, D]."""
        B, T = input_ids.shape
        packed = None
        if cu_seqlens is not None:  # the one host read of a packed forward
            assert B == 1, "packed input (cu_seqlens) needs batch size 1"
            bounds = cu_seqlens.tolist()
            lengths = [e - s for s, e in zip(bounds, bounds[1:])]
            packed = (cu_seqlens.to(input_ids.device, torch.int32), bounds, max(lengths))
            if positions is None:  # restart at 0 at every sequence
                positions = torch.cat([torch.arange(n) for n in lengths]).to(input_ids.device)[None]
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            args = (x, cos, sin, packed, kv_cache, self.attn_backend)
            x = (torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False) if recompute
                 else (layer.forward if self.bare_blocks else layer)(*args))
        return self.model.norm(x)

    def rope(self, positions, dtype):
        """rope_cos_sin(positions): on CPU from a table of the first 2^k positions, not recomputed
        every decode step; on CUDA and when compiled, computed (no host read)."""
        cfg = self.config
        if positions.is_cuda or torch.compiler.is_compiling():
            return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
        n = int(positions.max()) + 1
        table = self.__dict__.get("_rope_table")
        if table is None or table[0].shape[1] < n or table[0].dtype != dtype:
            size = 1 << (n - 1).bit_length()  # the smallest power of two >= n
            table = rope_cos_sin(torch.arange(size)[None], cfg.head_dim, cfg.rope_theta, dtype)
            self.__dict__["_rope_table"] = table  # not a buffer: no state_dict entry, no .to()
        return table[0][0, positions], table[1][0, positions]

    def forward(self, input_ids, positions=None, cu_seqlens=None, kv_cache=None):
        """input_ids [B, T] -> logits [B, T, V] (model dtype)."""
        return self.lm_head(self.hidden(input_ids, positions, cu_seqlens, kv_cache))

    def token_logprobs(self, input_ids, targets, positions=None, cu_seqlens=None,
                       return_entropy=False, temperature=1.0, block_bytes=2**27):
        """log p(targets[:, t] | input_ids[:, :t+1]) as fp32 [B, T] (and each position's entropy);
        extra memory a few fp32 blocks of block_bytes (_ChunkedLogprobs)."""
        h = self.hidden(input_ids, positions, cu_seqlens)
        B, T, D = h.shape
        logp, ent = _ChunkedLogprobs.apply(h.reshape(B * T, D), self.lm_head.weight,
                                           targets.reshape(B * T), float(temperature),
                                           bool(return_entropy), int(block_bytes))
        return (logp.view(B, T), ent.view(B, T)) if return_entropy else logp.view(B, T)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    # -- checkpoints: Hugging Face names on disk, fused projections in memory --

    @classmethod
    def from_config(cls, config, device=None, dtype=torch.float32, seed=0):
        """A fresh model initialised like transformers (normal(0, 0.02), norms 1, biases 0)."""
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
        """An HF checkpoint directory. dtype None: float32 on CPU, elsewhere the checkpoint's."""
        from safetensors import safe_open
        device = torch.device(device or "cpu")
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise FileNotFoundError(f"{path}: no config.json "
                                    "(expected a Hugging Face checkpoint directory)")
        with open(cfg_path) as f:
            config = ModelConfig.from_dict(json.load(f), source=cfg_path)
        stored = DTYPES.get(config.dtype, torch.bfloat16)
        dtype = dtype or (torch.float32 if device.type == "cpu" else stored)
        with torch.device("meta"):
            model = cls(config)
        index, files = os.path.join(path, "model.safetensors.index.json"), ["model.safetensors"]
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif not os.path.exists(os.path.join(path, files[0])):
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        state = {}
        for file in files:
            with safe_open(os.path.join(path, file), framework="pt", device=str(device)) as f:
                state.update({k: f.get_tensor(k).to(dtype=dtype) for k in f.keys()})
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        for key in [k for k in state if ".q_proj." in k or ".gate_proj." in k]:  # HF -> fused
            prefix, name, kind = key.rsplit(".", 2)
            fused = next(f for f, parts in FUSED.items() if parts[0] == name)
            pieces = [state.pop(f"{prefix}.{p}.{kind}") for p in FUSED[fused]]
            state[f"{prefix}.{fused}.{kind}"] = torch.cat(pieces)
        expected = {k for k, _ in model.named_parameters()}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"{path}: checkpoint does not match the config: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        return model.eval()

    def save_pretrained(self, path, max_shard_bytes=5 * 2**30):
        """config.json + HF-named safetensors, sharded (with an index) above max_shard_bytes."""
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        cfg = self.config
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        d = cfg.head_dim
        sizes = {"qkv_proj": [cfg.num_attention_heads * d] + [cfg.num_key_value_heads * d] * 2,
                 "gate_up_proj": [cfg.intermediate_size] * 2}
        for key in [k for k in state if k.rsplit(".", 2)[-2] in FUSED]:  # fused -> HF (views)
            prefix, fused, kind = key.rsplit(".", 2)
            for name, part in zip(FUSED[fused], state.pop(key).split(sizes[fused])):
                state[f"{prefix}.{name}.{kind}"] = part.contiguous()
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        dtype_name = {v: k for k, v in DTYPES.items()}[next(iter(state.values())).dtype]
        shards, size = [{}], 0  # size: bytes in the last shard
        for key, t in state.items():
            if shards[-1] and size + t.nbytes > max_shard_bytes:  # t would take it past the limit
                shards, size = shards + [{}], 0
            shards[-1][key] = t
            size += t.nbytes
        for stale in os.listdir(path):  # a re-save with another shard count must not leave old ones
            if stale.startswith("model") and stale.endswith((".safetensors", ".index.json")):
                os.remove(os.path.join(path, stale))
        n = len(shards)
        names = ([f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] if n > 1
                 else ["model.safetensors"])
        for name, shard in zip(names, shards):
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        if n > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())},
                     "weight_map": {k: name for name, s in zip(names, shards) for k in s}}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(cfg.to_dict(), torch_dtype=dtype_name, dtype=dtype_name), f, indent=2)


def cu_seqlens_from_lengths(lengths, device=None):
    """[len0, len1, ...] -> int32 cumulative boundaries [0, len0, len0 + len1, ...]."""
    counts = torch.tensor([0] + list(lengths), dtype=torch.int32, device=device)
    return counts.cumsum(0, dtype=torch.int32)
