"""Run configuration: nested dataclasses, read from YAML, overridden from the command line.

Every field has a docstring (the string under it), which `vlmrl config --docs` prints. A config
file sets any subset of fields; `section.field=value` arguments override it
(`vlmrl train configs/x.yaml train.lr=1e-6`). Values are read and checked by the rule of
`vlmrl.fields`, the same one task parameters follow. An unknown key is an error naming the closest
valid keys (or the new name of a renamed key, RENAMED_KEYS), and a value of the wrong type is an
error naming the field and the type.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vlmrl.disk import write_text
from vlmrl.errors import VlmrlError, one_line, require
from vlmrl.fields import (Naming, Range, StrictLoader, all_keys, build, check_ranges, field_docs,  # noqa: F401
                          path_field, ranged, read_text, shown)  # (also public names of this module)
from vlmrl.imports import resolve_file
from vlmrl.rewards.http import check_settings, is_url, saved_settings
from vlmrl.rewards.judge import check_judge, is_judge, saved_judge
from vlmrl.urls import redact

TOOL_IMAGE_SIDES = (28, 1024)
"""Smallest and largest `tool_image_side` (rollout.tool_image_side, `vlmrl eval --tool-image-side`):
28 pixels is one merged vision patch of Qwen2-VL-style models (a zoom smaller than that shows
nothing); 1024 x 1024 is the most pixels a tool may return (tools/contract.py ToolLimits), so a larger
side only builds an image to refuse (a side of 100000 made the zoom draw 114 megapixels first)."""


def tool_image_side_rule(name: str, side: int) -> str:
    """The one-line complaint about a tool image side (given as `name`) out of TOOL_IMAGE_SIDES."""
    low, high = TOOL_IMAGE_SIDES
    return (f"{name} must be in [{low}, {high}] pixels (the longest side of a zoomed image; a tool returns "
            f"at most {high} x {high} pixels); got {side}")


TEMPERATURES = (1e-3, 100.0)
"""Smallest and largest sampling temperature (0 = greedy apart). Sampling divides the logits by it in
float32: at 1e-300 they overflow to inf and the softmax is NaN ('probability tensor contains inf or
nan'); at inf every logit is 0 or NaN. Below 1e-3 sampling is greedy in all but name (use 0 where
that is allowed), above 100 it is uniform over the vocabulary to within a few percent."""


def temperature_rule(name: str, temperature: float, greedy: bool) -> tuple[bool, str]:
    """(whether `temperature`, given as `name`, is allowed, the one-line complaint when not): in
    TEMPERATURES, or 0 where `greedy` decoding is allowed."""
    low, high = TEMPERATURES
    allowed = low <= temperature <= high or (greedy and temperature == 0)  # NaN fails both
    zero = "0 (greedy) or " if greedy else ""
    return allowed, (f"{name} must be {zero}in [{low:g}, {high:g}] (sampling divides the logits by it: smaller "
                     f"overflows float32, larger samples the vocabulary uniformly); got {temperature}")


# --------------------------------------------------------------------------- upper bounds
# Each number a run sizes its work, memory or waiting by has an upper bound far above any real run,
# so that a typo (an extra digit, or twenty) is one line when the config is read rather than a hang,
# an overflow deep in torch, or a preflight walking 10**20 micro-batches (a 20-digit
# rollout.group_size hung it, deaf to SIGTERM). The reason for each bound is under it.

MAX_GROUP_SIZE = 4096
"""Most completions per prompt (rollout.group_size, `vlmrl eval --k`): published GRPO groups hold 4
to 64 completions and pass@k curves stop at a few hundred samples; a group is generated together."""
MAX_ROWS = 2 ** 20
"""Most completions a step samples (rollout.prompts_per_step x group_size), SFT examples per step
(sft.batch_size), rows per micro-batch or per generate call: 1,048,576, some thirty times the largest
RL steps published (512 prompts x 64); a step holds all its rows at once."""
MAX_TOKENS = 2 ** 20
"""Most tokens of a prompt, a completion or a tool trajectory (max_prompt_length, max_new_tokens,
max_trajectory_tokens): 1,048,576, the longest context of any image-text model; once the model is
loaded the preflight holds completions to its own context (`context_length`)."""
MAX_PREFETCH = 64
"""Most generate calls prepared ahead (train.prefetch_batches): one or two hide the data phase when
it is shorter than a step's model work; each call ahead holds its images and tensors in memory."""
MAX_TURNS = 1024
"""Most model turns of a tool trajectory (rollout.max_turns, `vlmrl eval --max-turns`): agentic
rollouts take a few to a few dozen turns, each one a generate call."""
MAX_TOOL_TIMEOUT_S = 3600
"""Longest a call of your own tool may run (rollout.tool_timeout_s): an hour, while every rollout of
the step waits for it; the worker's wait overflows past about 10**8 seconds."""
MAX_REWARD_TIMEOUT_S = 3600
"""Longest a call of a reward function of your own may run (rewards[].timeout_s): an hour, while the step
waits for it; the worker's wait overflows past about 10**8 seconds (rewards/contain.py MAX_TIMEOUT_S)."""
MAX_LORA_RANK = 16384
"""Largest LoRA rank (model.lora.r): the widest language models have a hidden size of 16,384 or
less, and a rank equal to the hidden size is already a full-rank update."""
MAX_UPDATES_PER_BATCH = 1000
"""Most optimisation passes over one rollout batch (algorithm.updates_per_batch): PPO-style reuse
takes 1 to 4; long before 1000 the clipped ratios stop every token's gradient."""
MAX_SAMPLING_ROUNDS = 1000
"""Most generation rounds per step under dynamic sampling (algorithm.max_sampling_rounds): DAPO
uses a handful; every round is a full generation pass."""
MAX_EVAL_EXAMPLES = 1_000_000
"""Most held-out examples per split (eval.n, `vlmrl eval --n`): all are made before the first is
answered; the same limit as `vlmrl data geometry --n`."""


# --------------------------------------------------------------------------- float ranges
# Every float field is declared with the range of what it is used as (`ranged`, checked by
# fields.build when the config is read, one line naming the key and the range): far beyond any real
# run, and inside what float32 holds once the value is multiplied, divided or exponentiated by the
# loss (sapo_tau_pos 1e300 was an OverflowError, sapo_tau_neg 1e-300 and distill_weight 1e300
# trained on inf/NaN). The reason for each is in its `why`.

FRACTION = Range(0.0, 1.0, "a share or probability")
SCALE = Range(0.0, 1000.0, "a multiple of another quantity: past 1000 the loss or update it scales no longer "
                           "stays finite in float32 for every value it multiplies")
REWARD_WEIGHT = Range(-1000.0, 1000.0, "weights are relative: past 1000 to 1 a weighted sum of rewards may leave "
                                      "float32")
SAPO_TAU = Range(0.01, 100.0, "the gate's width is 1/tau: beyond these it is a hard clip or no gate, and 4/tau "
                              "and tau (ratio - 1) must stay finite in float32")
TIS_CAP = Range(0.0, 10000.0, "a cap on a probability ratio: past 10,000 it truncates nothing, 0 = off")
LOG_RATIO = Range(0.0, 100.0, "a log-ratio in nats: past 100 it masks nothing (exp(100) overflows float32 ratios)")
LEARNING_RATE = Range(0.0, 1.0, "an AdamW step moves each weight by about lr: past 1 it is no longer a learning rate")
GRAD_NORM = Range(0.0, 1e6, "a clip on the gradient norm: past 10**6 it clips nothing, 0 = no clipping")
TIMEOUT_S = Range(0.0, float(MAX_TOOL_TIMEOUT_S), "seconds a call may take: at most an hour")


SEEDS = 2 ** 32
"""Seeds are in [0, SEEDS): numpy's range (the run's seed seeds numpy, torch and Python's random)."""


def seed_rule(name: str, seed: int) -> tuple[bool, str]:
    """The rule "seed `name` is in [0, 2**32)" for `require` (the run's seed, `vlmrl tiny-model --seed`)."""
    return 0 <= seed < SEEDS, f"{name} must be in [0, 2**32) (numpy's range); got {seed}"


def at_most(key: str, value: float, bound: float) -> tuple[bool, str]:
    """The rule "`key` is at most `bound`" for `require`, with its one-line message (the reason for
    each bound is in its docstring)."""
    return value <= bound, f"{key} must be at most {bound:,}; got {value}"


RENAMED_KEYS: dict[str, str] = {
    "rollout.shared_prefill": "rollout.share_prompt_cache",
    "train.shared_prefix": "train.pack_groups",
    "algorithm.cubic_shaping": "algorithm.advantage_shaping",
}
"""Old dotted key -> its new name: a config that still uses an old key gets an error saying so."""

DEVICES = re.compile(r"auto|cpu(:\d+)?|mps|cuda(:\d+)?")
"""What a device setting may name (model.device, `--device`): auto (a GPU when present), cpu, mps,
cuda or cuda:N (and cpu:N, the name torch gives a CPU process of a launch); whether this machine has
it is checked where torch is at hand (loading.resolve_device)."""


def device_rule(name: str, device: str) -> tuple[bool, str]:
    """The rule "setting `name` names a device" (DEVICES) for `require`."""
    return DEVICES.fullmatch(device) is not None, f"{name} must be auto, cpu, mps, cuda or cuda:N; got {device!r}"


ATTENTION_KERNELS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""Values of model.attn_implementation transformers knows by name (a hub kernel "org/name" too)."""


@dataclass
class LoraConfig:
    """LoRA adapter (peft) on the language model."""

    enabled: bool = False
    """Train a LoRA adapter instead of the full model."""
    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = ranged(0.05, FRACTION)
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names (suffixes) that get an adapter."""
    include_vision: bool = False
    """Also put adapters in the vision tower (left out by default)."""

    def validate(self) -> None:
        require((self.r >= 1 and self.alpha >= 1, f"model.lora.r and alpha must be >= 1; got r={self.r}, alpha={self.alpha}"),
                at_most("model.lora.r", self.r, MAX_LORA_RANK),
                (math.isfinite(self.dropout) and 0 <= self.dropout < 1, f"model.lora.dropout must be in [0, 1); got {self.dropout}"),
                (bool(self.target_modules) and all(self.target_modules),
                 f"model.lora.target_modules must name at least one module; got {self.target_modules}"))


@dataclass
class ModelConfig:
    """The policy model and how it is loaded."""

    name_or_path: str = path_field("runs/tiny-model")
    """Local folder or hub id of an image-text-to-text model (the hub only when online)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; auto is bfloat16 on GPU, float32 on CPU."""
    device: str = "auto"
    """cpu, cuda, cuda:1, or auto (a GPU when present). Under accelerate, each process's own GPU."""
    attn_implementation: str | None = None
    """Attention kernel (eager, sdpa, flash_attention_2); None is the model's default."""
    trust_remote_code: bool = False
    """Run Python code shipped with the model. Off unless you trust the source."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in backward to save memory (about a third more compute): true, false,
    or auto = on only when the preflight's memory estimate says the activations would not fit."""
    freeze_vision: bool = False
    """Keep the vision tower's weights fixed."""
    vision_lr_scale: float = ranged(1.0, SCALE)
    """Vision-tower learning rate as a multiple of train.lr (0.1 = ten times slower)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter settings."""

    def validate(self) -> None:
        kernel = self.attn_implementation
        require((bool(self.name_or_path.strip()), "model.name_or_path is empty"),
                device_rule("model.device", self.device),
                (kernel is None or kernel in ATTENTION_KERNELS or "/" in kernel,
                 f"model.attn_implementation must be one of {', '.join(ATTENTION_KERNELS)} (or a hub kernel "
                 f"org/name); got {kernel!r}"),
                (math.isfinite(self.vision_lr_scale) and self.vision_lr_scale >= 0,
                 f"model.vision_lr_scale must be >= 0; got {self.vision_lr_scale}"))


@dataclass
class TaskConfig:
    """The task to train and evaluate on."""

    name: str = "shapes"
    """Registered task name (see `vlmrl tasks list`)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Task parameters, passed to get_task (see `vlmrl tasks list`)."""

    def validate(self) -> None:
        require((bool(self.name.strip()), "task.name is empty (see `vlmrl tasks list`)"))


@dataclass
class RewardConfig:
    """One reward of the `rewards` list (docs/rewards.md): a function called once per batch the way
    TRL calls its reward functions, returning one number (or None: does not apply) per completion.
    From Python it is `vlmrl.Reward`, whose `name` may be the function itself: `vlmrl.Reward(fn,
    weight=2, label="accuracy")` (reward_entry keeps it as its import path)."""

    name: str = ""
    """A built-in reward (accuracy, math, number, choice, exact, iou, edit_similarity, format, length),
    `task` (the task's own score), `package.module:function`, `path/to/file.py:function` (relative to
    the config file's folder), an `http(s)://` reward service or `judge` (a chat model grades each completion)."""
    weight: float = ranged(1.0, REWARD_WEIGHT)
    """Its weight in the total reward (0: logged, not trained on)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the function (for a service: timeout_s, retries, backoff_s, headers; for
    `judge`: its settings, docs/rewards.md)."""
    label: str = ""
    """The name it is logged under (reward/<label>); default: the built-in's or the function's name."""
    timeout_s: float | None = None
    """Seconds one call (a batch) of a function of your own may run before the run stops with a checkpoint
    (default 120); not for a built-in or `task` (they run untimed), nor a service (its kwargs: timeout_s)."""

    def validate(self) -> None:
        require((bool(self.name.strip()), "a reward needs a name (a built-in, module:function, file.py:function or "
                                          "URL; see docs/rewards.md)"),
                (math.isfinite(self.weight), f"reward {redact(self.name)}: weight must be finite; got {self.weight}"))
        check_ranges(self, Naming(label=f"reward {redact(self.name)}: {{key}}"))  # also one built in Python
        if self.timeout_s is not None:
            require((self.timeout_s > 0, f"reward {redact(self.name)}: timeout_s must be > 0; got {self.timeout_s}"),
                    at_most(f"reward {redact(self.name)}: timeout_s", self.timeout_s, MAX_REWARD_TIMEOUT_S))
        if is_url(self.name):  # a service's settings are checked here, when the config is read
            check_settings(self.name, self.kwargs)
        if is_judge(self.name):  # and a judge's
            check_judge(self.kwargs)

    def __repr__(self) -> str:  # a service's URL and header secrets redacted (a notebook, an error line)
        kwargs = (saved_settings(self.kwargs) if is_url(self.name) else saved_judge(self.kwargs) if is_judge(self.name)
                  else self.kwargs)
        return (f"RewardConfig(name={redact(self.name) if is_url(self.name) else self.name!r}, weight={self.weight!r}, "
                f"kwargs={kwargs!r}, label={self.label!r}, timeout_s={self.timeout_s!r})")


def reward_entry(entry: Any, key: str) -> RewardConfig:
    """One entry of `rewards` as a RewardConfig: a name, a mapping, a RewardConfig (`vlmrl.Reward`), or
    (from Python) a function. A function, alone or as the `name` of a mapping or a RewardConfig (which
    then give its weight, kwargs and label), is kept as its import path `module:function` (one defined
    in a notebook or script is `__main__:function`), so the saved config.yaml names it."""
    if isinstance(entry, str):
        entry = RewardConfig(name=entry)
    elif isinstance(entry, dict):
        named = entry.get("name")
        if callable(named):
            entry = entry | {"name": function_path(named, key)}
        entry = build(RewardConfig, entry, _NAMING, prefix=key + ".")
    elif isinstance(entry, RewardConfig):
        if callable(entry.name):
            entry = dataclasses.replace(entry, name=function_path(entry.name, key))
        entry = build(RewardConfig, dataclasses.asdict(entry), _NAMING, prefix=key + ".")  # its types checked
    elif callable(entry):
        entry = RewardConfig(name=function_path(entry, key))
    require((isinstance(entry, RewardConfig),
             f"{key} must be a reward name, a mapping with name/weight/kwargs/label, a vlmrl.Reward or a function; "
             f"got {shown(entry)}"))
    entry.validate()
    return entry


def function_path(fn: Any, key: str) -> str:
    """The import path `module:function` of a reward function given from Python."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    require((bool(module) and name.isidentifier(),
             f"{key}: a reward function given from Python must be defined at the top level of a module (its "
             f"import path is saved with the run); got {fn!r}"))
    return f"{module}:{name}"


DECODES = ("auto", "dynamic", "static", "compiled")
"""The values of `decode` (decoding.py)."""


@dataclass
class GenerationSettings:
    """How one generate call samples completions: rollouts, evaluation, attention maps."""

    group_size: int = 8
    """Completions sampled per prompt (G); advantages compare completions of one prompt."""
    max_new_tokens: int = 64
    """Longest completion; a completion that reaches it without EOS is truncated."""
    temperature: float = ranged(1.0, Range(0.0, TEMPERATURES[1], "sampling divides the logits by it"))
    """Sampling temperature (log-probs for the loss use the same temperature); 0 = greedy, for
    evaluation only (training needs samples)."""
    top_p: float = ranged(1.0, FRACTION)
    """Nucleus sampling threshold (1.0 = off)."""
    share_prompt_cache: bool = True
    """Encode each image and prefill each prompt once per group, then let its G samples continue
    from copies of that KV cache (same sampling distribution). False repeats every prompt G times in
    generation, as TRL does (for comparison). Model families not checked for it always repeat."""
    decode: str = "auto"
    """How generation decodes (decoding.py): "dynamic" (a growing KV cache, eager), "static" (a KV
    cache allocated once), "compiled" (static, and the decode step compiled: CUDA graphs on a GPU);
    "auto" = compiled on CUDA (a tool rollout's later turns, whose shapes change every turn: dynamic),
    dynamic elsewhere. All give the same tokens; the first compiled call per shape pays the
    compilation, and the compiled path keeps its cache allocated between steps (the preflight counts
    it). A run's evaluations decode the same way."""
    max_prompt_length: int | None = None
    """Longest prompt in tokens, image and video tokens included: a batch holding a longer one raises
    `PromptTooLong` and nothing is generated (rollout/prompts.py; the trainer then treats the row as
    bad, safety/bad_rows.py); None: no limit. Rollouts take rollout.max_prompt_length below."""

    def validate(self) -> None:
        require((self.decode in DECODES, f"decode must be one of {', '.join(DECODES)}, got {self.decode!r}"),
                (self.group_size >= 1 and self.max_new_tokens >= 1,
                 f"group_size and max_new_tokens must be >= 1; got {self.group_size}, {self.max_new_tokens}"),
                temperature_rule("temperature", self.temperature, greedy=True),
                at_most("group_size", self.group_size, MAX_GROUP_SIZE),
                at_most("max_new_tokens", self.max_new_tokens, MAX_TOKENS),
                (math.isfinite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1]; got {self.top_p}"))


@dataclass
class RolloutConfig(GenerationSettings):
    """How completions are sampled each step (the generation settings above, and the batch)."""

    prompts_per_step: int = 8
    """Prompts (images + questions) per optimizer step, over all processes."""
    max_prompt_length: int = 4096
    """Longest prompt in tokens, image and video tokens included. Checked before step 1 on the first
    batch of every split the run uses (`vlmrl check` shows the longest); a longer prompt stops the run
    there, since image tokens are never truncated (fewer image tokens than image features is the
    classic crash). A longer prompt met later (a train row, a held-out row) is a bad row
    (task.params.on_bad_row: stop with a checkpoint, or skip it). Lower the image resolution rather
    than raising this blindly."""
    generation_batch_size: int = 8
    """Prompts per generate call, at most one process's share of prompts_per_step, which it must
    divide. Each call is seeded from (seed, step, first prompt), so samples do not depend on the
    number of processes as long as this size is the same."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call during a rollout: built-in zoom (alias crop), zoom_window, frames,
    find_objects and measure (OpenCV: regions by colour and shape, their boxes, areas, distances), the model
    tools detect, segment, depth and keypoints (their models named in tool_models), or your own function
    as `package.module:function` (see vlmrl/tools/registry.py). [] = single-turn rollouts."""
    tool_models: dict[str, str] = field(default_factory=dict)
    """Model tools' checkpoints: {detect: PATH} makes `detect` (open-vocabulary detection: OWLv2, OWL-ViT,
    Grounding DINO), {segment: PATH} `segment` (SAM, SAM-HQ masks), {depth: PATH} `depth` (Depth Anything, DPT
    relative depth), {keypoints: PATH} `keypoints` (ViTPose body keypoints, SuperPoint interest points) a tool
    rollout.tools may name. PATH is a local folder or a hub id already in the local hub cache (never
    downloaded); checked before step 1, loaded once per process at the first call, on the run's device
    (docs/tools.md, "Model tools"). `vlmrl tiny-model OUT --tool NAME` builds a tiny one."""
    max_turns: int = 4
    """With tools: most model turns per trajectory (a call in the last one is not run)."""
    max_trajectory_tokens: int = 1024
    """With tools: most tokens after the prompt per trajectory, the model's and the tools' results
    (image tokens included); each model turn is also capped at max_new_tokens."""
    tool_timeout_s: float = ranged(5.0, TIMEOUT_S)
    """With tools: a call of your own tool still running after this many seconds is stopped (its worker
    process killed and replaced) and answers with an error; the built-in tools are not timed."""
    tool_image_side: int = 448
    """With tools: longest side in pixels of an image a built-in tool returns (a zoomed crop is
    resized to it, small crops enlarged), 28 to 1024. Each returned image costs image tokens of the
    budget."""
    fsdp_generation: str = "whole"
    """Under FSDP2 (docs/processes.md), how rollouts and evaluations gather the sharded model:
    "whole" (once per generate call, then each process generates alone: fast, but the model's
    weights must fit one device) or "layers" (each block gathered for each forward, at every decode
    step: one all-gather per block per token, and every process steps until all finish, for a model
    whose weights do not fit one device). Evaluations then run on every process."""
    ahead: int = 0
    """Rollouts one step ahead (docs/speed.md): 0 = each step trains on rollouts of its own weights
    (synchronous); 1 = step k trains on rollouts made with the weights of step k-1, so generating the
    next step's rollouts can overlap the update (rollout.generators); the lag is logged
    (rollout/lag_steps) and corrected by the importance weights against the sampler (algorithm.tis_*)."""
    generators: int = 0
    """With rollout.ahead=1 in a launch of several processes: how many of them only generate (the last
    ranks; 1 today), while the others train on the rollouts they made before and send them each
    update's weights (docs/processes.md). 0 = every process trains and generates its own share."""

    def validate(self) -> None:
        require((self.ahead in (0, 1), f"rollout.ahead must be 0 (synchronous) or 1 (one step ahead); got {self.ahead}"),
                (self.generators in (0, 1), f"rollout.generators must be 0 or 1 (one generating process); got "
                                            f"{self.generators}"),
                (not self.generators or self.ahead == 1,
                 "rollout.generators=1 needs rollout.ahead=1 (the generator makes the next step's rollouts)"),
                (not (self.ahead and self.tools), "rollout.ahead=1 with rollout.tools is not run: set rollout.ahead=0"))
        require((self.fsdp_generation in ("whole", "layers"),
                 f"rollout.fsdp_generation must be whole or layers; got {self.fsdp_generation!r}"))
        require(temperature_rule("rollout.temperature", self.temperature, greedy=False),  # GRPO learns from samples
                (self.group_size >= 2, f"rollout.group_size must be >= 2 (advantages compare the completions of one "
                                       f"prompt: a group of one never learns); got {self.group_size}"))
        try:
            super().validate()
        except VlmrlError as error:
            raise VlmrlError(f"rollout.{error}") from None
        require((self.max_turns >= 1 and self.max_trajectory_tokens >= 1
                 and math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0,
                 "rollout.max_turns and max_trajectory_tokens must be >= 1, tool_timeout_s > 0"),
                (TOOL_IMAGE_SIDES[0] <= self.tool_image_side <= TOOL_IMAGE_SIDES[1],
                 tool_image_side_rule("rollout.tool_image_side", self.tool_image_side)),
                (min(self.prompts_per_step, self.generation_batch_size, self.max_prompt_length) >= 1,
                 "rollout.prompts_per_step, generation_batch_size and max_prompt_length must be >= 1"),
                at_most("rollout.tool_timeout_s", self.tool_timeout_s, MAX_TOOL_TIMEOUT_S),
                at_most("rollout.max_turns", self.max_turns, MAX_TURNS),
                at_most("rollout.max_trajectory_tokens", self.max_trajectory_tokens, MAX_TOKENS),
                at_most("rollout.max_prompt_length", self.max_prompt_length, MAX_TOKENS),
                at_most("rollout.generation_batch_size", self.generation_batch_size, MAX_ROWS),
                (self.prompts_per_step * self.group_size <= MAX_ROWS,
                 f"rollout.prompts_per_step x group_size must be at most {MAX_ROWS:,} completions per step; got "
                 f"{self.prompts_per_step} x {self.group_size}"))

    def per_process(self, world: int) -> int:
        """Prompts each of `world` processes handles per step."""
        return self.prompts_per_step // world

    def per_call(self, world: int) -> int:
        """Prompts per generate call: the configured size, at most one process's share."""
        return min(self.generation_batch_size, self.per_process(world))

    def check_layout(self, world: int) -> None:
        """Prompts split evenly over processes, and each process's share over generate calls."""
        if self.prompts_per_step % world:
            raise VlmrlError(f"rollout.prompts_per_step={self.prompts_per_step} must be divisible by the "
                             f"{world} processes")
        if self.per_process(world) % self.per_call(world):
            raise VlmrlError(f"rollout.generation_batch_size={self.generation_batch_size} must divide the "
                             f"{self.per_process(world)} prompts each process handles per step")


@dataclass
class AlgorithmConfig:
    """The RL objective. GRPO, DAPO, Dr. GRPO and GSPO are settings of these knobs (see configs/)."""

    advantage_scale: Literal["group", "batch", "none"] = "group"
    """Divide (reward - group mean) by the group's std (GRPO), the batch's std, or nothing (Dr. GRPO)."""
    advantage_shaping: Literal["none", "cubic", "cubic_rescaled"] = "none"
    """Reshape the advantages: cubic = A**3 (sign kept), so surprising completions weigh more;
    cubic_rescaled = the same, each group rescaled to the root-mean-square it had before."""
    eps_low: float = ranged(0.2, FRACTION)
    """Lower clip range of the importance ratio: ratio >= 1 - eps_low."""
    eps_high: float = ranged(0.2, SCALE)
    """Upper clip range: ratio <= 1 + eps_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: float = ranged(0.0, SCALE)
    """Dual-clip PPO: the loss of a negative-advantage token is capped at dual_clip * |A| (a value
    c > 1, commonly 3; 0 = off). Only binds when ratios move (updates_per_batch > 1)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (GRPO) or per sequence, length-normalised (GSPO)."""
    surrogate: Literal["clip", "cispo", "gmpo", "sapo"] = "clip"
    """Policy-gradient surrogate: PPO's clipped one (GRPO, DAPO, GSPO), CISPO (the importance
    weight clipped, every token keeps its gradient; eps_low=1 means no lower bound), GMPO (the
    geometric mean of token ratios, clipped in log space to [-eps_low, eps_high]), or SAPO (a
    smooth gate (4/tau) sigmoid(tau (ratio - 1)) in place of the clip; eps_low and eps_high unused).
    See docs/algorithms.md."""
    sapo_tau_pos: float = ranged(1.0, SAPO_TAU)
    """SAPO's gate temperature for tokens of positive advantage (higher: the gate closes sooner)."""
    sapo_tau_neg: float = ranged(1.05, SAPO_TAU)
    """SAPO's gate temperature for the other tokens (the paper's and TRL's 1.05: negative updates
    damped a little faster)."""
    top_entropy_share: float = ranged(1.0, FRACTION)
    """Train only on the highest-entropy share of each micro-batch's tokens (0.2: the "80/20"
    forking tokens); 1 = every token."""
    aggregation: Literal["token", "sequence", "constant"] = "sequence"
    """Loss over tokens: mean over all tokens of the batch (DAPO), mean per sequence then over
    sequences (GRPO), or sum divided by rollout.max_new_tokens per sequence (Dr. GRPO)."""
    beta: float = ranged(0.04, SCALE)
    """Weight of the KL penalty to the reference model (0 = no reference model at all)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator per token (k3 = exp(ref - logp) - (ref - logp) - 1, unbiased and >= 0)."""
    ref_refresh_steps: int = 0
    """Copy the policy into the reference every N steps (0 = never; the cryptogram work used 64)."""
    ref_mix: float = ranged(1.0, FRACTION)
    """At a refresh, reference = mix * policy + (1 - mix) * reference (1.0 = plain copy)."""
    updates_per_batch: int = 1
    """Optimisation passes (mu) over each rollout batch; the sampling log-probs stay the 'old' ones."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and draw more prompts to fill the batch."""
    max_sampling_rounds: int = 3
    """Most generation rounds per step under dynamic sampling; then the batch is filled with the
    dropped groups (they carry no policy gradient)."""
    mask_truncated: bool = False
    """DAPO overlong filtering: completions that hit max_new_tokens get no loss."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: the last N tokens before max_new_tokens cost up to
    overlong_penalty reward, linearly (0 = off)."""
    overlong_penalty: float = ranged(1.0, SCALE)
    """Reward lost by a completion that reaches max_new_tokens when overlong_buffer > 0."""
    reward_aggregation: Literal["sum", "normalize_then_sum"] = "sum"
    """How the `rewards` list becomes one reward: the weighted sum, or GDPO's normalize_then_sum (each
    reward z-scored within its group first, so a reward with a wide range cannot drown the others)."""
    tis_cap: float = ranged(3.0, TIS_CAP)
    """Truncated importance sampling against the rollout/training mismatch: each token's surrogate
    is weighted by min(pi_train / pi_sampler, tis_cap), from the log-probs the sampler recorded
    (a compiled or bf16 decode step is not the training forward); 0 = off. The mismatch is logged
    either way (mismatch_kl, tis_capped_fraction)."""
    tis_floor: float = ranged(0.0, FRACTION)
    """Lower bound of those weights, in (0, 1]; 0 = none. With tis_mode=token_mask, 0.5 and
    tis_cap=2 are IcePop's two-sided token masking."""
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "token_truncate"
    """How the weights are taken and bounded (docs/algorithms.md): per token or per sequence (the
    row's summed log-ratio), clipped to [tis_floor, tis_cap] (truncate) or zeroed outside it (mask:
    sequence_mask is TRL's default, MIS)."""
    off_policy_mask: float = ranged(0.0, LOG_RATIO)
    """DeepSeek-V3.2's off-policy sequence masking: drop the rows of negative advantage whose mean
    log-ratio sampler / policy exceeds this (e.g. 0.5); 0 = off."""
    teacher: str = path_field("")
    """On-policy distillation: a model folder (or a LoRA adapter folder, or a hub id) whose log-probs
    of the student's own sampled tokens are the signal: each token's advantage gets
    -distill_weight * (log pi_student - log pi_teacher). It must share the policy's tokenizer and
    image-token layout (two sizes of one family do). "" = off. See docs/algorithms.md."""
    distill_weight: float = ranged(1.0, SCALE)
    """Weight of the teacher's per-token signal (the reverse KL) in the advantage; > 0 with a teacher."""
    distill_reward: Literal["keep", "drop"] = "keep"
    """With a teacher: keep the task's group advantage beside the teacher's signal, or drop it
    (distillation alone: the rewards are still scored and logged)."""

    def validate(self) -> None:
        numbers = {"eps_low": self.eps_low, "eps_high": self.eps_high, "beta": self.beta, "dual_clip": self.dual_clip,
                   "ref_mix": self.ref_mix, "overlong_penalty": self.overlong_penalty, "tis_cap": self.tis_cap,
                   "top_entropy_share": self.top_entropy_share, "sapo_tau_pos": self.sapo_tau_pos,
                   "sapo_tau_neg": self.sapo_tau_neg, "tis_floor": self.tis_floor,
                   "off_policy_mask": self.off_policy_mask, "distill_weight": self.distill_weight}
        infinite = [f"{name}={value}" for name, value in numbers.items() if not math.isfinite(value)]
        require((not infinite, f"algorithm.{', '.join(infinite)}: must be finite (no nan or inf)"),
                (0 < self.ref_mix <= 1, f"algorithm.ref_mix must be in (0, 1]; got {self.ref_mix}"),
                (self.updates_per_batch >= 1, f"algorithm.updates_per_batch must be >= 1; got {self.updates_per_batch}"),
                (self.eps_low >= 0 and self.eps_high >= 0 and self.beta >= 0, "algorithm.eps_low, eps_high and beta must be >= 0"),
                (self.eps_low <= 1, f"algorithm.eps_low must be <= 1 (the ratio's lower clip is 1 - eps_low); got {self.eps_low}"),
                (self.surrogate in ("clip", "sapo") or self.ratio_level == "token",
                 f"algorithm.surrogate={self.surrogate} needs ratio_level=token"),
                (self.surrogate == "clip" or self.dual_clip == 0,
                 f"algorithm.dual_clip goes with surrogate=clip only; got surrogate={self.surrogate}"),
                (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0,
                 f"algorithm.sapo_tau_pos and sapo_tau_neg must be > 0; got {self.sapo_tau_pos}, {self.sapo_tau_neg}"),
                (0 < self.top_entropy_share <= 1, f"algorithm.top_entropy_share must be in (0, 1]; got {self.top_entropy_share}"),
                (self.dual_clip == 0 or self.dual_clip > 1, f"algorithm.dual_clip must be 0 (off) or > 1; got {self.dual_clip}"),
                (self.tis_cap == 0 or self.tis_cap >= 1, f"algorithm.tis_cap must be 0 (off) or >= 1; got {self.tis_cap}"),
                (0 <= self.tis_floor <= 1, f"algorithm.tis_floor must be in [0, 1] (0: none); got {self.tis_floor}"),
                (self.off_policy_mask >= 0, f"algorithm.off_policy_mask must be >= 0 (0: off); got {self.off_policy_mask}"),
                (self.ref_refresh_steps >= 0 and self.overlong_buffer >= 0 and self.overlong_penalty >= 0,
                 "algorithm.ref_refresh_steps, overlong_buffer and overlong_penalty must be >= 0"),
                (self.max_sampling_rounds >= 1, f"algorithm.max_sampling_rounds must be >= 1; got {self.max_sampling_rounds}"),
                (not self.teacher or self.distill_weight > 0,
                 f"algorithm.distill_weight must be > 0 with a teacher; got {self.distill_weight}"),
                (bool(self.teacher) or self.distill_reward == "keep",
                 "algorithm.distill_reward=drop needs algorithm.teacher (without one there would be no signal)"),
                at_most("algorithm.updates_per_batch", self.updates_per_batch, MAX_UPDATES_PER_BATCH),
                at_most("algorithm.max_sampling_rounds", self.max_sampling_rounds, MAX_SAMPLING_ROUNDS))


MAX_EPOCHS = 100_000
"""Most passes over the train rows (train.epochs): pretraining-scale data takes one to a few, small
fine-tuning sets tens to hundreds; each epoch is at least one step."""
EPOCHS = Range(0.0, float(MAX_EPOCHS), "passes over the train rows (0 = train.steps counts)")


@dataclass
class TrainConfig:
    """Optimisation, checkpoints and logging."""

    steps: int = 100
    """Optimizer steps (each on a fresh rollout batch when updates_per_batch = 1)."""
    epochs: float = ranged(0.0, EPOCHS)
    """Passes over the task's train rows, instead of train.steps (0 = train.steps counts): the run makes
    ceil(epochs x train rows / prompts per step) steps (rollout.prompts_per_step; sft.batch_size for
    `vlmrl sft`). Only a task with a fixed set of train rows (the dataset task, geometry from files)
    has epochs; train.steps given as well must be the number the epochs make (safety/early_checks.py)."""
    lr: float = ranged(1e-6, LEARNING_RATE)
    """Peak learning rate of AdamW."""
    weight_decay: float = ranged(0.0, SCALE)
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warmup from 0 to lr."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warmup (cosine decays to 10% of lr)."""
    stochastic_rounding: bool = True
    """bfloat16 weights take each AdamW update computed in float32 and stored back by stochastic
    rounding (unbiased), as do AdamW's moments: rounded to nearest, an update below half a unit in
    the last place (about |w| / 512) is lost, which is most RL steps at lr 1e-6 (stochastic_rounding.py).
    Same memory. No effect on float32 weights (LoRA adapters, CPU runs). false = round to nearest."""
    max_grad_norm: float = ranged(1.0, GRAD_NORM)
    """Clip the gradient norm (0 = no clipping)."""
    max_bad_steps: int = 3
    """An update whose loss or gradient is NaN/inf is skipped (no optimizer step; the lr schedule
    still advances) and counted as skipped_steps in the metrics; this many in a row stop the run
    with a checkpoint and an error (0 = never stop, keep skipping)."""
    micro_batch_size: int | Literal["auto"] = 16
    """Completions per forward/backward pass; gradients accumulate over the whole rollout batch.
    A multiple of rollout.group_size keeps each group in one pass (see pack_groups). auto = the
    largest that the preflight's memory estimate says fits (RL: a multiple of the group size, at
    most one process's rows of a step; SFT: at most one process's examples of a step)."""
    pack_groups: bool = True
    """Log-prob passes (policy, old, reference) compute each prompt and image once per group: the
    prompt and its completions are packed into one sequence under a block attention mask; exact
    log-probs and gradients. False repeats the prompt for every completion, as TRL does (for
    comparison). Needs eager or sdpa attention and a checked model family, else it falls back."""
    block_attention: bool = True
    """Packed passes on sdpa attention compute only the attention blocks the packing's mask allows
    (the prompt over itself; each completion over its prompt and itself) instead of the whole
    (L x L) square: exact, fewer FLOPs, and FlashAttention's kernel where only the causal rule
    masks. False = one SDPA call under the dense mask."""
    batched_vision_attention: bool = True
    """The vision tower's attention (Qwen2.5-VL, Qwen2-VL on sdpa) in one call per window length
    instead of transformers' one call per window or image, in every pass, generation included:
    exact, and for Qwen2.5-VL-3B 32 calls per tower pass instead of 14,368 at 8 images of 896 px.
    False = transformers' loop."""
    fused_kernels: bool = False
    """Each RMSNorm and SiLU-gated MLP of the model (Qwen2.5-VL, Qwen2-VL and Idefics3's language
    models, Qwen2.5-VL's vision tower) computes with one fused Triton kernel from liger-kernel, in
    every pass, generation included. Needs CUDA and `pip install liger-kernel`, and the kernels
    must pass a self-check against torch's formulas before step 1; else it falls back (the
    preflight's speed line says why). Off until measured on a GPU (benchmarks/RESULTS.md)."""
    logprob_chunk: int = 1024
    """Completion positions per chunk of the output layer: log-softmax over the vocabulary is taken
    this many positions at a time (and recomputed in backward), so full-vocabulary logits never
    exist for the whole batch. 0 = all logits at once."""
    prefetch_batches: int = 1
    """Generate calls whose examples a worker thread makes (images read and decoded) and encodes (the
    processor) ahead, while the model generates and trains: the same examples and tensors, off the
    step's path (time/data is what is left on it, time/data_ahead what was hidden). Pays when
    decoding and encoding take a visible share of a step (many or large images from files); costs
    the memory of that many calls' images and tensors. In `vlmrl sft`: the batches of this many
    steps ahead, the reference trajectories' tool calls included (training/sft_batches.py). 0 = off
    (each call draws its own)."""
    background_checkpoints: bool = True
    """Copy the checkpoint's state (weights, optimizer, RNG, reference copy) to host memory at the
    step's end and write it on a background thread while training goes on; each is made durable
    (fsync, then renamed into place) before the next one starts and before the run ends, and a kill
    while writing leaves the previous one whole. Pays when writing takes long against a step (a
    large model, a slow disk); costs host memory the size of the copy while it is written (a LoRA
    run copies its adapter alone). Where the preflight finds that copy would not fit in the host's
    available RAM beside the run, the run writes on the step's path instead and its `checkpoints`
    line says why. false = write on the step's path."""
    background_scoring: bool = True
    """Rewards that wait on another program (a reward service, a judge, a function of your own in
    the reward worker) score each generate call's completions on background threads while the next
    call generates, and a step's calls to a service go out together (at most 8 at once): the same
    scores and the same failures, off the step's path (time/score is what is left on it,
    time/score_ahead what was hidden). The built-ins and `task` score on the trainer's thread as
    before. Pays with a slow reward and several generate calls a step (rollout.generation_batch_size).
    false = each call scored in turn before the next generates."""
    background_logs: bool = True
    """Write each step's metrics (metrics.jsonl, TensorBoard) and rollouts (rollouts/) on one
    background thread while training goes on: the same files, line for line; all written before a
    checkpoint is, before the run ends and when it stops on an error or a signal (time/log is what
    the logs kept on the step's path, time/log_write the thread's time, hidden). W&B and trackio
    stay on the main thread. Pays when the rollouts are large (many images) and written often.
    false = write on the step's path."""
    save_every: int = 0
    """Checkpoint every N steps, and after the last step (0 = only after the last step)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep, newest first (0 = all; the final model is always kept).
    Keep 2 or more: resume falls back to the one before when the newest is damaged."""
    log_rollouts_every: int = 10
    """Write the step's completions and rewards to rollouts/ (and W&B's completions table) every N
    steps (0 = never)."""
    attention_every: int = 0
    """Log attention_on_image (mean share of completion tokens' attention on image tokens, over a
    few rollouts, one extra eager forward) every N steps (0 = never)."""
    trackers: list[Literal["tensorboard", "wandb", "trackio"]] = field(
        default_factory=lambda: ["tensorboard"])
    """Where metrics go besides metrics.jsonl (always written): tensorboard (event files in
    output_dir/tensorboard), wandb, trackio (these two only when installed). [] = metrics.jsonl only."""
    tracker_project: str = "vlmrl"
    """Project that wandb and trackio file the run under (the run is named after output_dir)."""

    def validate(self) -> None:
        counts = {"warmup_steps": self.warmup_steps, "max_bad_steps": self.max_bad_steps,
                  "logprob_chunk": self.logprob_chunk, "save_every": self.save_every,
                  "prefetch_batches": self.prefetch_batches,
                  "keep_checkpoints": self.keep_checkpoints, "log_rollouts_every": self.log_rollouts_every,
                  "attention_every": self.attention_every}
        negative = [f"{name}={value}" for name, value in counts.items() if value < 0]
        require((self.steps >= 1 and (self.micro_batch_size == "auto" or self.micro_batch_size >= 1),
                 "train.steps and train.micro_batch_size must be >= 1 (micro_batch_size may be auto)"),
                (self.micro_batch_size == "auto" or self.micro_batch_size <= MAX_ROWS,
                 f"train.micro_batch_size must be at most {MAX_ROWS:,} (or auto); got {self.micro_batch_size}"),
                (not negative, f"train.{', '.join(negative)}: must be >= 0"),
                (math.isfinite(self.lr) and self.lr >= 0, f"train.lr must be >= 0; got {self.lr}"),
                (math.isfinite(self.weight_decay) and self.weight_decay >= 0, f"train.weight_decay must be >= 0; got {self.weight_decay}"),
                (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0,
                 f"train.max_grad_norm must be >= 0 (0 = no clipping); got {self.max_grad_norm}"),
                (len(self.adam_betas) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in self.adam_betas),
                 f"train.adam_betas must be two numbers in [0, 1); got {self.adam_betas}"),
                at_most("train.prefetch_batches", self.prefetch_batches, MAX_PREFETCH),
                (bool(self.tracker_project.strip()), "train.tracker_project is empty"))


@dataclass
class EvalConfig:
    """Held-out evaluation while training (`vlmrl train` and `vlmrl sft`): greedy accuracy and the
    mean reward components on a fixed set, logged as eval/<split>/<metric> in metrics.jsonl. Seeded
    with the run's seed; other settings are EvalSettings' defaults (no pass@k)."""

    every: int = 0
    """Evaluate every N steps and after the last one (0 = never)."""
    n: int = 64
    """Examples per split: the first n of the split, the same set every time."""
    splits: list[str] = field(default_factory=lambda: ["test"])
    """Splits to evaluate (test, ood, ...; see `vlmrl tasks list`)."""
    max_new_tokens: int = 0
    """Longest completion; 0 = rollout.max_new_tokens."""
    batch_size: int = 32
    """Prompts per generate call; the same default as EvalSettings.batch_size and `vlmrl eval --batch-size`."""
    blind_check: bool = False
    """Also answer each split with blank and with shuffled images (logged as eval/<split>/blank/accuracy
    and eval/<split>/shuffled/accuracy): does the model read the image? Triples the evaluation's cost."""

    def validate(self) -> None:
        require((self.every >= 0 and self.n >= 1 and self.batch_size >= 1 and self.max_new_tokens >= 0,
                 "eval.every and eval.max_new_tokens must be >= 0, eval.n and eval.batch_size >= 1"),
                at_most("eval.n", self.n, MAX_EVAL_EXAMPLES),
                at_most("eval.max_new_tokens", self.max_new_tokens, MAX_TOKENS),
                at_most("eval.batch_size", self.batch_size, MAX_ROWS),
                (bool(self.splits) or self.every == 0, "eval.splits is empty while eval.every > 0"))


@dataclass
class SftConfig:
    """Supervised warm start (`vlmrl sft`) on the task's reference completions; optimisation,
    checkpoints and logging come from the `train` section."""

    batch_size: int = 32
    """Examples per optimizer step, over all processes (split into train.micro_batch_size)."""
    text_examples: int = 0
    """Of each step's examples, how many are learnt a second time without their images (and
    videos), over all processes, at most sft.batch_size: the text alone teaches what follows from
    the text (the format, copies of the prompt and of the completion so far) at the cost of a
    text-only forward, while the same examples with their images keep what is read from them
    trained. The task's `image_only_spans` (a decoder's entries) are left out of their loss. Each
    process copies the first of its share; the copies join the loss as rows of their own."""

    def validate(self) -> None:
        require((self.batch_size >= 1, f"sft.batch_size must be >= 1; got {self.batch_size}"),
                at_most("sft.batch_size", self.batch_size, MAX_ROWS),
                (0 <= self.text_examples <= self.batch_size,
                 f"sft.text_examples must be 0..sft.batch_size ({self.batch_size}); got {self.text_examples}"))

    def check_layout(self, world: int) -> None:
        """The batch and its text copies split evenly over `world` processes."""
        if self.batch_size % world:
            raise VlmrlError(f"sft.batch_size={self.batch_size} must be divisible by the {world} processes")
        if self.text_examples % world:
            raise VlmrlError(f"sft.text_examples={self.text_examples} must be divisible by the {world} processes")


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling of completions."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL objective."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation, checkpoints and logging."""
    sft: SftConfig = field(default_factory=SftConfig)
    """Supervised warm start (used by `vlmrl sft` only)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation during training."""
    rewards: list[Any] | str = field(default_factory=list)
    """The rewards trained on, each a name or {name, weight, kwargs, label} (docs/rewards.md); names
    alone may be given as text, `accuracy,format`; empty: the task's own score (the reward named `task`)."""
    seed: int = 0
    """Seed for weights init, sampling and data order."""
    output_dir: str = path_field("runs/default")
    """Run directory: config.yaml, metrics.jsonl, rollouts/, checkpoints/, report.html."""
    resume: bool = False
    """Continue from the newest checkpoint in output_dir (exactly: same data, RNG and optimizer)."""
    resume_changes: Literal["refuse", "allow"] = "refuse"
    """With resume=true, a change from the run's saved config that makes it another run (model, task,
    algorithm, batch layout, optimizer, LoRA, seed, or sft on a train run's folder and the reverse)
    stops it in one line; allow = continue anyway. Steps, eval, logging and checkpoint settings may
    always change (listed when they do). See safety/resume.py."""

    def __post_init__(self) -> None:
        entries = [n.strip() for n in self.rewards.split(",") if n.strip()] if isinstance(self.rewards, str) else self.rewards
        self.rewards = [reward_entry(entry, f"rewards[{i}]") for i, entry in enumerate(entries)]

    def validate(self) -> None:
        """The rules between sections (each section checks its own fields when it is built)."""
        require(seed_rule("seed", self.seed),
                (bool(self.output_dir.strip()), "output_dir is empty"),
                (self.algorithm.overlong_buffer <= self.rollout.max_new_tokens,
                 f"algorithm.overlong_buffer={self.algorithm.overlong_buffer} must be at most "
                 f"rollout.max_new_tokens={self.rollout.max_new_tokens} (the penalty ramps over the last tokens)"),
                (not (self.sft.text_examples and self.rollout.tools),
                 "sft.text_examples with rollout.tools is not run (a reference trajectory's tools read its "
                 "images): set sft.text_examples=0"))


# --------------------------------------------------------------------------- reading and writing


_NAMING = Naming(noun="config key", renamed=RENAMED_KEYS)
"""Errors name config fields by their dotted key ("train.lr")."""


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls: type = Config):
    """Build a `cls` from an optional YAML file, then `key.sub=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
        data = with_files_from(data, Path(path).parent)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    return from_dict(cls, data)


def check_config(config: Config) -> Config:
    """`config` checked as `load_config` checks what it reads: every field coerced to its type and every
    section's rules, then the rules between sections (`fields.build`); a VlmrlError in one line, the
    same line `vlmrl train` prints, for a config built in Python (`Config(rollout=RolloutConfig(
    group_size=1))`) as for one read from YAML. Returns the checked copy."""
    require((isinstance(config, Config), f"a run needs a vlmrl.config.Config; got {type(config).__name__}"))
    return from_dict(Config, to_dict(config))


def with_files_from(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`data` with the code a config file names as `file.py:name` (its rewards and its task) made
    absolute from its folder (one named on the command line is read from the working directory); the
    paths of data, models and output folders are read from the working directory (docs/data.md)."""
    task = data.get("task")
    if isinstance(task, dict) and isinstance(task.get("name"), str):
        data = data | {"task": task | {"name": resolve_file(task["name"], folder)}}
    entries = data.get("rewards")
    if not isinstance(entries, list):
        return data
    resolved = [resolve_file(entry, folder) if isinstance(entry, str) else
                entry | {"name": resolve_file(entry["name"], folder)} if isinstance(entry, dict)
                and isinstance(entry.get("name"), str) else entry for entry in entries]
    return data | {"rewards": resolved}


BYTE_ORDER_MARKS = ((b"\xef\xbb\xbf", "utf-8"), (b"\xff\xfe\x00\x00", "utf-32-le"), (b"\x00\x00\xfe\xff", "utf-32-be"),
                    (b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be"))
"""A text file's byte-order mark and its encoding (UTF-32's marks before UTF-16's, which they begin with)."""


def decode_text(data: bytes, path: str | Path) -> str:
    """The text of a config file's bytes: UTF-8, or what its byte-order mark says (UTF-8, UTF-16,
    UTF-32); anything else a one-line VlmrlError saying what the bytes look like (UTF-16 without its
    mark, a binary file, another encoding) and to save it as UTF-8."""
    refuse = f"{path} is not a YAML text file: {{}}; save it as UTF-8 text"
    for mark, encoding in BYTE_ORDER_MARKS:
        if data.startswith(mark):
            try:
                return data[len(mark):].decode(encoding)
            except UnicodeDecodeError as error:
                raise VlmrlError(refuse.format(f"it starts with a {encoding.upper()} byte-order mark but {error.reason} "
                                               f"at byte {error.start + len(mark)}")) from None
    if b"\x00" in data:
        for encoding in ("utf-32-le", "utf-32-be", "utf-16-le", "utf-16-be"):
            try:
                text = data.decode(encoding)
            except UnicodeDecodeError:
                continue
            if all(c.isprintable() or c in "\t\n\r" for c in text):
                raise VlmrlError(refuse.format(f"it is {encoding.upper()} text without a byte-order mark"))
        nul = data.index(b"\x00")
        raise VlmrlError(refuse.format(f"a NUL character (a binary file?) at byte {nul}"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise VlmrlError(refuse.format(f"{error.reason} at byte {error.start} (not UTF-8)")) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from `path` (its text by `decode_text`: UTF-8, or UTF-16/32 with its byte-order
    mark); whatever is wrong is one line with the position: a folder or a missing file, a syntax error,
    a key written twice in one mapping, nesting deeper than fields.MAX_YAML_DEPTH, or bytes that are
    not such text."""
    path = Path(path)
    if path.is_dir():
        inside = path / "config.yaml"
        hint = f"; the run's config is {inside}" if inside.is_file() else ""
        raise VlmrlError(f"config file {str(path)!r} is a folder, not a YAML file{hint}")
    if not path.is_file():
        raise VlmrlError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(decode_text(path.read_bytes(), path), Loader=StrictLoader)
    except OSError as error:
        raise VlmrlError(f"cannot read config file {str(path)!r}: {error.strerror or error}") from None
    except yaml.reader.ReaderError as error:  # a control character
        raise VlmrlError(f"{path} is not a YAML text file: {error.reason} at character {error.position}; save it as "
                         "UTF-8 text") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or one_line(error)
        raise VlmrlError(f"YAML syntax error in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise VlmrlError(f"{path} must hold a mapping of config sections, not {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """`train.lr=1e-6` -> ("train.lr", 1e-6); the value is read as YAML (`vlmrl.fields.read_text`:
    "1e-6" is a float; text that is not YAML stays text; an empty value is "")."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise VlmrlError(f"override {item!r} is not of the form section.key=value")
    return key.strip(), read_text(raw) if raw.strip() else ""


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """data["a"]["b"] = value for key "a.b", creating mappings on the way."""
    *parents, last = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise VlmrlError(f"cannot set {key!r}: {part!r} is not a section")
        node = child
    node[last] = value


def from_dict(cls: type, data: dict[str, Any], prefix: str = ""):
    """Build dataclass `cls` from a nested mapping, checking every key and type (the rule is in
    `vlmrl.fields`); a key of RENAMED_KEYS says its new name."""
    return build(cls, data, _NAMING, prefix)


def to_dict(config) -> dict[str, Any]:
    """Plain nested dict of a config (for YAML and JSON)."""
    return dataclasses.asdict(config)


def saved_dict(config) -> dict[str, Any]:
    """`to_dict(config)` as it is saved and shown (config.yaml, `vlmrl config`, trackers, the resume
    check): without a secret. A reward service's URL is redacted (`vlmrl.urls.redact`: `***@`, `key=***`)
    and a header value that is a secret itself becomes *** (`${NAME}` references stay). Such a file
    still resumes the run with the config that holds the secrets (the resume check compares the saved
    forms); given back as the config itself, it is refused in one line naming the reward."""
    data = to_dict(config)
    for entry in data.get("rewards") or []:
        if isinstance(entry, dict) and is_url(entry.get("name")):
            entry["name"] = redact(entry["name"])
            entry["kwargs"] = saved_settings(entry.get("kwargs") or {})
        if isinstance(entry, dict) and is_judge(entry.get("name")):  # its URL in its kwargs
            entry["kwargs"] = saved_judge(entry.get("kwargs") or {})
    return data


def save_config(config, path: str | Path) -> None:
    """Write `config` as YAML that `load_config` reads back to an equal config, secrets left out
    (`saved_dict`); whole or not at all: a bad path or a full disk is one line, disk.py."""
    write_text(path, "the config", yaml.safe_dump(saved_dict(config), sort_keys=False))


# --------------------------------------------------------------------------- describing


def describe(config, prefix: str = "", shown: dict[str, Any] | None = None) -> list[str]:
    """`key = value  # doc` lines for every leaf field of `config`, values as saved (`saved_dict`)."""
    lines = []
    docs = field_docs(type(config))
    shown = saved_dict(config) if shown is None else shown
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            lines.extend(describe(value, prefix + f.name + ".", shown[f.name]))
        else:
            lines.append(f"{prefix}{f.name} = {shown[f.name]!r}  # {docs.get(f.name, '')}")
    return lines
