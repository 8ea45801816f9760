"""The training stage: the GRPO and SFT loops and everything one update needs.

    api.py                  `vlmrl.train`, `vlmrl.sft`, `vlmrl.evaluate`: the runs from Python
    trainer.py              `vlmrl train`: the GRPO loop, read top to bottom
    sft.py                  `vlmrl sft`: supervised warm start on reference completions
    session.py              what both loops share: processes, policy, optimizer, resume, metrics
    experience.py           one step's rollouts, rewards and group advantages
    policy_update.py        the clipped surrogate loss over micro-batches (grpo.py's math)
    logprobs.py             log-probs of completions under a model (packed or plain)
    reference.py            the reference policy of the KL penalty
    packing.py              a prompt and its completions (or trajectories) in one sequence
    output_layer.py         the output layer in chunks: log-probs without the full logits
    optim.py                AdamW (the vision tower's own learning rate) and the warmup + decay
    stochastic_rounding.py  RoundingAdamW: bf16 weights that keep small updates
    strategy.py             what runs (single, DDP, FSDP2) and the refusal of what would not
    sharding.py             FSDP2: shard, gather for generation, full state dicts for checkpoints

May import every folder below it: safety, evaluation, rollout, models, report, tasks, and grpo,
config, seeds, disk, errors.
"""
