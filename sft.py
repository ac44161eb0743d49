"""sft.py: supervised fine-tuning on multi-turn tool-use trajectories (the paper's first stage).

What it does
- Reads `{"messages": [...], "tools": [...]}` jsonl (the Gen-Verse/Open-AgentRL-SFT-3K layout) and
  renders each record with the tokenizer's own chat template and tools. The loss mask is 1 exactly
  on the tokens the assistant wrote (its text, its <tool_call> blocks, its <|im_end|>) and 0 on
  system, user and tool tokens and on the template's newline after <|im_end|>. The mask comes from
  rendering message prefixes, never from searching the text for role names: assistant message i
  spans from the end of render(messages[:i], add_generation_prompt=True) to the end of
  render(messages[:i+1]). Each of those renders must be a prefix of the whole conversation's render
  (else the record is rejected, naming the message). The pieces between those edges are tokenized
  one by one (as the rollout builds ids: prompt, sampled tokens, forced tool tokens) and checked to
  decode to the template's text; they equal the one-pass tokenization except where a BPE token
  would span an edge (counted and reported as "retokenized").
  A malformed record stops the run with file, line and field.
- Packs trajectories into micro-batches of at most `micro_batch_tokens` tokens (first-fit
  decreasing); attention stays inside each trajectory through `cu_seqlens` (flash-attn varlen on
  GPU, one SDPA call per trajectory on CPU). Trajectories over `max_len` are truncated or dropped
  (`too_long`), counted and reported. Nothing is padded, so "padding waste" is the compute lost
  to lockstep: ranks run their micro-batches in step, so each micro-step costs what its largest
  micro-batch over the ranks costs; waste = 1 - tokens / (sum over micro-steps of that largest
  size x ranks). One process has none. `budget_fill` (tokens / (micro-steps x ranks x budget))
  shows how full the packing is. Both are logged per step and per epoch.
- Trains with FSDP2 (`fully_shard` per decoder block, then the root), fp32 master weights with bf16
  compute and fp32 gradient reduction on GPU (plain fp32 with gloo on CPU), activation
  checkpointing, AdamW, linear warmup then cosine decay, gradient clipping, and gradient
  accumulation to a global batch of `batch_size` trajectories. The loss is the token mean over
  every assistant token of the global batch, so neither the number of ranks nor the number of
  micro-batches changes the update. Log-probs come from `model.token_logprobs` (chunked: never
  full-vocabulary fp32 logits for a long sequence).
- Checkpoints every `save_every` steps and at the end: `out_dir/step_NNNNNN/` is a Hugging Face
  directory (config.json, safetensors, tokenizer files) gathered on rank 0, with `train_state/`
  inside it (sharded model and optimizer via torch.distributed.checkpoint, scheduler, step, data
  order, RNG). Each checkpoint is written to `.tmp_step_NNNNNN` and renamed when complete, so a run
  killed while saving keeps its previous checkpoint. `--resume` continues from the newest one;
  `out_dir/final` links to the last checkpoint.
- Logs to `out_dir/metrics.jsonl` (loss, lr, grad norm, tokens/s, padding waste, held-out loss),
  a tqdm bar on rank 0, and wandb when installed and `--wandb=PROJECT` is given.

Departures from the paper's run (verl fsdp_sft_trainer, repo script): a small held-out split
(`eval_size` records) replaces their validation file, which is the training file itself; the first
warmup step already has a non-zero learning rate (HF/verl's first step has lr 0); no Ulysses
sequence parallelism (their script uses 4), so one rank must hold a whole `max_len` sequence;
packing is ours (verl pads micro-batches of 4 trajectories, or removes padding).

Commands
    python sft.py                                          # toy: tiny model from scratch, ~10 min on 2 CPU cores
    python sft.py --model=PATH --data=data/sft.jsonl --out_dir=runs/sft    # one process
    torchrun --standalone --nproc_per_node 8 sft.py --model=Qwen/Qwen3-4B-Instruct-2507 \\
        --data=data/sft.jsonl --out_dir=runs/sft          # the paper's recipe, one node
    torchrun --standalone --nproc_per_node 8 sft.py ... --resume     # continue a stopped run
Every Config field is a `--name=value` flag. With `--model=tiny` (the default) the fields in TOY
default to the toy values instead of the recipe's.

From Python (rl.py's toy pipeline does this):
    import sft
    path = sft.train(sft.toy_config(out_dir="runs/toy/sft"))   # -> the final HF checkpoint dir
"""

import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist

from model import Transformer, cu_seqlens_from_lengths

# -----------------------------------------------------------------------------
# hyperparameters


@dataclass
class Config:
    # what to train on
    model: str = "tiny"          # HF checkpoint dir or hub snapshot; "tiny": build the toy model (data.tiny)
    data: str = "toy"            # SFT jsonl; "toy": the toy task's (data/toy.py, written to runs/toy/data/)
    out_dir: str = "runs/sft"
    # the recipe: repo SFT script (Open-AgentRL, qwen3-4b-ra-sft) and verl's sft_trainer.yaml defaults
    epochs: int = 5              # repo script: trainer.total_epochs=5
    batch_size: int = 32         # trajectories per optimizer step, all ranks together (data.train_batch_size=32)
    lr: float = 1e-5             # verl sft_trainer.yaml optim.lr
    warmup_ratio: float = 0.1    # verl optim.warmup_steps_ratio
    weight_decay: float = 0.01   # verl optim.weight_decay
    beta1: float = 0.9           # verl optim.betas [0.9, 0.95]
    beta2: float = 0.95
    grad_clip: float = 1.0       # verl optim.clip_grad; 0 disables clipping (the norm is still logged)
    max_len: int = 32768         # repo script: data.max_length=32768
    too_long: str = "truncate"   # "truncate" (keep the first max_len tokens; repo: data.truncation=right) | "drop"
    micro_batch_tokens: int = 32768  # token budget of one packed micro-batch on one rank (>= max_len)
    max_steps: int = 0           # stop after this many optimizer steps (0: all epochs); the schedule follows it
    # held-out loss
    eval_size: int = 16          # records held out from the data for the held-out loss (0: none)
    eval_every: int = 50         # steps between held-out evaluations (also at the start and the end)
    # checkpoints
    save_every: int = 62         # steps between checkpoints (repo: trainer.save_freq=62); 0: only at the end
    keep_train_state: int = 1    # newest checkpoints that keep their resume state (HF weights are always kept)
    save_dtype: str = "auto"     # dtype of the saved HF weights: "auto" (the base checkpoint's) | float32 | bfloat16
    resume: bool = False         # continue from the newest checkpoint in out_dir
    # runtime
    seed: int = 0
    gradient_checkpointing: bool = True
    device: str = "auto"         # "auto" (cuda when available) | "cuda" | "cpu"
    progress: bool = True        # tqdm bar on rank 0 (else one printed line per log_every steps)
    log_every: int = 1
    wandb: str = ""              # wandb project name; empty: off


# The toy pipeline's values (python sft.py, issue 8): a ~1M-parameter model from scratch learns far
# faster than a 4B model is fine-tuned, and toy trajectories are short. 3 epochs of the 6,000 toy
# trajectories (1,122 steps): the copying the task needs appears around step 300; this run made
# the shipped start in data/toy_sft.
TOY = dict(out_dir="runs/toy/sft", epochs=3, batch_size=16, lr=2e-3, max_len=2048, micro_batch_tokens=8192,
           eval_every=20, save_every=0, gradient_checkpointing=False)


def toy_config(**overrides):
    """The toy pipeline's Config; keyword overrides win."""
    return Config(**{**TOY, **overrides})


def parse_args(argv):
    """--name=value flags (a bare --flag sets a bool) -> Config."""
    types = {f.name: f.type for f in fields(Config)}
    given = {}
    if any(a in ("-h", "--help") for a in argv):
        defaults = Config()
        raise SystemExit(__doc__ + "\nflags (default; with --model=tiny: TOY = " + repr(TOY) + "):\n" +
                         "\n".join(f"  --{n}={getattr(defaults, n)!r}" for n in types))
    for arg in argv:
        if not arg.startswith("--"):
            raise SystemExit(f"unexpected argument {arg!r}: flags are --name=value\n{__doc__.split('Commands')[1]}")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in types:
            raise SystemExit(f"unknown flag --{name}; the flags are: {', '.join('--' + n for n in types)}")
        kind = types[name]
        if kind is bool:
            if eq and value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise SystemExit(f"--{name}: expected true or false, got {value!r}")
            given[name] = (not eq) or value.lower() in ("1", "true", "yes")
        elif not eq:
            raise SystemExit(f"--{name} needs a value: --{name}=...")
        else:
            try:
                given[name] = kind(value)
            except ValueError:
                raise SystemExit(f"--{name}: expected {kind.__name__}, got {value!r}")
    return toy_config(**given) if given.get("model", Config.model) == "tiny" else Config(**given)


# -----------------------------------------------------------------------------
# data: records -> token ids and the assistant mask


class DataError(ValueError):
    """A record the trainer cannot use; the message names file, line and field."""


ROLES = ("system", "user", "assistant", "tool")


def read_records(path):
    """Yield (where, messages, tools) for each line of an SFT jsonl file, validated."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e})") from None
            yield (where, *check_record(record, where))


def check_record(record, where):
    """-> (messages, tools) or DataError naming the field that is wrong."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with 'messages', got {type(record).__name__}")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages: expected a non-empty list, got {messages!r:.80}")
    tools = record.get("tools")
    if isinstance(tools, str):  # parquet exports often keep the tool list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: tools: a string that is not valid JSON ({e})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: tools: expected a list of tool schemas (objects), got {tools!r:.80}")
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: {field}: expected an object, got {m!r:.80}")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: {field}.role: expected one of {ROLES}, got {m.get('role')!r}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m["role"] == "assistant")):
            raise DataError(f"{where}: {field}.content: expected a string, got {content!r:.80}")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise DataError(f"{where}: {field}.tool_calls: expected a list on an assistant message")
        for j, call in enumerate(calls):
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise DataError(f"{where}: {field}.tool_calls[{j}].function.name: expected a string")
            if not isinstance(fn.get("arguments"), (str, dict)):
                raise DataError(f"{where}: {field}.tool_calls[{j}].function.arguments: expected an object or a JSON string")
    if messages[0]["role"] == "assistant":
        raise DataError(f"{where}: messages[0]: the conversation starts with an assistant message (no prompt)")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: messages: no assistant message, so nothing to learn")
    return messages, tools


def render(tokenizer, messages, tools=None, where="record"):
    """-> (ids, mask, same_as_one_pass): the chat template's rendering as token ids, mask 1 on the
    assistant's own tokens. same_as_one_pass says whether tokenizing the whole render at once gives
    the same ids (it differs only when a BPE token would span a message boundary)."""
    def text(k, generation_prompt=False):
        return tokenizer.apply_chat_template(messages[:k], tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    full = text(len(messages))

    def offset(prefix, i):  # where `prefix` ends inside the full render, checking it is a prefix
        if not full.startswith(prefix):
            j = next((j for j, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            raise DataError(f"{where}: messages[{i}]: the chat template renders the first messages differently "
                            f"from the whole conversation (first difference at character {j}: {prefix[j:j + 40]!r} "
                            f"vs {full[j:j + 40]!r}); prefix masking needs a template whose renders extend each other")
        return len(prefix)

    # Only an assistant message's edges are cut: it starts after the generation prompt and ends where
    # the render of the messages up to it ends. (Other prefixes need not extend: Qwen's template
    # closes a run of tool messages only after the last one.)
    cuts, spans = {0, len(full)}, set()
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = offset(text(i, generation_prompt=True), i)
            end = offset(text(i + 1), i)
            cuts.update((start, end))
            spans.add((start, end))
    cuts = sorted(cuts)
    eos = tokenizer.eos_token_id
    ids, mask = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        piece = tokenizer.encode(full[a:b], add_special_tokens=False)
        ids += piece
        if (a, b) in spans:
            # The assistant wrote everything up to its last <|im_end|>; what follows (the newline)
            # is the template's, and the rollout forces it too.
            last = max((k for k, t in enumerate(piece) if t == eos), default=len(piece) - 1)
            mask += [1] * (last + 1) + [0] * (len(piece) - last - 1)
        else:
            mask += [0] * len(piece)
    same = ids == tokenizer.encode(full, add_special_tokens=False)
    if not same and tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) != full:
        raise DataError(f"{where}: the ids tokenized message by message do not decode to the chat template's text")
    return ids, mask, same


def load_data(path, tokenizer, cfg):
    """Render every record; truncate or drop the too long ones. -> (list of (ids, mask) tensors, stats)."""
    seqs, stats = [], dict(records=0, truncated=0, dropped_too_long=0, dropped_no_loss=0, retokenized=0)
    for where, messages, tools in read_records(path):
        stats["records"] += 1
        ids, mask, same = render(tokenizer, messages, tools, where)
        stats["retokenized"] += not same
        if len(ids) > cfg.max_len:
            if cfg.too_long == "drop":
                stats["dropped_too_long"] += 1
                continue
            ids, mask = ids[:cfg.max_len], mask[:cfg.max_len]
            stats["truncated"] += 1
        if sum(mask[1:]) == 0:  # the first token is never predicted
            stats["dropped_no_loss"] += 1
            continue
        seqs.append((torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool)))
    if not seqs:
        raise DataError(f"{path}: no usable trajectories ({stats})")
    stats["tokens"] = sum(len(s[0]) for s in seqs)
    stats["loss_tokens"] = sum(int(s[1][1:].sum()) for s in seqs)
    stats["max_len"] = max(len(s[0]) for s in seqs)
    return seqs, stats


# -----------------------------------------------------------------------------
# packing


def pack(lengths, budget):
    """First-fit decreasing: indices into lengths -> bins whose lengths sum to <= budget."""
    bins = []  # [room left, [indices]]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b in bins:
            if b[0] >= lengths[i]:
                b[0] -= lengths[i]
                b[1].append(i)
                break
        else:
            bins.append([budget - lengths[i], [i]])
    return [b[1] for b in bins]


def plan(batch, lengths, world, budget):
    """Split a global batch (indices) over ranks, balancing tokens, and pack each rank's share.
    Every rank computes the same plan from the same lengths, so no communication is needed. Ranks
    with fewer micro-batches get empty ones: FSDP needs every rank in every forward/backward."""
    shares, load = [[] for _ in range(world)], [0] * world
    for i in sorted(batch, key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    micro = [[[share[j] for j in b] for b in pack([lengths[i] for i in share], budget)] for share in shares]
    n = max(len(m) for m in micro)
    return [m + [[]] * (n - len(m)) for m in micro]


def micro_batch(seqs, device, pad_id=0):
    """Pack (ids, mask) pairs into one row: input ids, next-token targets and their loss mask
    [1, total], and cu_seqlens. An empty list gives one pad token with nothing to learn."""
    if not seqs:
        seqs = [(torch.tensor([pad_id], dtype=torch.int32), torch.tensor([False]))]
    ids = torch.cat([s[0] for s in seqs]).long()
    # each sequence's last token predicts nothing: its target is a pad with mask 0
    targets = torch.cat([torch.cat([s[0][1:].long(), torch.tensor([pad_id])]) for s in seqs])
    mask = torch.cat([torch.cat([s[1][1:], torch.tensor([False])]) for s in seqs])
    cu = cu_seqlens_from_lengths([len(s[0]) for s in seqs])
    return ids[None].to(device), targets[None].to(device), mask[None].float().to(device), cu.to(device)


def packed_nll(model, mb):
    """Summed negative log-likelihood of the masked targets of one packed micro-batch."""
    ids, targets, mask, cu = mb
    logp = model.token_logprobs(ids, targets, cu_seqlens=cu)
    return -(logp * mask).sum()


# -----------------------------------------------------------------------------
# distributed setup and FSDP2


def setup_distributed(cfg):
    """-> (rank, world, device, created). One process without torchrun gets a world of one (an
    in-memory store, no ports), so one code path serves both."""
    created = not dist.is_initialized()
    if created:
        cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device, created


def shard(model, device, world):
    """FSDP2: each decoder block is one unit, the root (embeddings, final norm, lm_head) another.
    On GPU: fp32 master weights, bf16 compute, fp32 gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # token_logprobs is not forward(): register it so the root's parameters are gathered around it
    register_fsdp_forward_method(model, "token_logprobs")
    # its [B, T] result is a view; FSDP warns about in-place ops on it, and we only use it out of place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def lr_lambda(cfg, total_steps):
    """Linear warmup over warmup_ratio of the steps, then cosine to zero (verl's cosine schedule)."""
    warmup = int(cfg.warmup_ratio * total_steps)

    def f(step):  # step: optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def clip_grads(model, max_norm):
    """Clip the global gradient norm; -> the norm before clipping (a float)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


# -----------------------------------------------------------------------------
# checkpoints


def checkpoint_dirs(out_dir):
    """Complete checkpoints (resumable or not), oldest first: [(step, path)]."""
    if not os.path.isdir(out_dir):
        return []
    found = []
    for name in os.listdir(out_dir):
        if name.startswith("step_") and name[5:].isdigit():
            found.append((int(name[5:]), os.path.join(out_dir, name)))
    return sorted(found)


def resumable(out_dir):
    return [(s, p) for s, p in checkpoint_dirs(out_dir) if os.path.exists(os.path.join(p, "train_state", "trainer.pt"))]


def save_hf(full_state, model_config, tokenizer, base_path, path, dtype):
    """Write the gathered full state dict as a Hugging Face checkpoint (rank 0 only)."""
    with torch.device("meta"):
        m = Transformer(model_config)
    m.load_state_dict(full_state, strict=False, assign=True)
    if model_config.tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
    m.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if os.path.exists(os.path.join(base_path, "generation_config.json")):
        shutil.copy(os.path.join(base_path, "generation_config.json"), path)


def save_checkpoint(model, optimizer, scheduler, cfg, step, state, tokenizer, base_path, rank, save_dtype):
    """Write out_dir/step_N atomically: everything goes to .tmp_step_N, renamed once complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    name = f"step_{step:06d}"
    final, tmp = os.path.join(cfg.out_dir, name), os.path.join(cfg.out_dir, ".tmp_" + name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "train_state"))
    dist.barrier()
    # HF weights: the full state dict, gathered to rank 0's CPU (a collective: every rank calls it)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_hf(full, model.config, tokenizer, base_path, tmp, save_dtype)
    del full
    # resume state: sharded, so every rank writes its own part; fp32 master weights, not the HF copy
    sharded = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(sharded, checkpoint_id=os.path.join(tmp, "train_state", "dcp"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, os.path.join(tmp, "train_state", f"rng_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        trainer = dict(state, step=step, scheduler=scheduler.state_dict(), config=asdict(cfg))
        torch.save(trainer, os.path.join(tmp, "train_state", "trainer.pt"))  # written last: marks it complete
        with open(os.path.join(tmp, "train_state", "trainer.json"), "w") as f:
            json.dump({k: v for k, v in trainer.items() if k not in ("scheduler", "order")}, f, indent=2)
        if os.path.exists(final):  # re-saving a step: move the old one aside first (rename is atomic)
            os.rename(final, final + ".old")
        os.rename(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        for _, old in resumable(cfg.out_dir)[:-max(1, cfg.keep_train_state)]:
            shutil.rmtree(os.path.join(old, "train_state"), ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(model, optimizer, scheduler, path, rank):
    """Restore what save_checkpoint wrote into the live (sharded) model and optimizer; -> trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    sharded = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(sharded, checkpoint_id=os.path.join(path, "train_state", "dcp"))
    set_model_state_dict(model, sharded["model"])
    set_optimizer_state_dict(model, optimizer, sharded["optim"])
    trainer = torch.load(os.path.join(path, "train_state", "trainer.pt"), weights_only=False)
    scheduler.load_state_dict(trainer["scheduler"])
    rng_file = os.path.join(path, "train_state", f"rng_rank{rank}.pt")
    if os.path.exists(rng_file):  # absent when resuming on more ranks than were saved
        rng = torch.load(rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return trainer


def link_final(out_dir, path):
    """out_dir/final -> the last checkpoint (a symlink swapped in atomically)."""
    tmp = os.path.join(out_dir, ".final.tmp")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.basename(path), tmp)
    os.replace(tmp, os.path.join(out_dir, "final"))


# -----------------------------------------------------------------------------
# inputs of the toy pipeline


def prepare_model(cfg, rank):
    """A local HF dir as is; a hub id downloaded into the HF cache (rank 0 first, the others then
    read the cache); "tiny": the toy model built from scratch into out_dir/base (rank 0 builds)."""
    if os.path.isdir(cfg.model):
        return cfg.model
    if cfg.model != "tiny":
        from huggingface_hub import snapshot_download
        path = snapshot_download(cfg.model) if rank == 0 else None
        dist.barrier()
        return path or snapshot_download(cfg.model, local_files_only=True)
    path = os.path.join(cfg.out_dir, "base")
    if rank == 0 and not os.path.exists(os.path.join(path, "model.safetensors")):
        from data.tiny import build_tiny_checkpoint
        build_tiny_checkpoint(path, seed=cfg.seed)
    dist.barrier()
    return path


TOY_DATA = "runs/toy/data"  # data.toy.build writes sft.jsonl, train.jsonl, heldout.jsonl here (rl.py reads the last two)


def prepare_data(cfg, rank):
    """cfg.data, or for "toy" the toy task's SFT trajectories (rank 0 writes them if missing)."""
    if cfg.data != "toy":
        return cfg.data
    path = os.path.join(TOY_DATA, "sft.jsonl")
    if rank == 0 and not os.path.exists(path):
        from data import toy
        toy.build(TOY_DATA, seed=cfg.seed)
    dist.barrier()
    return path


# -----------------------------------------------------------------------------
# training


def evaluate_loss(model, seqs, rank, world, budget, device, pad_id):
    """Token-mean loss over held-out trajectories (all ranks share the work); None without any."""
    if not seqs:
        return None
    lengths = [len(s[0]) for s in seqs]
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for group in plan(range(len(seqs)), lengths, world, budget)[rank]:
            mb = micro_batch([seqs[i] for i in group], device, pad_id)
            totals[0] += packed_nll(model, mb).double()
            totals[1] += mb[2].sum().double()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def data_order(n, seed, epoch):
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def train(cfg):
    """Run SFT as configured; returns the final Hugging Face checkpoint directory. Works in one
    process, under torchrun, or inside a process that already set up torch.distributed."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if cfg.too_long not in ("truncate", "drop"):
        raise ValueError(f"too_long must be 'truncate' or 'drop', got {cfg.too_long!r}")
    if cfg.micro_batch_tokens < cfg.max_len:
        raise ValueError(f"micro_batch_tokens ({cfg.micro_batch_tokens}) must be >= max_len ({cfg.max_len})")
    rank, world, device, created = setup_distributed(cfg)
    try:
        return _train(cfg, rank, world, device, tqdm, AutoTokenizer)
    finally:
        if created:
            dist.destroy_process_group()


def _train(cfg, rank, world, device, tqdm, AutoTokenizer):
    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        for name in os.listdir(cfg.out_dir):  # leftovers of a run killed while saving
            if name.startswith(".tmp_step_"):
                shutil.rmtree(os.path.join(cfg.out_dir, name), ignore_errors=True)
    existing = checkpoint_dirs(cfg.out_dir)
    if existing and not cfg.resume:
        raise SystemExit(f"{cfg.out_dir} already holds checkpoints ({os.path.basename(existing[-1][1])}); "
                         f"pass --resume to continue that run, or choose another --out_dir")
    base_path = prepare_model(cfg, rank)
    data_path = prepare_data(cfg, rank)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # data: render everything, then hold out a small split (chosen by seed, not by file order)
    t0 = time.time()
    seqs, stats = load_data(data_path, tokenizer, cfg)
    split = data_order(len(seqs), cfg.seed, -1)
    n_eval = min(cfg.eval_size, len(seqs) // 2)
    eval_seqs = [seqs[i] for i in split[:n_eval]]
    train_seqs = [seqs[i] for i in sorted(split[n_eval:])]
    lengths = [len(s[0]) for s in train_seqs]
    steps_per_epoch = math.ceil(len(train_seqs) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    fingerprint = [len(train_seqs), sum(lengths), stats["loss_tokens"]]
    log(f"data {data_path}: {stats['records']} records -> {len(train_seqs)} train + {n_eval} held out, "
        f"{stats['tokens']} tokens ({stats['loss_tokens']} assistant), longest {stats['max_len']}; "
        f"too long: {stats['truncated']} truncated, {stats['dropped_too_long']} dropped; "
        f"{stats['dropped_no_loss']} without assistant tokens dropped; {stats['retokenized']} tokenized "
        f"differently in one pass ({time.time() - t0:.1f}s)")

    # model, FSDP2, optimizer, schedule
    model = Transformer.from_pretrained(base_path, device=device, dtype=torch.float32)  # fp32 master weights
    model_config = model.config
    save_dtype = {"auto": model_config.dtype}.get(cfg.save_dtype, cfg.save_dtype)
    save_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[save_dtype]
    model.gradient_checkpointing = cfg.gradient_checkpointing
    model.train()
    n_params = model.num_params()
    model = shard(model, device, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    log(f"model {base_path}: {n_params / 1e6:.1f}M parameters, {world} rank(s) on {device.type}, "
        f"{total_steps} steps of {cfg.batch_size} trajectories ({steps_per_epoch} per epoch)")

    step = 0
    if cfg.resume and resumable(cfg.out_dir):
        path = resumable(cfg.out_dir)[-1][1]
        trainer = load_checkpoint(model, optimizer, scheduler, path, rank)
        if trainer["fingerprint"] != fingerprint:
            raise SystemExit(f"{path}: the training data differs from the checkpoint's "
                             f"({trainer['fingerprint']} vs {fingerprint} trajectories/tokens/assistant tokens)")
        step = trainer["step"]
        log(f"resumed from {path} at step {step}")
    elif cfg.resume:
        log(f"--resume: no resumable checkpoint in {cfg.out_dir}, starting fresh")

    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    metrics = open(metrics_path, "a" if step else "w") if rank == 0 else None
    run = None
    if cfg.wandb and rank == 0:
        try:
            import wandb
            run = wandb.init(project=cfg.wandb, config=asdict(cfg), resume="allow")
        except ImportError:
            log("--wandb given but wandb is not installed; logging to metrics.jsonl only")

    def record(entry):
        if rank == 0:
            metrics.write(json.dumps(entry) + "\n")
            metrics.flush()
            if run is not None:
                run.log({k: v for k, v in entry.items() if isinstance(v, (int, float))}, step=entry.get("step"))

    record(dict(event="start", step=step, config=asdict(cfg), data=stats, world_size=world,
                train_records=len(train_seqs), eval_records=n_eval, total_steps=total_steps))

    def held_out(step):
        loss = evaluate_loss(model, eval_seqs, rank, world, cfg.micro_batch_tokens, device, pad_id)
        if loss is not None:
            record(dict(event="eval", step=step, eval_loss=loss))
        return loss

    if step == 0:
        held_out(0)
    bar = tqdm(total=total_steps, initial=step, disable=not (rank == 0 and cfg.progress), desc="sft")
    epoch_tokens = epoch_slots = epoch_budget = 0
    last_saved, path = None, None
    run_tokens, run_time = 0, 0.0
    while step < total_steps:
        t_step = time.time()
        epoch, index = divmod(step, steps_per_epoch)
        order = data_order(len(train_seqs), cfg.seed, epoch)
        batch = order[index * cfg.batch_size:(index + 1) * cfg.batch_size]
        micro = plan(batch, lengths, world, cfg.micro_batch_tokens)
        # the loss is normalised by the whole global batch's assistant-token count
        loss_tokens = sum(int(train_seqs[i][1][1:].sum()) for i in batch)
        tokens = sum(lengths[i] for i in batch)
        nll_sum = torch.zeros((), dtype=torch.float64, device=device)
        for group in micro[rank]:
            mb = micro_batch([train_seqs[i] for i in group], device, pad_id)
            nll = packed_nll(model, mb)
            # FSDP averages gradients over ranks; scaling by world makes the result a sum over ranks
            (nll * (world / loss_tokens)).backward()
            nll_sum += nll.detach().double()
        grad_norm = clip_grads(model, cfg.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(nll_sum)
        step += 1
        seconds = time.time() - t_step
        run_tokens, run_time = run_tokens + tokens, run_time + seconds
        slots = world * sum(max(sum(lengths[i] for i in micro[r][k]) for r in range(world))
                            for k in range(len(micro[0])))
        budget = len(micro[0]) * world * cfg.micro_batch_tokens
        epoch_tokens, epoch_slots, epoch_budget = epoch_tokens + tokens, epoch_slots + slots, epoch_budget + budget
        entry = dict(event="train", step=step, epoch=epoch, loss=float(nll_sum) / loss_tokens, lr=lr,
                     grad_norm=grad_norm, tokens=tokens, loss_tokens=loss_tokens, micro_batches=len(micro[0]),
                     padding_waste=1 - tokens / slots, budget_fill=tokens / budget, tokens_per_s=tokens / seconds,
                     seconds=seconds)
        record(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{entry['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{entry['tokens_per_s']:.0f}")
        if not cfg.progress and step % cfg.log_every == 0:
            log(f"step {step}/{total_steps} loss {entry['loss']:.4f} lr {lr:.2e} grad norm {grad_norm:.3f} "
                f"{entry['tokens_per_s']:.0f} tok/s, waste {entry['padding_waste']:.1%}, fill {entry['budget_fill']:.1%}")
        if step % steps_per_epoch == 0 or step == total_steps:
            record(dict(event="epoch", step=step, epoch=epoch, padding_waste=1 - epoch_tokens / epoch_slots,
                        budget_fill=epoch_tokens / epoch_budget))
            log(f"epoch {epoch}: padding waste {1 - epoch_tokens / epoch_slots:.1%}, "
                f"budget fill {epoch_tokens / epoch_budget:.1%}")
            epoch_tokens = epoch_slots = epoch_budget = 0
        if cfg.eval_every and step % cfg.eval_every == 0 and step != total_steps:
            held_out(step)
        if (cfg.save_every and step % cfg.save_every == 0) or step == total_steps:
            state = dict(epoch=epoch, order=order, fingerprint=fingerprint)
            path = save_checkpoint(model, optimizer, scheduler, cfg, step, state, tokenizer, base_path, rank,
                                   save_dtype)
            last_saved = step
    bar.close()
    eval_loss = held_out(step) if last_saved is not None else None
    if path is None:  # resumed a finished run: nothing to train
        path = checkpoint_dirs(cfg.out_dir)[-1][1]
    if rank == 0:
        link_final(cfg.out_dir, path)
    summary = dict(event="end", step=step, checkpoint=path, eval_loss=eval_loss,
                   tokens_per_s=run_tokens / run_time if run_time else None)
    record(summary)
    if rank == 0:
        metrics.close()
        if run is not None:
            run.finish()
    if run_time:
        log(f"done: {step} steps, {summary['tokens_per_s']:.0f} tokens/s, held-out loss "
            f"{eval_loss if eval_loss is None else round(eval_loss, 4)}, checkpoint {path}")
    dist.barrier()
    return path


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        train(cfg)
    except DataError as e:
        raise SystemExit(f"bad SFT data: {e}")


if __name__ == "__main__":
    main()
