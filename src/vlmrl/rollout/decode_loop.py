"""The sampling loop `generate` runs for vlmrl: transformers' own, but asking the device whether every
row has stopped once per STOP_CHECK_EVERY steps, not at every token (issue 46).

transformers' `_sample` ends each decode step with `bool(unfinished_sequences.max() == 0)`: the
host waits for the device to finish the step before it may queue the next one (on the H200, 4.3 s
of a 6.6 s generation in `aten::is_nonzero` / `item`; transformers defers the check on Apple's
MPS only). `generate(custom_generate=sample_loop)` keeps all of `generate`'s preparation (logits
processors, stopping criteria, the cache, the compiled step) and runs this loop instead, which is
`_sample`'s step for step (the same forward calls, logits processors, softmax and multinomial or
argmax, in the same order, so the same tokens and random stream), except for when it stops:

- the step where every row had stopped is kept on the device (`done_at`, no host sync);
- the host reads it once every STOP_CHECK_EVERY steps (one `item`), and stops there;
- the steps taken after every row had stopped (at most STOP_CHECK_EVERY - 1, all padding) are cut
  off the returned ids, so they are `_sample`'s ids exactly. The logits processors saw those steps
  too: the sampler's recorder keeps only as many steps as ids come back (sampling.py).

The length limit is known on the host and stops the loop at once. A model sharded across processes
(`synced_gpus`, FSDP2 generating layer by layer) takes transformers' own loop: every process must
step until all have finished, which is a collective per step anyway.
"""

from __future__ import annotations

import torch

STOP_CHECK_EVERY = 8
"""Decode steps between two reads of the stop flag: at most this many - 1 padding steps run after
the last row has stopped (3% of a 256-token completion's steps), for one host sync per 8 tokens."""


def next_tokens(scores: torch.Tensor, sampled: bool) -> torch.Tensor:
    """(N,) the step's tokens from (N, V) processed scores, as transformers' `_sample` draws them."""
    if sampled:
        return torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)


@torch.no_grad()
def sample_loop(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                stop_check_every: int = STOP_CHECK_EVERY, **model_kwargs) -> torch.Tensor:
    """`generate`'s decoding loop (its `custom_generate` argument): input_ids (N, P) -> (N, P + T), or
    with `return_dict_in_generate` transformers' output of them and of each step's raw logits and
    processed scores where asked (`output_logits`, `output_scores`). (`generate` passes a custom loop
    no `synced_gpus` and no streamer.)"""
    kept = {name: [] for name in ("logits", "scores") if getattr(generation_config, f"output_{name}")}
    prompt = input_ids.shape[1]
    pad = generation_config._pad_token_tensor
    stops_early = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    limit = stopping_criteria.max_length
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)  # (N,)
    done_at = torch.zeros((), dtype=torch.long, device=input_ids.device)  # length when all had stopped; 0: not yet
    compiled = model._valid_auto_compile_criteria(model_kwargs, generation_config)
    forward = model.get_compiled_call(generation_config.compile_config) if compiled else model.__call__
    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    steps = 0
    with model._optimize_model_for_decode():
        while True:
            if steps:
                inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
                outputs = forward(**inputs, return_dict=True)
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
            logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)  # (N, V)
            del outputs
            scores = logits_processor(input_ids, logits)  # (N, V)
            for name, steps_kept in kept.items():
                steps_kept.append(logits if name == "logits" else scores)
            tokens = next_tokens(scores, generation_config.do_sample)  # (N,)
            if stops_early:
                tokens = tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)  # (N, L + 1)
            unfinished = unfinished & ~stopping_criteria(input_ids, None)
            done_at = torch.where((done_at == 0) & (unfinished.max() == 0), input_ids.shape[1], done_at)
            steps += 1
            if (limit is not None and input_ids.shape[1] >= limit) or (
                    steps % stop_check_every == 0 and bool(done_at)):  # the one host sync per stop_check_every
                break
    ids = input_ids[:, :int(done_at) or input_ids.shape[1]]  # (N, P + T)
    if not generation_config.return_dict_in_generate:
        return ids
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(sequences=ids, **{name: tuple(steps_kept[:ids.shape[1] - prompt])
                                                       for name, steps_kept in kept.items()})
