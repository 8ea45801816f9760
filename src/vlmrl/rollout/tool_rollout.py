"""Multi-turn rollouts: the model calls visual tools (zoom, crop, your own) and sees their results.

Each of the G samples of a prompt is a trajectory. A turn is sampled until the end-of-turn token or
the end of a tool call (`</tool_call>`, a stop string, so any tokenizer works); a turn that ends in
a call gets the tool's result (tools.py: never a crash; errors come back as text) appended as the
next user turn, images included, and the trajectory goes on, for at most `rollout.max_turns` model
turns and `rollout.max_new_tokens` tokens in all (the model's and the tools'). A trajectory that
runs out of turns or tokens is `cut`.

The first turn starts from one prefill per prompt, shared by its G samples (prefill.py); later
turns re-encode each trajectory from its prompt (trajectories.py), one forward per trajectory and
turn, so a turn costs a prefill of everything so far: simple and exact, not the fastest.

The result is a `ToolRollout`: a `Rollout` whose completion ids are everything after the prompt
(the model's tokens and the tools'), whose mask marks the model's tokens only (the loss, the KL and
the length statistics see nothing else), and which keeps each trajectory's segments and turns for
the log-prob pass, the rewards and the logs, and what the cached tools did while it was generated
(`cache_counts`: calls and answers computed, per tool; `cache_statistics` makes the logged
`tools/<name>/calls` and `tools/<name>/cache_hit_rate` of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from vlmrl.config import RolloutConfig
from vlmrl.rollout.generation import Rollout, generation_inputs, sample, stop_token_ids, suppressed_token_ids
from vlmrl.rollout.trajectories import Segment, encode_trajectories, tool_turn
from vlmrl.tasks import Example
from vlmrl.tools.cache import counts_of
from vlmrl.tools.calls import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, ends_with_call, parse_tool_call,
                               tool_result_text)
from vlmrl.tools.contract import ToolContext, ToolLimits
from vlmrl.tools.model_tools import ModelTool
from vlmrl.tools.registry import resolve_tools
from vlmrl.tools.running import run_tool
from vlmrl.tools.trajectory import Trajectory, Turn


@dataclass
class ToolRollout(Rollout):
    """A Rollout of multi-turn trajectories (see the module doc): completion_mask marks the model's
    tokens; `segments[i]` and `trajectories[i]` are row i's turns as tokens and as text."""

    segments: list[list[Segment]] | None = None  # set by generate_trajectories / reference_rollout
    trajectories: list[Trajectory] | None = None
    cache_counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per cached tool, (calls, answers computed) while generate_trajectories made this rollout; `select`
    keeps them (the work of the whole generation), `concat` does not (the sampler sums each generation's)."""

    def select(self, index: list[int]) -> ToolRollout:
        return replace(Rollout.select(self, index), segments=[self.segments[i] for i in index],
                       trajectories=[self.trajectories[i] for i in index])

    @staticmethod
    def concat(parts: list[ToolRollout], pad_id: int) -> ToolRollout:
        whole = Rollout.concat(parts, pad_id)
        return ToolRollout(**whole.base_fields(), segments=[s for p in parts for s in p.segments],
                           trajectories=[t for p in parts for t in p.trajectories])


@dataclass
class ToolBox:
    """How multi-turn rollouts run: the rollout settings (sampling, turns, token budget, image
    side), the tools they may call, and the tools' limits."""

    settings: RolloutConfig
    tools: dict
    limits: ToolLimits

    @classmethod
    def from_config(cls, settings: RolloutConfig) -> ToolBox:
        """The tools of `settings.tools` resolved, model tools bound to `settings.tool_models` (VlmrlError for an
        unknown tool or a bad model folder)."""
        tools = resolve_tools(settings.tools, settings.tool_models)
        return cls(settings, tools, ToolLimits(timeout_s=settings.tool_timeout_s))


def tool_tag_ids(tokenizer) -> set[int]:
    """Ids of `<tool_call>` / `</tool_call>` when the tokenizer has them as single (added) tokens,
    as Qwen's does: they must be neither banned from sampling nor dropped from a turn's text."""
    return {i for i, token in tokenizer.added_tokens_decoder.items() if token.content in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)}


def family_markers(processor) -> set[str]:
    """The model family's image and control tokens, read from its processor, not per family: the
    tokenizer's special tokens (all_special_tokens and every added token marked special: Idefics3's
    `<image>` and `<row_1_col_1>`, Gemma 3's `<start_of_image>`, Qwen's `<|image_pad|>`, LLaVA's `<image>`,
    ...) and the processor's own `*_token` / `*_tag` strings (image_token, boi_token, fake_image_token,
    global_image_tag, ...). A tool's text has them defused (`tool_result_text`)."""
    tokenizer = processor.tokenizer
    markers = set(tokenizer.all_special_tokens)
    markers |= {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    markers |= {value for owner in (processor, tokenizer) for name, value in vars(owner).items()
                if isinstance(value, str) and name.endswith(("_token", "_tag"))}
    return markers


def turn_text(tokenizer, ids: list[int]) -> str:
    """A turn's text: special tokens dropped, except the tool-call tags."""
    tags = tool_tag_ids(tokenizer)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} - tags
    return tokenizer.decode([i for i in ids if i not in special], skip_special_tokens=False).strip()


def turn_end(ids: list[int], stop_ids: list[int], tokenizer) -> int:
    """How many of a turn's sampled `ids` belong to it: up to the first stop token (kept), or to the
    token that completes `</tool_call>` if that comes first, or all of them."""
    stop = next((k + 1 for k, token in enumerate(ids) if token in stop_ids), len(ids))
    if TOOL_CALL_CLOSE not in tokenizer.decode(ids[:stop], skip_special_tokens=False):
        return stop
    window = 4 * len(TOOL_CALL_CLOSE)  # tokens: the closing tag spans fewer than that
    for k in range(stop):  # the first token after which the text so far ends with the tag
        if TOOL_CALL_CLOSE in tokenizer.decode(ids[max(0, k + 1 - window):k + 1], skip_special_tokens=False):
            return k + 1
    return stop


@torch.no_grad()
def sample_turn(model, processor, rows: list[Example], segments: list[list[Segment]],
                settings: RolloutConfig) -> list[Segment]:
    """One turn of each trajectory: the model segment of each row (its sampled ids and their
    sampler log-probs), cut at the turn's end (`turn_end`)."""
    first = not any(segments)
    if not first and settings.decode == "auto":  # a later turn's rows and length change every turn: a
        settings = replace(settings, decode="dynamic")  # compiled step would compile again for each shape
    inputs = (generation_inputs(model, processor, rows[::settings.group_size], settings) if first else
              encode_trajectories(processor, rows, segments, next(model.parameters()).device))
    stop_ids = stop_token_ids(processor, model)
    banned = sorted(set(suppressed_token_ids(processor, stop_ids)) - tool_tag_ids(processor.tokenizer))
    from transformers import StopStringCriteria, StoppingCriteriaList

    # a call ends the turn (a criterion, not `stop_strings`: generate drops its tokenizer for a custom loop)
    stops = {"stopping_criteria": StoppingCriteriaList([StopStringCriteria(processor.tokenizer, [TOOL_CALL_CLOSE])])}
    new, logprobs = sample(model, processor, inputs | stops, settings, banned)  # (n, t) each; logprobs None: greedy
    picked = None if logprobs is None else logprobs.tolist()  # one copy to the host, not one per row
    turns = []
    for i, row in enumerate(new.tolist()):
        end = turn_end(row, stop_ids, processor.tokenizer)
        turns.append(Segment(row[:end], model=True, logprobs=[] if picked is None else picked[i][:end]))
    return turns


@dataclass
class Ongoing:
    """One trajectory being sampled: its prompt, its segments (tokens) and its turns (text)."""

    example: Example
    segments: list[Segment]
    trajectory: Trajectory

    @property
    def used(self) -> int:
        """Tokens after the prompt so far, the model's and the tools'."""
        return sum(len(s.ids) for s in self.segments)

    def context(self, settings: RolloutConfig) -> ToolContext:
        """What a tool called in this trajectory reads: the example's originals, the tool image side."""
        return ToolContext(self.example.originals, max_side=settings.tool_image_side, videos=self.example.video_originals)

    def pending_call(self, turn: Segment, processor, settings: RolloutConfig) -> ToolCall | None:
        """The call `add_turn` will run for the model's `turn`: one that fits the token budget, parses, and
        leaves a turn to read its result; else None."""
        text = turn_text(processor.tokenizer, turn.ids[:max(settings.max_trajectory_tokens - self.used, 0)])
        turns = len([t for t in self.trajectory.turns if t.role == "assistant"]) + 1
        call = parse_tool_call(text) if ends_with_call(text) and turns < settings.max_turns else None
        return call if isinstance(call, ToolCall) else None

    def add_turn(self, turn: Segment, processor, toolbox: ToolBox) -> bool:
        """Append the model's `turn`; when it ends in a call, run the tool and append its result.
        Returns whether the trajectory goes on (a result was appended and turns and tokens are left)."""
        settings = toolbox.settings
        left = max(settings.max_trajectory_tokens - self.used, 0)
        ids = turn.ids[:left]
        text = turn_text(processor.tokenizer, ids)
        self.segments.append(Segment(ids, model=True, logprobs=turn.logprobs[:left]))
        if not ends_with_call(text):
            self.trajectory.turns.append(Turn("assistant", text))
            return False
        parsed = parse_tool_call(text)
        call = parsed if not hasattr(parsed, "error") else None
        self.trajectory.turns.append(Turn("assistant", text, call=call))
        if len([t for t in self.trajectory.turns if t.role == "assistant"]) >= settings.max_turns:
            self.trajectory.cut = True  # a call with no turn left to read its result
            return False
        result = parsed if call is None else run_tool(call, toolbox.tools, self.context(settings), toolbox.limits)
        shown = tool_result_text(result, family_markers(processor))  # its text cannot add an image or end a turn
        segment = tool_turn(processor, self.example, shown, result.images, result.videos)
        if self.used + len(segment.ids) >= settings.max_trajectory_tokens:
            self.trajectory.cut = True  # the result does not fit in the token budget
            return False
        self.segments.append(segment)
        frames = [frame for video in result.videos for frame in video.frames]
        self.trajectory.turns.append(Turn("tool", segment.text, frames + list(result.images), error=result.error))
        return True


@torch.no_grad()
def generate_trajectories(model, processor, examples: list[Example], toolbox: ToolBox,
                          seed: int | None = None) -> ToolRollout:
    """`toolbox.settings.group_size` trajectories for each example (rows i*G .. i*G+G-1 answer
    example i), with tool calls run between turns; reproducible with `seed`."""
    settings = toolbox.settings
    if seed is not None:
        torch.manual_seed(seed)
    for tool in toolbox.tools.values():
        if isinstance(tool, ModelTool):  # a model tool runs where the policy runs
            tool.device = str(next(model.parameters()).device)
    before = cache_counts(toolbox.tools)
    ongoing = [Ongoing(ex, [], Trajectory()) for ex in examples for _ in range(settings.group_size)]
    active = list(range(len(ongoing)))
    while active:
        turns = sample_turn(model, processor, [ongoing[i].example for i in active],
                            [ongoing[i].segments for i in active], settings)
        prefetch_model_calls([ongoing[i] for i in active], turns, processor, toolbox)
        active = [i for i, turn in zip(active, turns) if ongoing[i].add_turn(turn, processor, toolbox)]
    rollout = as_rollout(ongoing, processor.tokenizer.pad_token_id, stop_token_ids(processor, model))
    rollout.cache_counts = added_counts(cache_counts(toolbox.tools), before, sign=-1)
    return rollout


def prefetch_model_calls(rows: list[Ongoing], turns: list[Segment], processor, toolbox: ToolBox) -> None:
    """The model tools' calls of this turn computed together, in one forward per tool (`ModelTool.prefetch`):
    each call then runs as usual (`add_turn`), answered from its tool's cache."""
    if not any(isinstance(tool, ModelTool) for tool in toolbox.tools.values()):
        return
    by_tool: dict[ModelTool, list] = {}
    for row, turn in zip(rows, turns):
        call = row.pending_call(turn, processor, toolbox.settings)
        tool = None if call is None else toolbox.tools.get(call.name)
        if isinstance(tool, ModelTool) and isinstance(call.arguments, dict):
            by_tool.setdefault(tool, []).append((row.context(toolbox.settings), call.arguments))
    for tool, calls in by_tool.items():
        tool.prefetch(calls)


CacheCounts = dict[str, tuple[int, int]]
"""Per cached tool by name: (calls, answers computed); calls - computed were answered from its cache."""


def cache_counts(tools: dict) -> CacheCounts:
    """The counters so far of each cached tool among `tools` (the model tools, find_objects, measure:
    `counts_of`)."""
    return {name: counts for name, tool in tools.items() if (counts := counts_of(tool)) is not None}


def added_counts(first: CacheCounts, second: CacheCounts, sign: int = 1) -> CacheCounts:
    """`first` + `second` per tool and counter (`sign` -1: `first` - `second`)."""
    return {name: (first.get(name, (0, 0))[0] + sign * second.get(name, (0, 0))[0],
                   first.get(name, (0, 0))[1] + sign * second.get(name, (0, 0))[1]) for name in {**first, **second}}


def cache_statistics(counts: CacheCounts) -> dict[str, float]:
    """Per cached tool: `<name>/calls`, its calls, and `<name>/cache_hit_rate`, the share of them answered from
    its cache, (calls - computed) / calls in [0, 1] (a prefetch may compute a call that is then not run);
    no rate for a tool not called."""
    stats = {}
    for name, (calls, computed) in sorted(counts.items()):
        stats[f"{name}/calls"] = float(calls)
        if calls > 0:
            stats[f"{name}/cache_hit_rate"] = min(max(calls - computed, 0) / calls, 1.0)
    return stats


def as_rollout(ongoing: list[Ongoing], pad_id: int, stop_ids: list[int]) -> ToolRollout:
    """The trajectories as a ToolRollout: every token after the prompt, the model's marked, and
    the sampler's log-probs of the model's tokens when every model turn recorded them."""
    rows = [[i for s in o.segments for i in s.ids] for o in ongoing]
    marks = [[int(s.model) for s in o.segments for _ in s.ids] for o in ongoing]
    length = max(max((len(r) for r in rows), default=0), 1)  # T
    ids = torch.tensor([r + [pad_id] * (length - len(r)) for r in rows])  # (N, T)
    mask = torch.tensor([m + [0] * (length - len(m)) for m in marks])  # (N, T)
    model_turns = [s for o in ongoing for s in o.segments if s.model]
    recorded = bool(model_turns) and all(len(s.logprobs) == len(s.ids) for s in model_turns)
    logps = [[p for s in o.segments for p in (s.logprobs if s.model else [0.0] * len(s.ids))] for o in ongoing]
    sampler_logp = torch.tensor([p + [0.0] * (length - len(p)) for p in logps]) if recorded else None  # (N, T)
    for o in ongoing:  # a last turn that neither stopped nor called ran out of tokens
        last = o.segments[-1].ids if o.segments else []
        o.trajectory.cut |= not (last and last[-1] in stop_ids) and not o.trajectory.turns[-1].call
    return ToolRollout(rows=[o.example for o in ongoing], completion_ids=ids, completion_mask=mask,
                       texts=[o.trajectory.final_text for o in ongoing],
                       truncated=torch.tensor([o.trajectory.cut for o in ongoing]), sampler_logp=sampler_logp,
                       segments=[o.segments for o in ongoing], trajectories=[o.trajectory for o in ongoing])


def trajectory_statistics(rollout: ToolRollout) -> dict[str, torch.Tensor]:
    """Per trajectory (N,): tool calls, invalid calls (errors), model turns, and whether it was cut
    by the turn or token limit."""
    trajectories = rollout.trajectories
    return {
        "calls": torch.tensor([float(sum(t.role == "assistant" and ends_with_call(t.text) for t in tr.turns))
                               for tr in trajectories]),
        "invalid_calls": torch.tensor([float(len(tr.errors)) for tr in trajectories]),
        "turns": torch.tensor([float(sum(t.role == "assistant" for t in tr.turns)) for tr in trajectories]),
        "cut": torch.tensor([float(tr.cut) for tr in trajectories]),
    }


def reference_rollout(processor, examples: list[Example], toolbox: ToolBox, stop_ids: list[int]) -> ToolRollout:
    """The reference trajectories of `examples` for SFT: each example's `meta["reference_turns"]`
    (the model's turns as text, the first ones ending in calls) with the calls run between them,
    exactly as a rollout would build them; the last turn ends with the stop token."""
    ongoing = [Ongoing(ex, [], Trajectory()) for ex in examples]
    for trajectory in ongoing:
        for text in trajectory.example.meta["reference_turns"]:
            ids = processor.tokenizer(text, add_special_tokens=False).input_ids
            turn = Segment(ids + ([] if ends_with_call(text) else stop_ids[:1]), model=True)
            if not trajectory.add_turn(turn, processor, toolbox):
                break
    return as_rollout(ongoing, processor.tokenizer.pad_token_id, stop_ids)
