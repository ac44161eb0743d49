"""Chat with a checkpoint that can call the code tool:
    python scripts/chat.py --model DIR [--device cuda] [--temperature 0.7] [--max_turns 8] ...
    python scripts/chat.py --model runs/toy/rl/final     # the toy policy: ask "What is 123 * 456?"
Every RolloutConfig field is a flag (--seed -1: random). /reset starts over, /quit (or ctrl-d) leaves.
The conversation stays as token ids between turns (token in, token out)."""
import contextlib
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from machinery import flags  # noqa: E402
from machinery.flags import parse_config  # noqa: E402
from rollout import AgentLoop, Engine, RolloutConfig, chat_format  # noqa: E402


@dataclass
class ChatConfig(RolloutConfig):
    model: str = ""       # a Hugging Face checkpoint directory
    device: str = "auto"
    seed: int = -1        # -1: a random seed each turn


def main(argv):
    from transformers import AutoTokenizer
    from machinery.distributed import resolve_model
    from model import Transformer
    args = parse_config(ChatConfig, argv, __doc__)
    flags.rule(args.model != "", "model", args.model, "required: a checkpoint directory")
    flags.model_dir(args, skip=())
    flags.rollout(args)  # before the model loads: one line on a bad value
    flags.choices(args, device=("auto", "cuda", "cpu"))
    config = replace(args, seed=None if args.seed < 0 else args.seed)  # a RolloutConfig
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    path = resolve_model(args.model)  # a hub id is downloaded
    model, tokenizer = Transformer.from_pretrained(path, device=device), AutoTokenizer.from_pretrained(path)
    chat, ids = chat_format(tokenizer, config), None
    print(f"loaded {args.model} on {device}; /reset starts over, /quit (or ctrl-d) leaves")
    while (line := input("\nyou> ").strip()) not in ("/quit", "/exit"):
        if line == "/reset" or not line:
            ids = None if line == "/reset" else ids
            continue
        if ids is None:
            ids = chat.prompt_ids(line)
        else:  # a trajectory cut by the budget has no end-of-turn token yet
            ids += ([] if ids[-1] in chat.stop_ids else [chat.end_of_turn]) + chat.forced_ids("user", [line])
        engine, t0 = Engine(model, max_num_seqs=1, max_seq_lens=[len(ids) + config.max_response_tokens]), time.time()
        traj = AgentLoop(engine, chat, config).run([ids], [(0, 0)])[0].trajectory(tokenizer)
        n = len(traj.response_ids)
        print(f"\nassistant> {traj.text}\n[{n} tokens, {len(traj.tool_calls)} tool calls, {traj.finish_reason}, "
              f"{n / (time.time() - t0):.1f} tok/s]")
        ids = ids + traj.response_ids


if __name__ == "__main__":
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        main(sys.argv[1:])
