"""The machinery beside the six stage files, which a first reading can skip (README, "Files").

flags            flags read into a dataclass, and the rules every flag and input is checked by
distributed      process groups, collectives, FSDP2 building, hub ids, several nodes' checks
checkpoints      checkpoint writing, verification and exact resume
run_log          metrics.jsonl, wandb, the step line, kept trajectories, the learning curve
exits            what Ctrl-C prints; how a torchrun worker leaves
eval_resume      when evaluate.py may reuse the samples of an earlier --out
memory_plan      one RL step's phases on dummy tokens: the KV pool's budget and scripts/plan.py
fast_sampling    the rollout's fast paths (row buffers, flash-attn, CUDA graphs, CPU weights)
final_answer     the final answer of a response; the math and choice normalisation
code_grading     LiveCodeBench's, TACO's and the assert-style rows' test harness and rules
sandbox_pool     the sandbox's warm pool and its verdicts
sandbox_worker   the pool's zygote and the confined child it forks per run
sandbox_linux    the Linux calls a run locks itself down with (seccomp, Landlock, namespaces)
"""
