"""Preflight: the checks that make a run fail in seconds, before step 1, rather than at hour three.

`vlmrl train` and `vlmrl sft` run them once the model is loaded, after the checks that need no
model (early_checks.py: layout, task, tools, trackers, model path); `vlmrl check CONFIG` runs both
alone and prints the report. They:
- make the first batch of every split the run uses (train, and eval.splits when eval.every > 0)
  and encode each prompt with the model's own processor, so a task error, a bad image or a
  processor error shows now, naming the split and the example (the geometry task checks
  every row of its dataset when it loads: see its on_bad_row; with on_bad_row=skip a bad train
  example is replaced here as in the run, safety/bad_rows.py);
- check each prompt: no special token (an image placeholder) written into the question, which
  breaks the match between image tokens and image features, and prompt plus image tokens within
  rollout.max_prompt_length. Image tokens are never truncated: a longer prompt is an error that
  says how many of its tokens are image tokens; and each generation (rollouts, evaluations) after the
  longest prompt of its split within the model's context (max_position_embeddings, context.py);
- estimate the peak memory of the configured batch, G and lengths (weights, gradients, AdamW
  moments, the reference copy, the distillation teacher, the generation KV cache, training
  activations) and warn
  when it exceeds what the device has free. The activations are what the model keeps for
  backward per token and per image token, measured on the loaded model (activation_memory.py),
  times the tokens and images a micro-batch computes (each prompt and image once per group when
  groups are packed). Allocator overhead and framework buffers are not counted: a warning to
  heed, not a guarantee either way;
- settle `model.gradient_checkpointing` and `train.micro_batch_size` when they are "auto": the
  largest micro-batch whose estimate fits, without checkpointing if any fits so, else with it
  (`settle`); the run then trains with what was settled, the same on every process;
- estimate what the run writes at most at one time (step checkpoints kept plus the one being
  written, the final model, logs) and warn when the output filesystem has less free (disk.py);
- say which speedups the run takes with this model (`speed_line`): a switch that is on but falls
  back for this model family, attention kernel or device shows here, with the reason, before step 1;
- settle where checkpoints are written (`checkpoint_plan`): with train.background_checkpoints the
  main process copies what a checkpoint holds (the weights, AdamW's moments, the reference copy; a
  sharded run's gathered whole) to host memory and writes it while training goes on; when that copy
  does not fit in the host's available RAM beside the run (on a CPU device the run's own peak lives
  in the same RAM), the run writes its checkpoints on the step's path instead and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmrl.config import Config
from vlmrl.disk import DiskEstimate, free_space, gib
from vlmrl.errors import VlmrlError, warn
from vlmrl.models.context import check_generation_length
from vlmrl.models.fused_kernels import computes_fused, fused_kernels_unsupported
from vlmrl.models.loading import checkpoint_activations, is_vision_parameter, load_trainable_policy, resolve_device
from vlmrl.models.support import (
    ZERO3_UNTAPPABLE,
    block_attention_unsupported,
    hf_model,
    output_layer_unchunkable,
    output_layer_untappable,
    packed_passes_unsupported,
    shared_prefill_unsupported,
    tool_rollouts_unsupported,
)
from vlmrl.models.teacher_check import teacher_weight_bytes
from vlmrl.models.tool_models import tool_model_bytes
from vlmrl.models.vision_attention import batched_vision_unsupported
from vlmrl.rollout.decoding import cache_length, decode_mode, kept_cache_bytes, kv_cache_bytes
from vlmrl.models.video_processing import takes_video
from vlmrl.rollout.prompts import chat_messages, encode_prompts, length_problem, processor_inputs, vision_tokens
from vlmrl.rollout.trajectories import prompt_text
from vlmrl.safety.activation_memory import ActivationCosts, embedding_gradients, measure_activation_costs
from vlmrl.safety.bad_rows import RowGuard, make_example
from vlmrl.rewards.reward import build_rewards, describe
from vlmrl.safety.early_checks import check_before_loading
from vlmrl.tasks import Example, Task

HEADROOM = 0.1
"""Share of the free memory a run is not planned into: what the estimate does not count (blocks the
allocator caches but cannot reuse, kernel workspaces, communication buffers). The estimate counts
live tensors closely (benchmarks/bench_memory.py), so "fits" leaves this much spare."""

LOGIT_BYTES = 12
"""Bytes per logit that backward through the output layer allocates at its start: logits, their
float32 log-softmax and its gradients for one chunk of positions (recomputed in backward). Measured
on the CPU for 1024 positions x 152k vocabulary: 12.0 in bfloat16 and in float32, the output
layer's weight trained or frozen."""


@dataclass(frozen=True)
class Sharding:
    """How a run splits the parameters over its processes, as the memory estimate needs it."""

    parts: int = 1
    """Processes the parameters are split over (FSDP2, ZeRO-3); 1: each holds them whole."""
    deepspeed: bool = False
    """ZeRO-3 (training/zero3.py): the reference whole, an fp32 copy of each partition, whole logits."""


@dataclass
class SplitCheck:
    """The first batch of one split, encoded."""

    split: str
    prompts: int
    longest: int
    """Tokens of the longest prompt, image tokens included."""
    image_tokens: int
    """Image and video tokens in that prompt (what the vision tower computes, as the memory estimate
    counts it)."""
    example: int
    """Index of that example in the split."""
    video_tokens: int = 0
    """Of `image_tokens`, those of videos."""

    def vision(self) -> str:
        """`12 image tokens`, or `4 image and 32 video tokens` where the prompt has video."""
        if self.video_tokens:
            return f"{self.image_tokens - self.video_tokens} image and {self.video_tokens} video tokens"
        return f"{self.image_tokens} image tokens"


@dataclass
class MemoryEstimate:
    """Peak memory of one process, in bytes, and what its device has free."""

    device: str
    weights: int
    gradients: int
    optimizer: int
    reference: int
    generation: int
    """KV cache and one step's logits of the largest generate call (rollouts, or evaluation)."""
    activations: int
    """The peak of one training micro-batch's forward and backward on top of the rest: what it
    keeps for backward, the output layer's chunk, embedding gradients in flight."""
    loaded: int
    """Of the above, already in memory when the device's free memory was read."""
    free: int | None
    """Free memory of the device (RAM on a CPU), None when unknown."""
    sharers: int = 1
    """Processes sharing that memory (several CPU processes share the RAM)."""
    kept_cache: int = 0
    """The static KV cache the compiled decode path keeps from one step's generation to the next
    (decoding.py): alive through the training phase too."""
    shards: int = 1
    """Processes the parameters are split over (FSDP2, ZeRO-3): weights, gradients, AdamW and the
    reference above are each process's part (under ZeRO-3 the reference is whole)."""
    deepspeed: bool = False
    """ZeRO-3: generation always gathers the whole model."""
    gathered_generation: int = 0
    """Sharded: what generation gathers beyond the shards: the rest of the weights
    (rollout.fsdp_generation=whole), or of the root and two blocks (layers)."""
    whole_generation: bool = True
    """Sharded: generation gathers the whole model (rollout.fsdp_generation=whole), else by layers."""
    gathered_training: int = 0
    """Sharded: the units gathered at once in training (the root, the layer computing and the next)."""
    teacher: int = 0
    """The distillation teacher's weights (algorithm.teacher), this process's part: sharded like the
    policy under FSDP2, whole under ZeRO-3 (training/teacher.py)."""
    tool_models: int = 0
    """The weights of the model tools the rollouts call (rollout.tool_models, float32), whole in every
    process: each loads its own at its first call (tools/model_tools.py)."""

    @property
    def peak(self) -> int:
        # Generation runs before the update, under no_grad: the two are never alive together.
        return (self.weights + self.gradients + self.optimizer + self.reference + self.teacher + self.tool_models
                + max(self.generation + self.gathered_generation,
                      self.activations + self.kept_cache + self.gathered_training))

    @property
    def needed(self) -> int:
        """Memory still to be taken, over all processes sharing the device."""
        return max(0, self.peak - self.loaded) * self.sharers

    @property
    def fits(self) -> bool | None:
        return None if self.free is None else self.needed <= self.free * (1 - HEADROOM)


@dataclass
class PreflightReport:
    mode: str
    splits: list[SplitCheck]
    memory: MemoryEstimate
    parameters: int
    trainable: int
    dtype: str
    max_prompt_length: int
    disk: DiskEstimate
    settled: Settled
    """What the "auto" memory settings became (and the fixed ones)."""
    bad_rows: list = field(default_factory=list)
    """What the task left out when it loaded (on_bad_row=skip): (split, row, problem)."""
    speed: str = ""
    """Which speedups the run takes (see `speed_line`)."""
    costs: ActivationCosts | None = None
    """What the model keeps for backward per token, as the preflight measured it."""
    processes: str = ""
    """What runs (training/strategy.py): `processes: 2, strategy: FSDP2, backend: gloo`; the first line."""
    data: str = ""
    """The data a file-backed task reads: its column mapping, rows and order (`data_line`), and epochs."""
    checkpoints: CheckpointPlan | None = None
    """Where the run writes its checkpoints, and the host copy that decides it (`checkpoint_plan`)."""

    def advice(self) -> list[str]:
        """What to change where the run may not fit: its memory, then its disk ([] when it fits)."""
        return (([memory_advice(self.memory)] if self.memory.fits is False else [])
                + ([self.disk.advice()] if self.disk.fits is False else []))

    def lines(self) -> list[str]:
        m = self.memory
        out = [self.processes] if self.processes else []
        out += [f"model      {self.parameters / 1e6:.2f}M parameters, {self.trainable / 1e6:.2f}M trainable, "
               f"{self.dtype}"]
        for s in self.splits:
            label = s.split if s.split == "train" else f"eval/{s.split}"
            out.append(f"{label:<10} {s.prompts} prompts; longest {s.longest} tokens ({s.vision()}, "
                       f"example {s.example}) of rollout.max_prompt_length={self.max_prompt_length}")
        adamw = "AdamW and its fp32 copy" if m.deepspeed else "AdamW"
        parts = [f"weights {gib(m.weights)}", f"gradients {gib(m.gradients)}", f"{adamw} {gib(m.optimizer)}"]
        if m.reference:
            parts.append(f"{'whole reference' if m.deepspeed else 'reference'} {gib(m.reference)}")
        if m.teacher:
            parts.append(f"{'whole teacher' if m.deepspeed else 'teacher'} {gib(m.teacher)}")
        if m.tool_models:
            parts.append(f"tool models {gib(m.tool_models)}")
        kept = f" + the decode cache kept {gib(m.kept_cache)}" if m.kept_cache else ""
        if m.shards > 1:
            parts[0] = f"1/{m.shards} of the weights {gib(m.weights)}"
            parts.append(f"then the larger of generation {gib(m.generation)} + the weights it gathers "
                         f"{gib(m.gathered_generation)} and training activations {gib(m.activations)}{kept} + units "
                         f"gathered {gib(m.gathered_training)}")
        else:
            parts.append(f"then the larger of generation {gib(m.generation)} and training activations "
                         f"{gib(m.activations)}{kept}")
        if m.free is None:
            verdict = "free memory unknown"
        else:
            shared = f" for {m.sharers} processes" if m.sharers > 1 else ""
            verdict = (f"{gib(m.needed)} more needed{shared}, {gib(m.free)} free on {m.device} "
                       f"({HEADROOM:.0%} kept spare): " + ("fits" if m.fits else "DOES NOT FIT"))
        out.append(f"memory     about {gib(m.peak)} per process at peak; {verdict}")
        out.append(f"           ({', '.join(parts)})")
        if self.costs is not None:
            out.append(f"           activations measured: {gib(round(self.costs.per_token))} per token, "
                       f"{gib(round(self.costs.per_image_token))} per image token")
        if self.settled.automatic:
            out.append(self.settled.line())
        out.append(self.disk.line())
        if self.checkpoints is not None:
            out.append(f"checkpoints {self.checkpoints.line()}")
        if self.speed:
            out.append(f"speed      {self.speed}")
        if self.data:
            out.append(f"data       {self.data}")
        if self.bad_rows:
            split, row, problem = self.bad_rows[0]
            out.append(f"data       {len(self.bad_rows)} bad rows skipped (first: {problem})")
        return out


def preflight(config: Config, policy, processor, task: Task, mode: str, world: int = 1, start: int = 0,
              loaded: int | None = None, sharding: Sharding = Sharding()) -> PreflightReport:
    """Check the first batches and estimate memory; VlmrlError on a problem that would crash the run.

    mode: "train" (RL rollouts) or "sft". `start`: index of this process's first train example
    (the data cursor). `loaded`: bytes already in memory (default: the policy's weights).
    `sharding`: how the parameters are split over the processes (the policy is passed gathered whole).
    """
    check_something_trains(config, policy, mode)
    if config.rollout.tools and (reason := tool_rollouts_unsupported(policy)) is not None:
        raise VlmrlError(f"rollout.tools: tool rollouts are off for this model ({reason}); train it without tools")
    if getattr(task, "video_rows", 0) and not takes_video(processor):  # a video past the first batch, before step 1
        rows = f"{task.video_rows} rows of the data hold" if task.video_rows > 1 else "1 row of the data holds"
        raise VlmrlError(f"{rows} a video, and the model's processor "
                         f"({type(processor).__name__}) takes none: `vlmrl models` lists the families that take video")
    limit = config.rollout.max_prompt_length
    checks = []
    completion = config.rollout.max_new_tokens
    rows = RowGuard(task, processor, limit=limit)
    for split, indices in first_batches(config, task, mode, world, start).items():
        if split == "train" and rows.skips:  # on_bad_row=skip: a bad example replaced, as in the run
            indices, examples = rows.checked(indices)
        else:
            examples = [make_example(task, i, split) for i in indices]
        checks.append(check_prompts(processor, examples, indices, split, limit, hf_model(policy).config))
        if mode == "sft" and split == "train":
            completion = max(len(processor.tokenizer(ex.reference_completion, add_special_tokens=False).input_ids)
                             for ex in examples) + 2  # end-of-turn tokens
    check_generation_lengths(config, policy, mode, {check.split: check.longest for check in checks})
    longest = max(check.longest for check in checks)
    image_tokens = max(check.image_tokens for check in checks)
    costs = measure_activation_costs(policy, processor)
    settled, memory = settle(config, policy, mode, world, (longest, completion, image_tokens), costs, loaded,
                             sharding)
    params = list(policy.parameters())
    trainable = trainable_count(config, policy, mode)
    return PreflightReport(mode=mode, splits=checks, memory=memory, parameters=sum(p.numel() for p in params),
                           trainable=trainable, dtype=dtype_note(config, params),
                           max_prompt_length=limit, disk=estimate_disk(config, policy, mode), settled=settled,
                           bad_rows=list(getattr(task, "bad_rows", ())),
                           speed=speed_line(config, policy, mode, sharding.deepspeed), costs=costs,
                           data=data_line(config, task, mode),
                           checkpoints=checkpoint_plan(config, policy, mode, memory, sharding))


def trainable_count(config: Config, policy, mode: str) -> int:
    """How many of the policy's parameters the run updates: those that take gradients, less the vision
    tower's where RL gives it no learning rate (model.vision_lr_scale=0)."""
    frozen_vision = mode == "train" and config.model.vision_lr_scale == 0
    return sum(p.numel() for name, p in policy.named_parameters()
               if p.requires_grad and not (frozen_vision and is_vision_parameter(name)))


def check_something_trains(config: Config, policy, mode: str) -> None:
    """A run in which no parameter would change is refused in one line, before step 1 (else the first
    backward fails with "element 0 of tensors does not require grad", or the run trains nothing)."""
    if trainable_count(config, policy, mode) == 0:
        total = sum(p.numel() for p in policy.parameters())
        raise VlmrlError(f"no parameter of the model would train (0 of {total / 1e6:.2f}M trainable): check "
                         "model.freeze_vision, model.vision_lr_scale and model.lora (its target_modules must name "
                         "modules of this model)")


def data_line(config: Config, task: Task, mode: str) -> str:
    """What a file-backed task reads (its mapping, rows and order) and how many epochs the run makes
    of its train rows; "" for a procedural task."""
    line = task.data_line() if hasattr(task, "data_line") else ""
    if not line or not hasattr(task, "size"):
        return line
    per_step = config.sft.batch_size if mode == "sft" else config.rollout.prompts_per_step
    rows = task.size("train")
    return (f"{line}; {-(-rows // per_step)} steps per epoch of {per_step} prompts, "
            f"{config.train.steps * per_step / rows:.2f} epochs in {config.train.steps} steps")


def check_generation_lengths(config: Config, policy, mode: str, longest: dict[str, int]) -> None:
    """Each generation the run makes, after the longest prompt of its split (`longest`: split -> tokens),
    fits the model's context (context.py): rollouts (with tools, each turn and the whole trajectory)
    and evaluations."""
    rollout = config.rollout
    if mode == "train":
        check_generation_length(policy, "rollout.max_new_tokens", rollout.max_new_tokens, longest["train"], "train")
        if rollout.tools:
            check_generation_length(policy, "rollout.max_trajectory_tokens", rollout.max_trajectory_tokens,
                                    longest["train"], "train")
    if config.eval.every > 0:
        name = "eval.max_new_tokens" if config.eval.max_new_tokens else "rollout.max_new_tokens"
        for split in config.eval.splits:
            check_generation_length(policy, name, config.eval.max_new_tokens or rollout.max_new_tokens,
                                    longest[split], f"eval/{split}")


def dtype_note(config: Config, params: list[torch.nn.Parameter]) -> str:
    """The weights' dtype, and how bf16 weights take their updates (stochastic_rounding.py)."""
    dtype = str(params[0].dtype).replace("torch.", "")
    if any(p.requires_grad and p.dtype == torch.bfloat16 for p in params):
        dtype += (" (updates stochastically rounded)" if config.train.stochastic_rounding else
                  " (updates rounded to nearest: those under |w| / 512 are lost)")
    return dtype


def speed_line(config: Config, policy, mode: str = "train", deepspeed: bool = False) -> str:
    """The speedups a run takes with this model, each switch's fallback and its reason; SFT
    (mode "sft") generates nothing and packs no groups, so its line names the output layer, the
    vision windows and the fused kernels only. `deepspeed`: as under ZeRO-3 (`vlmrl check` plans one
    on a model it has not partitioned)."""
    def switch(name: str, on: bool, reason: str | None) -> str:
        return name if on and reason is None else f"no {name} ({'off' if not on else reason})"

    parts = []
    if mode == "train":
        packing = packed_passes_unsupported(policy)
        parts += [switch("shared prompt cache", config.rollout.share_prompt_cache, shared_prefill_unsupported(policy)),
                  switch("packed log-prob passes", config.train.pack_groups, packing)]
        if config.train.pack_groups and packing is None:
            parts.append(switch("block attention", config.train.block_attention, block_attention_unsupported(policy)))
    chunk = config.train.logprob_chunk
    parts.append(switch(f"output layer in chunks of {chunk}" if chunk > 0 else "chunked output layer", chunk > 0,
                        output_layer_unchunkable(policy) or output_layer_untappable(policy)
                        or (ZERO3_UNTAPPABLE if deepspeed else None)))
    parts.append(switch("vision windows batched", config.train.batched_vision_attention,
                        batched_vision_unsupported(policy)))
    if config.train.fused_kernels:  # opt-in: named only when asked for
        reason = None if computes_fused(policy) else fused_kernels_unsupported(policy)  # patched: checked already
        parts.append(switch("fused kernels", True, reason))
    if mode == "train":
        parts.append(f"decode {decode_mode(policy, config.rollout.decode)}")
    return "; ".join(parts)


@dataclass
class Settled:
    """The memory settings a run trains with: `model.gradient_checkpointing` and
    `train.micro_batch_size`, chosen by the estimate where they were "auto"."""

    micro_batch_size: int
    gradient_checkpointing: bool
    automatic: tuple[str, ...] = ()
    """The keys that were "auto"."""

    def line(self) -> str:
        return (f"auto       {', '.join(self.automatic)}: micro-batch {self.micro_batch_size}, gradient "
                f"checkpointing {'on' if self.gradient_checkpointing else 'off'}")

    def apply(self, config: Config, policy) -> None:
        """Train with these: written into `config`, checkpointing turned on in `policy` if settled so."""
        config.train.micro_batch_size = self.micro_batch_size
        config.model.gradient_checkpointing = self.gradient_checkpointing
        if self.gradient_checkpointing:
            checkpoint_activations(policy)


def micro_batch_candidates(config: Config, mode: str, world: int) -> list[int]:
    """Micro-batch sizes "auto" chooses from, largest first: RL, multiples of the group size up to a
    process's rows per step; SFT, a process's examples per step and the powers of two below."""
    if mode == "train":
        group = config.rollout.group_size
        rows = config.rollout.per_process(world) * group
        return [k * group for k in range(max(rows // group, 1), 0, -1)]
    rows = max(config.sft.batch_size // world, 1)
    return [rows] + [2 ** i for i in range(rows.bit_length() - 1, -1, -1) if 2 ** i < rows]


def settle(config: Config, policy, mode: str, world: int, lengths: tuple[int, int, int],
           costs: ActivationCosts, loaded: int | None, sharding: Sharding = Sharding()) -> tuple[Settled, MemoryEstimate]:
    """The memory settings to train with, and their estimate. `lengths`: the longest prompt, the
    completion and the image tokens. Without a free-memory figure, auto means no checkpointing and
    a micro-batch of about 16 rows."""
    model, train = config.model, config.train
    automatic = tuple(key for key, value in (("model.gradient_checkpointing", model.gradient_checkpointing),
                                              ("train.micro_batch_size", train.micro_batch_size)) if value == "auto")
    micros = micro_batch_candidates(config, mode, world) if train.micro_batch_size == "auto" else [train.micro_batch_size]
    checkpointing = [False, True] if model.gradient_checkpointing == "auto" else [model.gradient_checkpointing]

    @functools.cache
    def estimate(micro: int, recompute: bool) -> MemoryEstimate:  # each option estimated once
        trial = dataclasses.replace(config, model=dataclasses.replace(model, gradient_checkpointing=recompute),
                                    train=dataclasses.replace(train, micro_batch_size=micro))
        return estimate_memory(trial, policy, mode, world, *lengths, costs, loaded, sharding)

    options = [(micro, recompute) for recompute in checkpointing for micro in micros]
    if estimate(*options[0]).fits is None:  # free memory unknown: no checkpointing, about 16 rows
        options = [(next((m for m in micros if m <= 16), micros[-1]), checkpointing[0])]
    chosen = next((option for option in options if estimate(*option).fits), options[-1])  # else the smallest
    return Settled(*chosen, automatic), estimate(*chosen)


def packed_prompts(config: Config, policy, mode: str, world: int) -> int:
    """Distinct prompts in the widest training micro-batch when its groups are packed (packing.py:
    each prompt computed once, its completions after it), 0 when its rows are computed one by one
    (SFT, G = 1, packing off or not supported by the model)."""
    group, micro = config.rollout.group_size, config.train.micro_batch_size
    if mode != "train" or group == 1 or not config.train.pack_groups or packed_passes_unsupported(policy) is not None:
        return 0
    rows = config.rollout.per_process(world) * group
    return max((min(start + micro, rows) - 1) // group - start // group + 1 for start in range(0, rows, micro))


def copies_reference(config: Config, mode: str) -> bool:
    """Whether the run keeps a frozen copy of the policy as its reference (reference.py): RL with a
    KL term, unless the reference is the LoRA policy with its adapter switched off (no refresh)."""
    algo = config.algorithm
    adapter_off = config.model.lora.enabled and algo.ref_refresh_steps == 0
    return mode == "train" and algo.beta > 0 and not adapter_off


def estimate_disk(config: Config, policy, mode: str) -> DiskEstimate:
    """What the run writes at most at one time under config.output_dir (checkpoint.py's layout):
    each step checkpoint holds the weights (the adapter under LoRA), AdamW's two moments of every
    trainable parameter and the reference copy when there is one (`copies_reference`); a checkpoint is
    written beside the kept ones before the oldest is removed; then the final model; rollout logs
    (texts, each prompt's image) and metrics are guessed at a few KB per completion and image."""
    train = config.train
    element = next(policy.parameters()).element_size()
    total = sum(p.numel() for p in policy.parameters()) * element
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad) * element
    lora = config.model.lora.enabled
    reference = total if copies_reference(config, mode) else 0
    saves = -(-train.steps // train.save_every) if train.save_every > 0 else 1  # and one after the last step
    at_once = min(saves, train.keep_checkpoints + 1) if train.keep_checkpoints > 0 else saves
    rows = config.rollout.prompts_per_step * (config.rollout.group_size if mode == "train" else 1)
    logged = train.steps // train.log_rollouts_every if mode == "train" and train.log_rollouts_every > 0 else 0
    logs = logged * (rows * (8 * config.rollout.max_new_tokens + 500) + config.rollout.prompts_per_step * 50_000)
    free, where = free_space(Path(config.output_dir))
    return DiskEstimate(checkpoint=(trainable if lora else total) + 2 * trainable + reference, checkpoints=at_once,
                        final=trainable if lora else total, logs=logs + train.steps * 2_000, free=free, where=where)


def first_batches(config: Config, task: Task, mode: str, world: int, start: int) -> dict[str, list[int]]:
    """Example indices of the first batch of each split the run uses: one process's share of a
    step from `start` for train, the first eval batch of each eval split."""
    per_process = (config.rollout.prompts_per_step if mode == "train" else config.sft.batch_size) // max(world, 1)
    batches = {"train": list(range(start, start + max(per_process, 1)))}
    if config.eval.every > 0:
        for split in config.eval.splits:  # each one the task has (early_checks.py)
            batches[split] = list(range(min(config.eval.n, config.eval.batch_size)))
    return batches


def check_prompts(processor, examples: list[Example], indices: list[int], split: str, limit: int,
                  model_config=None) -> SplitCheck:
    """Encode each example's prompt alone: no special token in the question (the `<image>` and
    `<video>` markers that place its images and videos aside: a family whose image token is `<image>`
    reads them), and within `limit`; count its image tokens (the model config's image token: Gemma 3's
    processor names its BOI) and, of them, its videos' vision tokens."""
    specials = [token.content for token in processor.tokenizer.added_tokens_decoder.values() if token.special]
    best = SplitCheck(split, len(examples), 0, 0, indices[0] if indices else 0)
    for idx, example in zip(indices, examples):
        question = "".join(part["text"] for message in chat_messages(example) for part in message["content"]
                           if part["type"] == "text")  # the `<image>`/`<video>` markers it places are gone
        written = [token for token in specials if token in question]
        if written:
            raise VlmrlError(f"the question of {split} example {idx} contains the special token {written[0]!r}: "
                             "image tokens would no longer match image features; remove it from the data")
        ids, videos = encoded_prompt(processor, example, split, idx)  # (P,), the videos' texts
        n_image, n_video = vision_tokens(processor, ids, model_config, videos)
        check = SplitCheck(split, len(examples), len(ids), n_image + n_video, idx, n_video)
        if problem := length_problem(processor, ids, limit, model_config, videos):
            raise VlmrlError(f"the prompt of {split} example {idx} {problem}; image and video tokens are never "
                             "truncated: use smaller images (the task's max_pixels or max_image_side, or the "
                             "processor's max_pixels), fewer or smaller video frames, or raise "
                             "rollout.max_prompt_length")
        if len(ids) > best.longest:
            best = check
    return best


def encoded_prompt(processor, example: Example, split: str, idx: int) -> tuple[torch.Tensor, list[str]]:
    """The prompt's token ids (P,) and the text its processor wrote for each video (the family's own
    replacement of a video placeholder: its vision tokens are the video's, whichever token it uses,
    SmolVLM's frames being image tokens); the processor's own error in one line, with where it happened."""
    try:
        if not example.videos:
            return encode_prompts(processor, [example], torch.device("cpu"))["input_ids"][0], []
        batch = processor(text=[prompt_text(processor, example)], return_tensors="pt",
                          return_text_replacement_offsets=True, **processor_inputs(processor, [example]))
        return batch["input_ids"][0], [part["replacement"] for part in batch["text_replacement_offsets"][0]
                                       if part["type"] == "video"]
    except VlmrlError:
        raise
    except Exception as error:  # noqa: BLE001 - the processor's own message, with where it happened
        media = [f"image {image.width}x{image.height} {image.mode}" for image in example.images]
        media += [f"video of {len(v.frames)} frames {v.frames[0].width}x{v.frames[0].height}" for v in example.videos]
        raise VlmrlError(f"the processor cannot encode {split} example {idx} ({', '.join(media) or 'no image'}): "
                         f"{type(error).__name__}: {error}") from error


def generation_memory(config: Config, policy, mode: str, world: int, lengths: tuple[int, int]) -> tuple[int, int]:
    """Bytes of the largest generate call (its KV cache and one step's logits: rollouts, or
    evaluation) and of the KV cache the decode path keeps into the training phase, for prompts and
    completions of `lengths` tokens."""
    prompt, completion = lengths
    text = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
    size = next(policy.parameters()).element_size()
    static = decode_mode(policy, config.rollout.decode) != "dynamic"  # its cache length is rounded up

    def generate_bytes(rows: int, new_tokens: int) -> int:
        length = cache_length(prompt + new_tokens) if static else prompt + new_tokens
        logits = rows * text.vocab_size * (size + 8)  # one step's logits, a float copy and the sampling probabilities
        return kv_cache_bytes(policy, rows, length) + logits

    generation = kept_cache = 0
    if mode == "train":
        rows = config.rollout.per_call(world) * config.rollout.group_size
        generation = generate_bytes(rows, completion)
        kept_cache = kept_cache_bytes(policy, config.rollout.decode, rows, prompt + completion)
    if config.eval.every > 0:
        generation = max(generation, generate_bytes(config.eval.batch_size,
                                                    config.eval.max_new_tokens or config.rollout.max_new_tokens))
    return generation, kept_cache


def estimate_memory(config: Config, policy, mode: str, world: int, prompt: int, completion: int,
                    image_tokens: int, costs: ActivationCosts, loaded: int | None = None,
                    sharding: Sharding = Sharding()) -> MemoryEstimate:
    """A per-process peak for the configured batch sizes, G and lengths (see MemoryEstimate): the
    activations from `costs` (measured on the model) for the tokens and images a micro-batch's
    forward computes, packed or not. Checkpointing "auto" counts as off (`settle` decides it).
    `sharding.parts` > 1 (FSDP2, ZeRO-3): weights, gradients, AdamW and the reference divided over the
    processes, the weights gathered whole for generation and unit by unit for training added
    (`gathered_units`). Under ZeRO-3 the reference copy stays whole, DeepSpeed keeps an fp32 copy of
    each partition for AdamW, and log-probs come from whole logits (training/zero3.py)."""
    shards = sharding.parts
    params = list(policy.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    gradients = trainable_bytes(config, policy, mode)
    frozen_vision = mode == "train" and config.model.vision_lr_scale == 0
    copy_reference = copies_reference(config, mode)
    teacher = teacher_weight_bytes(config, params[0].element_size()) if mode == "train" else 0
    text = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
    layers, vocab, heads = text.num_hidden_layers, text.vocab_size, text.num_attention_heads
    size = params[0].element_size()  # bytes per activation value (the compute dtype)

    generation, kept_cache = generation_memory(config, policy, mode, world, (prompt, completion))

    micro = config.train.micro_batch_size
    packs = packed_prompts(config, policy, mode, world)
    images = packs or micro  # packed (packing.py): each prompt and its image once, its completions after it
    tokens = images * prompt + micro * completion
    if frozen_vision or config.model.freeze_vision:
        images = 0  # the tower keeps nothing for backward
    positions = micro * completion
    if config.train.logprob_chunk > 0 and output_layer_unchunkable(policy) is None and not sharding.deepspeed:
        positions = min(positions, config.train.logprob_chunk)  # one chunk of the output layer at a time
    held, last = embedding_gradients(policy)
    activations = max(last, costs.peak(tokens, images * image_tokens, config.model.gradient_checkpointing is True,
                                       readout=positions * vocab * LOGIT_BYTES, held=held))
    if packs and config.train.block_attention and block_attention_unsupported(policy) is None:
        # block_attention.py: each segment's call reads its own copy of its prompt's keys and values,
        # kept in every layer (under checkpointing, in the one recomputed)
        copies = 1 if config.model.gradient_checkpointing is True else layers
        activations += kv_cache_bytes(policy, micro, prompt) // layers * copies
    attention = getattr(policy.config, "_attn_implementation", None) or config.model.attn_implementation
    if attention == "eager":  # the (L, L) attention weights of every head are kept too
        length = tokens // (packs or micro)
        activations += layers * (packs or micro) * heads * length * length * size * 2

    device = next(iter(params)).device
    part = weights // shards
    master = 4 * sum(p.numel() for p in params if p.requires_grad) // shards if sharding.deepspeed else 0
    whole = config.rollout.fsdp_generation == "whole" or sharding.deepspeed
    return MemoryEstimate(
        device=str(device), weights=part, gradients=gradients // shards, optimizer=2 * gradients // shards + master,
        reference=(weights if sharding.deepspeed else part) if copy_reference else 0, generation=generation,
        activations=activations, loaded=part if loaded is None else loaded, free=free_memory(device),
        sharers=world if device.type == "cpu" else 1, kept_cache=kept_cache, shards=shards, deepspeed=sharding.deepspeed,
        gathered_generation=((weights - part if whole
                              else gathered_units(policy) * (shards - 1) // shards) if shards > 1 else 0),
        gathered_training=gathered_units(policy) * (shards - 1) // shards if shards > 1 else 0,
        whole_generation=whole, teacher=teacher if sharding.deepspeed else teacher // shards,
        tool_models=tool_model_bytes(config.rollout.tools, config.rollout.tool_models))


def trainable_bytes(config: Config, policy, mode: str) -> int:
    """Bytes of the parameters the run updates (`trainable_count`'s): their gradients, and each of
    AdamW's two moments (kept in the parameter's dtype)."""
    frozen_vision = mode == "train" and config.model.vision_lr_scale == 0
    return sum(p.numel() * p.element_size() for name, p in policy.named_parameters()
               if p.requires_grad and not (frozen_vision and is_vision_parameter(name)))


@dataclass(frozen=True)
class CheckpointPlan:
    """Where the run writes its checkpoints: in the background (train.background_checkpoints, from a
    host copy) or on the step's path, and the figures that decided it."""

    background: bool
    """What the run does: write from a host copy on a thread (True), or on the step's path."""
    asked: bool
    """train.background_checkpoints as configured."""
    copy: int
    """Bytes of the host copy of one checkpoint on the main process: the whole weights as saved,
    AdamW's moments and the reference copy when the run keeps one (a sharded run's gathered whole)."""
    available: int | None
    """The host's available RAM when the preflight read it (None: unknown)."""
    run: int = 0
    """Of that RAM, what the run itself still takes at its peak (a CPU device, every process): the
    copy is alive through the next step's training."""

    @property
    def room(self) -> int | None:
        """RAM the copy may take: the available less the run's part, a tenth of it kept spare."""
        return None if self.available is None else max(0, int(self.available * (1 - HEADROOM)) - self.run)

    def line(self) -> str:
        if not self.asked:
            return "written on the step's path (train.background_checkpoints=false)"
        beside = f" beside the run's {gib(self.run)}" if self.run else ""
        if self.available is None:
            return f"written in the background (host copy {gib(self.copy)}; available host memory unknown)"
        if self.background:
            return f"written in the background (host copy {gib(self.copy)} of {gib(self.available)} available{beside})"
        return (f"written on the step's path, not in the background: their host copy ({gib(self.copy)}) does not fit "
                f"in the {gib(self.available)} available{beside} ({HEADROOM:.0%} kept spare)")

    def apply(self, config: Config) -> None:
        """Train with this: written into config.train.background_checkpoints."""
        config.train.background_checkpoints = self.background


def checkpoint_plan(config: Config, policy, mode: str, memory: MemoryEstimate,
                    sharding: Sharding = Sharding()) -> CheckpointPlan:
    """Where checkpoints are written: in the background when asked and its host copy fits in the
    host's available RAM beside the run, with HEADROOM spare; else on the step's path (as with
    train.background_checkpoints=false: the same files, only not overlapped). The copy is the main
    process's (only it writes), whole: the weights `save_pretrained` gets (a LoRA adapter's alone,
    training/session.py `own_weights`; a sharded run gathers the whole model, its base included),
    AdamW's two moments of each trained parameter (float32 under ZeRO-3, whose full state comes from
    its fp32 partitions), the reference copy where the run saves one. On a CPU device the run lives
    in the same RAM: what it still takes at its peak (`MemoryEstimate.needed`, over every process) is
    set against the same reading. On a GPU the host's RAM is read here (`host_available`)."""
    adapter = hasattr(policy, "peft_config") and sharding.parts == 1
    weights = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad or not adapter)
    trained = trainable_bytes(config, policy, mode)
    moments = 2 * (4 * trained // next(policy.parameters()).element_size() if sharding.deepspeed else trained)
    whole = sum(p.numel() * p.element_size() for p in policy.parameters())
    copy = weights + moments + (whole if copies_reference(config, mode) else 0)
    on_host = memory.device.startswith("cpu")
    available = memory.free if on_host else host_available()
    plan = CheckpointPlan(background=config.train.background_checkpoints, asked=config.train.background_checkpoints,
                          copy=copy, available=available, run=memory.needed if on_host else 0)
    if plan.asked and plan.room is not None and copy > plan.room:
        plan = dataclasses.replace(plan, background=False)
    return plan


def gathered_units(policy) -> int:
    """Bytes of the FSDP2 units gathered at once in training: the root (embeddings, output layer,
    norms, merger: kept gathered from its forward through its backward), the block computing and the
    next one prefetched. The blocks are the model's `_no_split_modules` (training/sharding.py)."""
    names = set(getattr(hf_model(policy), "_no_split_modules", None) or ())
    blocks = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in policy.modules()
              if type(m).__name__ in names]
    total = sum(p.numel() * p.element_size() for p in policy.parameters())
    return total - sum(blocks) + 2 * max(blocks, default=0)


def free_memory(device: torch.device) -> int | None:
    """Free bytes on `device`: torch.cuda.mem_get_info on a GPU, available RAM on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available()


def host_available() -> int | None:
    """The host's available RAM in bytes (psutil's `available`: free plus what the kernel can
    reclaim), None when unknown; shared by every process of the machine."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def run_preflight(session, task: Task, mode: str) -> PreflightReport:
    """The preflight of a training session: prints the report (main process), warns when the run
    will not fit in memory, raises VlmrlError on a batch that would crash it."""
    config = session.config
    if mode == "train":
        per_process = config.rollout.prompts_per_step // session.world
        start = session.cursor + session.rank * per_process
    else:
        per_process = config.sft.batch_size // session.world
        start = session.start_step * config.sft.batch_size + session.rank * per_process
    loaded = sum(local_bytes(p) for p in session.policy.parameters())
    for frozen in (getattr(session.reference, "copy", None), getattr(getattr(session, "teacher", None), "model", None)):
        if frozen is not None:  # the reference copy, the teacher
            loaded += sum(local_bytes(p) for p in frozen.parameters())
    sharding = Sharding(session.world if session.strategy.sharded else 1, session.strategy.deepspeed)
    with session.gathered():  # a sharded policy whole for the measuring forwards and self-checks
        report = preflight(config, session.policy, session.processor, task, mode, session.world, start, loaded,
                           sharding)
    if session.world > 1:  # every process trains with the main process's choice
        from accelerate.utils import broadcast_object_list

        report.settled, report.checkpoints = broadcast_object_list([report.settled, report.checkpoints])
    report.settled.apply(config, session.policy)
    report.checkpoints.apply(config)
    report.processes = session.strategy.line()
    if session.main:
        for line in report.lines():
            print(f"preflight: {line}", flush=True)
        if mode == "train":
            print(f"preflight: rewards    {describe(build_rewards(config.rewards, task), config.algorithm.reward_aggregation)}",
                  flush=True)
        for advice in report.advice():
            warn(advice)
    return report


def local_bytes(parameter: torch.Tensor) -> int:
    """Bytes of this process's part of a parameter (all of it unless FSDP2 or ZeRO-3 splits it)."""
    part = parameter.to_local() if hasattr(parameter, "to_local") else getattr(parameter, "ds_tensor", parameter)
    return part.numel() * part.element_size()


def memory_advice(memory: MemoryEstimate) -> str:
    generating = memory.weights + memory.gathered_generation  # the model as generation gathers it
    if memory.shards > 1 and memory.free is not None and generating > memory.free * (1 - HEADROOM):
        if memory.deepspeed:
            return (f"this model cannot generate here gathered whole: ZeRO-3 gathers it ({gib(generating)}) on each "
                    f"device for every generate call, more than the {gib(memory.free)} free on {memory.device} "
                    f"({HEADROOM:.0%} of it kept spare): shard with FSDP2 (configs/accelerate/fsdp2.yaml) and "
                    "rollout.fsdp_generation=layers (one block at a time)")
        if memory.whole_generation:
            return (f"this model cannot generate here gathered whole: FSDP2 gathers it ({gib(generating)}) on each "
                    f"device for every generate call, more than the {gib(memory.free)} free on {memory.device} "
                    f"({HEADROOM:.0%} of it kept spare): set rollout.fsdp_generation=layers (one block at a time)")
        return (f"this model cannot generate here even layer by layer: its root unit and two blocks "
                f"({gib(generating)}) exceed the {gib(memory.free)} free on {memory.device} ({HEADROOM:.0%} of it "
                "kept spare), however many processes share it; vlmrl has no tensor-parallel generation")
    kept = (f", decode with rollout.decode=static (the compiled path keeps its {gib(memory.kept_cache)} KV cache "
            "through the training phase)") if memory.kept_cache else ""
    return (f"this run may not fit: it needs about {gib(memory.needed)} more on {memory.device}, which has "
            f"{gib(memory.free or 0)} free ({HEADROOM:.0%} of it kept spare). Lower train.micro_batch_size or "
            "rollout.generation_batch_size, turn on model.gradient_checkpointing, train a LoRA adapter "
            f"(model.lora.enabled=true){kept}")


def check(config: Config, mode: str = "train", processes: int = 1, strategy: str = "DDP") -> PreflightReport:
    """`vlmrl check`: load the model and task as a run would (no checkpoint) and run the preflight
    alone, in this one process, as the first of `processes` would under `strategy` (DDP, FSDP2 or
    ZeRO-3: its share of the batch, and under FSDP2 and ZeRO-3 its share of the parameters)."""
    if processes < 1:
        raise VlmrlError(f"--processes must be >= 1; got {processes}")
    task = check_before_loading(config, mode)
    (config.rollout if mode == "train" else config.sft).check_layout(processes)
    policy, processor = load_trainable_policy(config, resolve_device(config.model.device), None)
    sharding = Sharding(processes if strategy in ("FSDP2", "ZeRO-3") else 1, strategy == "ZeRO-3")
    report = preflight(config, policy, processor, task, mode, processes, sharding=sharding)
    if processes > 1:
        report.processes = f"processes: {processes}, strategy: {strategy} (planned: vlmrl check runs one)"
    return report
