"""sft.py: supervised fine-tuning on multi-turn tool-use trajectories, the paper's first stage.

Reads {"messages", "tools"} jsonl (the Open-AgentRL-SFT-3K layout), renders each record with the
tokenizer's own chat template and puts the loss on exactly the tokens the assistant wrote: an
assistant message spans from the end of render(messages[:i], add_generation_prompt=True), which
must be a prefix of the whole render, to its end-of-turn token. Trajectories packed into
micro-batches (attention stays inside each: cu_seqlens); AdamW, warmup then cosine, clipping,
FSDP2 under torchrun (bf16 compute, fp32 master weights and reduction on GPU), a token-mean loss
over the global batch's assistant tokens, checkpoints that resume exactly, out_dir/metrics.jsonl.

    python sft.py                        # the toy preset: a tiny model from scratch
    python sft.py --model DIR --data data/sft.jsonl --out_dir runs/sft
    torchrun --standalone --nproc_per_node 8 sft.py --model Qwen/Qwen3-4B-Instruct-2507 \\
        --data data/sft.jsonl
    python sft.py --preset toy --help    # every flag, with the toy preset's values as defaults

The same command again continues from the newest checkpoint of out_dir (--resume=false: start
over, the old run moved aside).

Departures from the paper's run (verl fsdp_sft_trainer): a held-out split of eval_size records
replaces their validation file (the training file itself); the first warmup step already has a
non-zero learning rate; no Ulysses sequence parallelism, so one rank holds a whole max_len
sequence; trajectories are packed (verl pads micro-batches or removes padding). As verl, the
short last batch of an epoch is dropped.
"""

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

from data import toy
from machinery import flags
from machinery.checkpoints import (check_resume, checkpoints, claim, latest_resumable,
                                   load_checkpoint, save_checkpoint)
from machinery.distributed import (all_reduce, allocator_defaults, barrier, build_model,
                                   check_shared, clip_grads, compute_dtype, distributed, print0,
                                   resolve_model)
from machinery.exits import exit_worker, quiet_interrupt, resume_line
from machinery.flags import DataError, check_data, parse_config, records
from machinery.run_log import Metrics
from model import DTYPES, attention_path, cu_seqlens_from_lengths


@dataclass
class Config:  # defaults: the repo's SFT script (qwen3-4b-ra-sft), verl's sft_trainer.yaml
    model: str = "Qwen/Qwen3-4B-Instruct-2507"   # HF dir or hub id; "toy": a tiny model
    data: str = "data/sft.jsonl"                 # "toy": the toy task's trajectories
    out_dir: str = "runs/sft"
    epochs: int = 5                # trainer.total_epochs
    batch_size: int = 32           # trajectories per optimizer step, all ranks together
    lr: float = 1e-5
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0         # 0: no clipping (the norm is still logged)
    max_len: int = 32768           # data.max_length
    too_long: str = "truncate"     # keep the first max_len tokens (data.truncation=right) | "drop"
    micro_batch_tokens: int = 32768  # packed tokens per micro-batch on one rank (>= max_len)
    max_steps: int = 0             # stop after this many steps (0: all epochs); sets the schedule
    eval_size: int = 16            # records held out for the held-out loss (0: none)
    eval_every: int = 50           # steps between held-out losses (also at the start and the end)
    save_every: int = 62           # trainer.save_freq; 0: only at the end
    keep_train_state: int = 1      # newest checkpoints that keep their resume state
    save_dtype: str = "auto"       # saved HF weights: auto (the base's) | float32 | bfloat16
    resume: bool = True            # continue from out_dir's newest checkpoint if there is one
    resume_override: bool = False  # resume even if the order / schedule fields changed
    seed: int = 0
    gradient_checkpointing: bool = True
    attn_backend: str = "auto"     # auto (flash-attn if it imports, CUDA) | sdpa | flash
    device: str = "auto"           # auto | cuda | cpu
    progress: bool = True          # tqdm bar on rank 0 (else a line every log_every steps)
    log_every: int = 1
    wandb_project: str = ""        # log to Weights & Biases under this project ("": off)
    wandb_run: str = ""            # the wandb run's name ("": wandb's own)
    dist_timeout: float = 30.0     # minutes a rank waits in a collective (a stuck node)


# The toy pipeline (python sft.py): a 0.9M-parameter model from scratch learns in minutes what a
# 4B model is fine-tuned on; 3 epochs of the 6,000 toy trajectories made data/toy_sft.
TOY = dict(model="toy", data="toy", out_dir="runs/toy/sft", epochs=3, batch_size=16, lr=2e-3,
           max_len=2048, micro_batch_tokens=8192, eval_every=20, save_every=100,
           gradient_checkpointing=False)
RESUME_FIELDS = ("data", "epochs", "batch_size", "max_steps", "lr", "warmup_ratio", "max_len",
                 "too_long", "eval_size", "seed")


def parse_args(argv):
    return parse_config(Config, argv, __doc__, presets={"toy": TOY})


def check(cfg):  # every flag before anything is loaded or written: one line on a bad value
    flags.ranges(cfg, {
        ">= 0": "seed weight_decay grad_clip max_steps eval_size eval_every save_every",
        ">= 1": "epochs batch_size keep_train_state log_every",
        ">= 2": "max_len", "> 0": "lr dist_timeout", "[0, 1)": "warmup_ratio beta1 beta2"})
    flags.choices(cfg, too_long=("truncate", "drop"), attn_backend=("auto", "sdpa", "flash"),
                   save_dtype=("auto", *DTYPES), device=("auto", "cuda", "cpu"))
    flags.rule(cfg.device != "cuda" or torch.cuda.is_available(), "device", cfg.device,
                "no CUDA device here; allowed: auto | cpu")
    flags.rule(cfg.micro_batch_tokens >= cfg.max_len, "micro_batch_tokens",
                cfg.micro_batch_tokens, "allowed: at least --max_len")
    flags.output_dir(cfg, "out_dir")
    flags.model_dir(cfg)
    flags.input_file(cfg, "data", skip=("toy",), hint=" (data/prepare.py sft; or --preset toy)")


def mark_content(chat, messages, tools, where):
    """The messages with every added-token string in their text marked as text (ChatFormat.mark),
    as the rollout treats tool output; except a token the template itself reads (Qwen3's hybrid
    template splits reasoning at </think>), whose marking alone changes what it renders."""
    marked = chat.mark_messages(messages)
    if marked == messages:  # no added-token string in any text: the common case
        return marked
    real = chat.render(messages, tools=tools)
    text = json.dumps(messages, ensure_ascii=False)
    if any(ord(c) in chat._unmark for c in text):
        raise DataError(f"{where}: the text holds a character of U+F0000.., which marks "
                        f"added-token strings here")

    def rendered(marked):
        return chat.unmark(chat.render(marked, tools=tools))

    present = {t for t in chat.marks if t in text}
    # marking t alone changes the rendering: the template reads t
    read = {t for t in present if rendered(chat.mark_messages(messages, present - {t})) != real}
    marked = chat.mark_messages(messages, keep=read)
    if rendered(marked) != real:
        raise DataError(f"{where}: the chat template renders the messages differently once the "
                        f"added-token strings in their text ({sorted(present - read)}) are marked "
                        f"as plain text")
    return marked


def render(chat, messages, tools=None, where="record"):
    """-> (ids, mask, same_as_one_pass): the chat template's rendering as token ids, mask 1 on the
    assistant's own tokens (text, tool calls, any think block the template writes into its turn,
    its end-of-turn token). chat: a rollout.ChatFormat, so message text is never an added token (a
    literal <|im_end|> in a tool's output stays text), and the pieces between the cuts are
    tokenized one by one, as the rollout builds ids; same_as_one_pass: one pass gives the same."""
    marked = mark_content(chat, messages, tools, where)

    def text(k, generation_prompt=False):
        return chat.render(marked[:k], generation_prompt, tools)

    full, eot = text(len(messages)), chat.end_of_turn_text
    spans = set()
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = text(i, generation_prompt=True)
        if not full.startswith(prefix):
            differ = (j for j, (a, b) in enumerate(zip(prefix, full)) if a != b)
            j = next(differ, min(len(prefix), len(full)))
            raise DataError(f"{where}: messages[{i}]: the chat template renders the first messages "
                            f"differently from the whole conversation (at character {j}: "
                            f"{prefix[j:j + 40]!r} vs {full[j:j + 40]!r}); the assistant mask "
                            f"needs a template whose earlier turns render the same in every prefix "
                            f"(a template that drops earlier turns' reasoning needs each turn's "
                            f"reasoning removed from the data, or a template without that rule)")
        end = full.find(eot, len(prefix))
        if end < 0:
            raise DataError(f"{where}: messages[{i}]: the assistant turn is not closed by {eot!r}")
        spans.add((len(prefix), end + len(eot)))
    ids, mask = [], []
    cuts = sorted({0, len(full)}.union(*spans))
    for a, b in zip(cuts[:-1], cuts[1:]):
        piece = chat.encode(full[a:b])
        ids += piece
        mask += [int((a, b) in spans)] * len(piece)
    real, tokenizer = chat.unmark(full), chat.tokenizer
    if tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) != real:
        raise DataError(f"{where}: the ids tokenized piece by piece do not decode to the chat "
                        f"template's text")
    return ids, mask, ids == tokenizer.encode(real, add_special_tokens=False)


def load_data(path, tokenizer, cfg):
    """Render every record; truncate or drop the too long ones -> ([(ids, mask) tensors], stats)."""
    from rollout import ChatFormat
    chat = ChatFormat(tokenizer)
    seqs = []
    stats = dict(records=0, truncated=0, dropped_too_long=0, dropped_no_loss=0, retokenized=0)
    for messages, tools, where in records(path):
        ids, mask, same = render(chat, messages, tools, where)
        stats["records"] += 1
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
    stats.update(tokens=sum(len(s[0]) for s in seqs),
                 loss_tokens=sum(int(s[1][1:].sum()) for s in seqs),
                 max_len=max(len(s[0]) for s in seqs))
    return seqs, stats


def pack(lengths, budget):
    """First-fit decreasing: indices into lengths -> bins whose lengths sum to at most budget."""
    bins = []  # [room left, [indices]]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((b for b in bins if b[0] >= lengths[i]), None)
        if fit is None:
            bins.append([budget, []])
            fit = bins[-1]
        fit[0] -= lengths[i]
        fit[1].append(i)
    return [b[1] for b in bins]


def plan(batch, lengths, world, budget):
    """Split a global batch over ranks balancing tokens (the same plan on every rank), and pack each
    share; ranks with fewer micro-batches get empty ones: FSDP needs every rank in every pass."""
    shares, load = [[] for _ in range(world)], [0] * world
    for i in sorted(batch, key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    micro = [[[share[j] for j in b] for b in pack([lengths[i] for i in share], budget)]
             for share in shares]
    most = max(len(m) for m in micro)
    return [m + [[]] * (most - len(m)) for m in micro]


def micro_batch(seqs, device, pad_id=0):
    """(ids, mask) pairs -> one packed row: input ids, next-token targets and their mask [1, N],
    cu_seqlens. The shift: position t predicts token t + 1, so the mask of token t + 1 goes with
    position t. An empty list gives one pad token with nothing to learn."""
    seqs = seqs or [(torch.tensor([pad_id], dtype=torch.int32), torch.tensor([False]))]
    ids = torch.cat([s[0] for s in seqs]).long()
    # each sequence's last token predicts nothing: its target is a pad with mask 0
    targets = torch.cat([torch.cat([s[0][1:].long(), torch.tensor([pad_id])]) for s in seqs])
    mask = torch.cat([torch.cat([s[1][1:], torch.tensor([False])]) for s in seqs])
    cu = cu_seqlens_from_lengths([len(s[0]) for s in seqs])
    return tuple(t.to(device) for t in (ids[None], targets[None], mask[None].float(), cu))


def packed_nll(model, mb):
    """Summed negative log-likelihood of the masked targets of one packed micro-batch."""
    ids, targets, mask, cu = mb
    return -(model.token_logprobs(ids, targets, cu_seqlens=cu) * mask).sum()


def data_order(n, seed, epoch):
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


@dataclass
class Run:  # what the loop works with, built by setup()
    cfg: Config
    rank: int
    world: int
    device: torch.device
    base_path: str
    tokenizer: object
    train_seqs: list           # (ids, mask) tensors
    eval_seqs: list
    lengths: list              # of train_seqs
    steps_per_epoch: int
    total_steps: int
    step: int                  # the steps done (> 0 after a resume)
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    metrics: Metrics


def train(cfg):
    """Run SFT as configured; returns the final Hugging Face checkpoint directory. Works in one
    process, under torchrun, or inside a process that already set up torch.distributed."""
    from tqdm import tqdm
    check(cfg)
    if cfg.data != "toy":
        check_data(cfg.data)
    with (distributed(cfg.device, cfg.dist_timeout) as (rank, world, device, sharded),
          claim(cfg.out_dir, "sft.py", cfg.resume)):
        run = setup(cfg, rank, world, device, sharded)
        if run.step == 0:
            held_out(run, 0)
        bar = tqdm(total=run.total_steps, initial=run.step, desc="sft",
                   disable=not (rank == 0 and cfg.progress))
        path, run_tokens, run_time = None, 0, 0.0
        while run.step < run.total_steps:
            t0 = time.time()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # the step's global batch (a seeded permutation per epoch), every rank's micro-batches
            epoch, index = divmod(run.step, run.steps_per_epoch)
            order = data_order(len(run.train_seqs), cfg.seed, epoch)
            batch = order[index * cfg.batch_size:(index + 1) * cfg.batch_size]
            micro = plan(batch, run.lengths, world, cfg.micro_batch_tokens)
            nll, loss_tokens = forward_backward(run, batch, micro)
            grad_norm, lr = clip_grads(run.model, cfg.grad_clip), run.scheduler.get_last_lr()[0]
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.step += 1
            entry = log_step(run, epoch, batch, micro, nll, loss_tokens, grad_norm, lr, t0, bar)
            run_tokens, run_time = run_tokens + entry["tokens"], run_time + entry["seconds"]
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step != run.total_steps:
                held_out(run, run.step)
            last = run.step == run.total_steps
            if last or (cfg.save_every and run.step % cfg.save_every == 0):
                trainer = dict(config=asdict(cfg), scheduler=run.scheduler.state_dict())
                path = save_checkpoint(cfg.out_dir, run.step, run.model, run.optimizer,
                                       run.tokenizer, trainer, run.base_path, cfg.save_dtype,
                                       cfg.keep_train_state, last=last)
        bar.close()
        eval_loss = held_out(run, run.step) if path else None
        path = path or checkpoints(cfg.out_dir)[-1][1]  # a resumed, finished run trained nothing
        run.metrics.log(event="end", step=run.step, checkpoint=path, eval_loss=eval_loss,
                        tokens_per_s=run_tokens / run_time if run_time else None)
        print0(f"done: {run.step} steps, held-out loss {eval_loss}, checkpoint {path}")
        run.metrics.finish(dict(steps=run.step, eval_loss=eval_loss))
        return path


def setup(cfg, rank, world, device, sharded):
    """Data (rendered, a held-out split chosen by seed, the short last batch dropped), model,
    optimizer and schedule (resumed when asked), the metrics file."""
    from transformers import AutoTokenizer
    toy_base = os.path.join(cfg.out_dir, "base")
    if cfg.model == "toy" or cfg.data == "toy":  # the toy preset: rank 0 builds base and data
        if rank == 0:
            toy.ensure(sft=True, base_dir=toy_base, seed=cfg.seed)
        barrier()
    base_path = toy_base if cfg.model == "toy" else resolve_model(cfg.model)
    data_path = toy.SFT_DATA if cfg.data == "toy" else cfg.data
    check_shared(cfg.out_dir, [data_path, base_path])
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    t0 = time.time()
    seqs, stats = load_data(data_path, tokenizer, cfg)
    split = data_order(len(seqs), cfg.seed, -1)
    n_eval = min(cfg.eval_size, len(seqs) // 2)
    eval_seqs = [seqs[i] for i in split[:n_eval]]
    train_seqs = [seqs[i] for i in sorted(split[n_eval:])]
    steps_per_epoch = len(train_seqs) // cfg.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"{data_path}: {len(train_seqs)} training records, fewer than one batch "
                         f"of {cfg.batch_size}")
    total_steps = min(steps_per_epoch * cfg.epochs, cfg.max_steps or 1 << 62)
    print0(f"data {data_path}: {stats['records']} records -> {len(train_seqs)} train + {n_eval} "
           f"held out, {stats['tokens']} tokens ({stats['loss_tokens']} assistant), longest "
           f"{stats['max_len']}; {stats['truncated']} truncated, {stats['dropped_too_long']} "
           f"dropped as too long, {stats['dropped_no_loss']} without assistant tokens; "
           f"{stats['retokenized']} tokenized differently in one pass ({time.time() - t0:.1f}s)")
    model = build_model(base_path, device, sharded)
    model.attn_backend = cfg.attn_backend
    model.gradient_checkpointing = cfg.gradient_checkpointing
    model.train()
    if device.type == "cuda" or cfg.attn_backend == "flash":
        print0(attention_path(cfg.attn_backend, device, compute_dtype(device)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    warmup = int(cfg.warmup_ratio * total_steps)

    def lr_factor(step):  # linear warmup over warmup_ratio of the steps, then cosine to zero (verl)
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    print0(f"model {base_path}: {model.num_params() / 1e6:.1f}M parameters, {world} rank(s) on "
           f"{device.type}, {total_steps} steps of {cfg.batch_size} trajectories "
           f"({steps_per_epoch} per epoch)")
    step, resume_from = 0, latest_resumable(cfg.out_dir) if cfg.resume else None
    if resume_from:
        trainer = load_checkpoint(resume_from, model, optimizer)
        check_resume(trainer, asdict(cfg), RESUME_FIELDS, total_steps, resume_from)
        scheduler.load_state_dict(trainer["scheduler"])
        step = trainer["step"]
        print0(f"resumed from {resume_from} at step {step}")
    metrics = Metrics(os.path.join(cfg.out_dir, "metrics.jsonl"), cfg, step)
    return Run(cfg, rank, world, device, base_path, tokenizer, train_seqs, eval_seqs,
               [len(s[0]) for s in train_seqs], steps_per_epoch, total_steps, step, model,
               optimizer, scheduler, metrics)


def held_out(run, at):
    """Token-mean loss over the held-out trajectories (all ranks share the work), logged at step
    `at`; None without any."""
    seqs, device = run.eval_seqs, run.device
    if not seqs:
        return None
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for group in plan(range(len(seqs)), [len(s[0]) for s in seqs], run.world,
                          run.cfg.micro_batch_tokens)[run.rank]:
            mb = micro_batch([seqs[i] for i in group], device)
            totals += torch.stack([packed_nll(run.model, mb).double(), mb[2].sum().double()])
    nll, count = all_reduce(totals.tolist(), device)
    run.metrics.log(event="eval", step=at, eval_loss=nll / count)
    return nll / count


def forward_backward(run, batch, micro):
    """This rank's micro-batches, forward and backward -> (summed NLL, token count). The gradient
    is the token mean over every assistant token of the global batch (each micro-batch's summed
    NLL / the batch's count; x world as FSDP2 averages over the ranks: distributed.build_model)."""
    loss_tokens = sum(int(run.train_seqs[i][1][1:].sum()) for i in batch)  # the whole batch's
    nll_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    # FSDP2 reduce-scatters each micro-batch's gradient as its backward ends, as rl.update does:
    # synced only after the last one, every rank would hold the whole model's gradient unsharded
    # in fp32 between them (~15 GiB for a 4B model). The shards add up to the same sum, and the
    # extra reduce-scatters are small beside a micro-batch of 32k tokens' forward and backward.
    for group in micro[run.rank]:
        nll = packed_nll(run.model, micro_batch([run.train_seqs[i] for i in group], run.device))
        (nll * (run.world / loss_tokens)).backward()
        nll_sum += nll.detach().double()
    return all_reduce([float(nll_sum)], run.device)[0], loss_tokens


def log_step(run, epoch, batch, micro, loss_sum, loss_tokens, grad_norm, lr, t0, bar):
    cfg, world, lengths = run.cfg, run.world, run.lengths
    seconds, tokens = time.time() - t0, sum(lengths[i] for i in batch)
    # ranks run their micro-batches in lockstep: each costs what the largest over ranks costs
    slots = world * sum(max(sum(lengths[i] for i in g) for g in step) for step in zip(*micro))
    entry = dict(event="train", step=run.step, epoch=epoch, loss=loss_sum / loss_tokens, lr=lr,
                 grad_norm=grad_norm, tokens=tokens, loss_tokens=loss_tokens,
                 micro_batches=len(micro[0]), padding_waste=1 - tokens / slots,
                 budget_fill=tokens / (len(micro[0]) * world * cfg.micro_batch_tokens),
                 tokens_per_s=tokens / seconds, seconds=seconds)
    if run.device.type == "cuda":
        entry["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    run.metrics.log(**entry)
    bar.update(1)
    bar.set_postfix(loss=f"{entry['loss']:.4f}", lr=f"{lr:.2e}",
                    tok_s=f"{entry['tokens_per_s']:.0f}")
    if not cfg.progress and run.step % cfg.log_every == 0:
        print0(f"step {run.step}/{run.total_steps} loss {entry['loss']:.4f} lr {lr:.2e} grad norm "
               f"{grad_norm:.3f} {entry['tokens_per_s']:.0f} tok/s, waste "
               f"{entry['padding_waste']:.1%}")
    return entry


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    allocator_defaults()  # before CUDA starts
    cfg = parse_args(argv or ["--preset=toy"])  # no arguments: the toy preset
    try:
        with quiet_interrupt(lambda why: resume_line("sft.py", cfg.out_dir, why), cfg.out_dir):
            train(cfg)
    except DataError as e:
        raise SystemExit(f"bad SFT data: {e}")


if __name__ == "__main__":
    main()
    exit_worker()
