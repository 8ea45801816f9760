"""The rollout stage: task examples become prompts, each prompt G completions, each completion its
rewards.

    prompts.py        the chat turn, the processor call, the image token
    generation.py     grouped generation: each prompt (and image) prefilled once, G completions
    prefill.py        the prompt's KV cache computed once and shared by its group
    decoding.py       the decode paths (dynamic, static, compiled) and their kept cache
    sampling.py       the sampler's own log-probs, recorded while decoding
    completions.py    completions as tensors (ids, masks, their prompts' rows)
    tool_rollout.py   multi-turn rollouts: the model calls visual tools between turns
    trajectories.py   a multi-turn trajectory as model inputs
    scoring.py        each completion scored by its task's rewards (components and total)

May import: the models folder, tasks, config, seeds, errors. Nothing from training, safety,
evaluation or the report.
"""
