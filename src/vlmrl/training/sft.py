"""Supervised warm start: learn the output format (and a first skill) from reference completions.

The lesson of the scaling study: SFT to learn the structure, then RL to generalise. `sft(config)`
trains on each task example's `reference_completion` with the loss on completion tokens only (the
image and question are context, never targets), then saves a model that `vlmrl train` starts from
(`model.name_or_path=RUN/final`). It shares the config, processes, checkpoints, resume and
metrics.jsonl of the RL trainer (session.py); `train.*` sets steps, learning rate and schedule,
`sft.batch_size` the examples per step.

A completion's tokens are what the chat template puts after the generation prompt, up to and
including the first end-of-turn token: exactly what `generate` must produce, stop included.

With `rollout.tools`, an example whose `meta["reference_turns"]` holds a tool-using trajectory (the
model's turns as text) is learnt as that trajectory: its calls are run as in a rollout, the tools'
results are context, and the loss covers the model's turns only (tool_rollout.reference_rollout).
Each step then logs the tools' statistics as GRPO does (`tools/calls`, `tools/invalid_calls`,
`tools/turns`, `tools/cut`), and a step whose every reference call failed (a tool missing from
`rollout.tools`, a tool that raises) says so once, on one line: the model would learn from errors.

A train example the task cannot make, or a data-file row whose image the processor refuses or whose
prompt is longer than rollout.max_prompt_length, met past the preflight's first batch follows the
task's on_bad_row as in `vlmrl train` (safety/bad_rows.py): each data-file row is encoded alone the
first time it is drawn.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from vlmrl.config import Config
from vlmrl.errors import VlmrlError, require, warn
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.generation import stop_token_ids
from vlmrl.rollout.prompts import chat_messages
from vlmrl.rollout.tool_rollout import ToolBox, ToolRollout, reference_rollout, trajectory_statistics
from vlmrl.safety.early_checks import check_before_loading
from vlmrl.safety.preflight import run_preflight
from vlmrl.seeds import derive_seed
from vlmrl.tasks import Example, Task
from vlmrl.training.logprobs import LogprobScorer
from vlmrl.training.sft_batches import SftBatches
from vlmrl.training.session import StepClock, TrainingSession, epoch_metric


def completion_text(processor, example: Example) -> str:
    """The reference completion as the chat template writes the assistant turn (end token included)."""
    messages = chat_messages(example)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = {"role": "assistant", "content": [{"type": "text", "text": example.reference_completion}]}
    full = processor.apply_chat_template(messages + [answer], tokenize=False)
    return full[len(prompt):] if full.startswith(prompt) else example.reference_completion


@dataclass
class References(Completions):
    """Reference completions and, of each, the tokens the loss learns: every completion token but
    those of spans left out (an example shown without its image: the task's image_only_spans)."""

    trained_mask: torch.Tensor  # (N, T) 1 on the completion tokens the loss learns

    def select(self, index: list[int]) -> References:
        chosen = Completions.select(self, index)
        at = torch.tensor(index, dtype=torch.long, device=self.trained_mask.device)
        return References(chosen.rows, chosen.completion_ids, chosen.completion_mask, self.trained_mask[at])

    def to(self, device: torch.device) -> References:
        moved = Completions.to(self, device)
        return replace(moved, trained_mask=self.trained_mask.to(device))


def without_media(example: Example) -> Example:
    """`example` with no image and no video: the prompt and the reference completion alone."""
    text = copy.copy(example)
    text.images, text.originals, text.videos, text.video_originals = [], [], [], []
    return text


def completion_tokens(processor, examples: list[Example], stop_ids: list[int],
                      untrained: list[list[tuple[int, int]]] | None = None) -> tuple[torch.Tensor, ...]:
    """Token ids (N, T) of each reference completion, right-padded, their mask (N, T), and the mask
    of the tokens the loss learns (N, T): the completion's tokens but those that overlap the
    (start, end) characters of `untrained[i]` in example i's reference_completion.

    Each completion ends at its first stop token (appended when the template wrote none).
    """
    rows, learnt = [], []
    for i, example in enumerate(examples):
        if not example.reference_completion:
            raise VlmrlError(f"example {example.meta.get('idx')} has no reference_completion to learn from")
        text = completion_text(processor, example)
        spans = untrained[i] if untrained else []
        offset = text.find(example.reference_completion) if spans else 0  # where the reference starts in the text
        require((not spans or processor.tokenizer.is_fast,
                 "sft.text_examples: the task's image_only_spans need a fast tokenizer (its character offsets)"),
                (not spans or offset >= 0, "sft.text_examples: the chat template rewrites the reference "
                 "completion, so the task's image_only_spans are not found in it"))
        encoded = processor.tokenizer(text, add_special_tokens=False, return_offsets_mapping=bool(spans))
        ids = encoded.input_ids
        stops = [t for t, token in enumerate(ids) if token in stop_ids]
        rows.append(ids[:stops[0] + 1] if stops else ids + [stop_ids[0]])
        flags = [0 if overlaps(where, spans, offset) else 1 for where in encoded.offset_mapping] if spans else [1] * len(ids)
        learnt.append((flags + [1])[:len(rows[-1])])  # the stop token is learnt
    length = max(len(r) for r in rows)
    pad = processor.tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows])  # (N, T)
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])  # (N, T)
    trained = torch.tensor([t + [0] * (length - len(t)) for t in learnt])  # (N, T)
    return ids, mask, trained


def overlaps(where: tuple[int, int], spans: list[tuple[int, int]], offset: int) -> bool:
    """Whether a token at characters `where` of the completion text overlaps a span of the reference
    completion, which starts at `offset` in that text."""
    start, end = where
    return any(start < offset + b and end > offset + a for a, b in spans)


def sft(config: Config, task: Task | None = None) -> Path:
    """Fine-tune on reference completions as configured (on `task` when given: a Task built in Python,
    else the config's); returns the run directory (model in final/)."""
    task = check_before_loading(config, "sft", task)  # layout, task, tools, trackers, model path: before loading
    with TrainingSession(config, config.train.steps, task=task) as session:  # an error gives the handlers and the folder back
        batch = config.sft.batch_size
        config.sft.check_layout(session.world)  # the processes accelerate really started
        per_process = batch // session.world
        stop_ids = stop_token_ids(session.processor, session.policy)
        device = session.accelerator.device
        run_preflight(session, task, "sft")  # first batches, prompt lengths, memory: fail before step 1
        session.make_held_out(task)  # every held-out example made and encoded once: a bad one shows now
        scorer = LogprobScorer(session.processor, 1.0, config.train.pack_groups, config.train.logprob_chunk,
                               config.train.block_attention)
        toolbox = ToolBox.from_config(config.rollout) if config.rollout.tools else None
        warned = False  # about reference calls that all failed: once a run

        def indices(step: int) -> list[int]:  # this process's share of the step's batch
            first = step * batch + session.rank * per_process
            return list(range(first, first + per_process))

        text_here = config.sft.text_examples // session.world

        def make(examples: list[Example], processor) -> Completions:
            copies = examples[:text_here]  # learnt a second time without their images (sft.text_examples)
            untrained = [[] for _ in examples] + [task.image_only_spans(example) for example in copies]
            return reference_batch(processor, examples + [without_media(example) for example in copies],
                                   toolbox, stop_ids, untrained)

        batches = SftBatches(task, session.processor, config.rollout.max_prompt_length, indices, make,
                             session.start_step, config.train.steps, config.train.prefetch_batches)
        try:
            progress = tqdm(range(session.start_step, config.train.steps), initial=session.start_step,
                            total=config.train.steps, desc="sft", unit="step", disable=not session.main,
                            dynamic_ncols=True)
            for step in progress:
                clock = StepClock()
                drawn, waited = batches.take(step)  # made ahead by the worker (train.prefetch_batches), or now
                session.stop_at_bad_row(drawn.stop, step, step * batch)
                references = drawn.references
                session.policy.train()
                torch.manual_seed(derive_seed(config.seed, step, "sft"))  # dropout, identical on resume
                metrics = sft_update(session, scorer, references.to(device)) | tool_statistics(session, references)
                warned = warned or warn_if_every_call_failed(session, metrics, references, step + 1)
                skipped = session.accelerator.reduce(torch.tensor([sum(u != w for u, w in zip(drawn.used, drawn.wanted))],
                                                                  device=device), "sum")
                metrics |= {"bad_rows_skipped": int(skipped)} if int(skipped) else {}
                metrics |= epoch_metric(task, (step + 1) * batch)
                metrics |= {"step": step + 1, "examples_seen": (step + 1) * batch,
                            "lr": session.scheduler.get_last_lr()[0], "skipped_steps": session.guard.skipped}
                metrics |= clock.metrics() | drawn.metrics(waited)
                metrics |= session.maybe_evaluate(step + 1, task)
                session.record(metrics)
                progress.set_postfix(loss=f"{metrics['loss']:.3f}", confident=f"{metrics['confident_tokens']:.2f}")
                session.maybe_save(step + 1, (step + 1) * batch)
                session.check_stop(step + 1, (step + 1) * batch)  # a stop signal, or too many NaN updates
        finally:
            batches.close()  # the worker stopped, whatever ended the loop
        return session.finish()


def reference_batch(processor, examples: list[Example], toolbox: ToolBox | None, stop_ids: list[int],
                    untrained: list[list[tuple[int, int]]] | None = None) -> Completions:
    """What SFT learns from `examples`: their reference trajectories when the run has tools and they
    have some, else their reference completions, without the characters `untrained[i]` of example
    i's in the loss."""
    if toolbox is not None and all("reference_turns" in ex.meta for ex in examples):
        return reference_rollout(processor, examples, toolbox, stop_ids)  # no text copies with tools (Config.validate)
    ids, mask, trained = completion_tokens(processor, examples, stop_ids, untrained)  # (n, T) each
    return References(examples, ids, mask, trained)


def tool_statistics(session: TrainingSession, references: Completions) -> dict[str, float]:
    """tools/calls, tools/invalid_calls, tools/turns and tools/cut: means over the global batch's reference
    trajectories (as GRPO logs them); {} when the batch has none."""
    if not isinstance(references, ToolRollout):
        return {}
    accelerator = session.accelerator
    return {f"tools/{name}": float(accelerator.gather(values.to(accelerator.device)).mean())
            for name, values in trajectory_statistics(references).items()}


def warn_if_every_call_failed(session: TrainingSession, metrics: dict[str, float], references: Completions,
                              step: int) -> bool:
    """Whether the step's reference trajectories made calls and every one failed; if so the main process
    says so on one line, with this process's failures by kind."""
    calls = metrics.get("tools/calls", 0.0)
    if not (calls > 0 and metrics["tools/invalid_calls"] == calls):
        return False
    kinds = Counter(kind for trajectory in references.trajectories for kind in trajectory.errors)
    if session.main:
        warn(f"sft: every tool call of the reference trajectories failed at step {step} ("
             + ", ".join(f"{kind} x {count}" for kind, count in kinds.most_common())
             + "); the model learns from error results: check rollout.tools against the task's reference_turns")
    return True


def sft_update(session: TrainingSession, scorer: LogprobScorer, batch: Completions) -> dict[str, float]:
    """One optimizer step of token-mean negative log-likelihood over the global batch.

    Logs loss (nats per token), confident_tokens (share of target tokens given p > 1/2, so surely
    what greedy decoding picks) and grad_norm. An update whose loss or gradient is NaN/inf is
    skipped (session.guard).

    batch: this process's reference completions. Micro-batches accumulate; every token of the
    global batch weighs the same, whatever process or micro-batch it is in.
    """
    accelerator, micro = session.accelerator, session.config.train.micro_batch_size
    tokens_here = learnt_tokens(batch).sum().float()
    total_tokens = accelerator.reduce(tokens_here.clone(), "sum").clamp(min=1.0)
    sums = torch.zeros(2, device=accelerator.device)  # nll, confident tokens: stays on the device
    starts = list(range(0, len(batch.rows), micro))
    for i, start in enumerate(starts):
        part = batch.select(list(range(start, min(start + micro, len(batch.rows)))))
        last = i == len(starts) - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(session.model):
            logp, _ = scorer(session.model, part)  # (m, T), 0 on padding
            logp = logp * learnt_tokens(part)  # (m, T), 0 where not learnt
            loss = -logp.sum() / total_tokens * accelerator.num_processes
            session.backward(loss, last)
        confident = ((logp.detach() > -0.6931) * learnt_tokens(part)).sum()  # p > 1/2: surely the argmax
        sums += torch.stack([-logp.detach().sum(), confident]).float()
    nll_here = float(sums[0])  # the one device-to-host copy of the micro-batch loop
    grad_norm = session.guard.step(session.update, session.scheduler, nll_here)
    stats = accelerator.reduce(sums, "sum") / total_tokens  # (2,) per token of the global batch
    return {"loss": float(stats[0]), "confident_tokens": float(stats[1]), "grad_norm": grad_norm}


def learnt_tokens(batch: Completions) -> torch.Tensor:
    """(N, T) 1 on the tokens the loss learns: `References.trained_mask`, else every completion token."""
    return batch.trained_mask if isinstance(batch, References) else batch.completion_mask
