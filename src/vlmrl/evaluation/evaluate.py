"""Evaluation on held-out examples: is the model right, and is it looking at the image?

`evaluate` answers a fixed list of examples and returns plain, JSON-ready numbers:

- greedy accuracy, the mean of every reward component (the run's `rewards` list, `settings.rewards`,
  else the task's own score; each over the answers it applies to), completion length in tokens and
  the share of completions cut off at `max_new_tokens`. Accuracy is the reward that measures
  correctness (rewards/reward.py `accuracy_source`: one logged as `accuracy`, else the first built-in
  verifier, else the task's own score's accuracy); an answer it gives None counts as not right;
- accuracy by completion-length bucket (quantiles of the greedy lengths), to see whether longer
  reasoning helps, hurts, or peaks in the middle (an inverted U);
- pass@k (optional): k sampled completions per example, scored with the unbiased estimator of
  Chen et al. (2021); with exactly k samples it equals "any of the k is correct";
- a blind-image check (optional): the same questions with a blank image of the same size, and with
  another example's image (a fixed derangement), greedy. A model that reads the image loses
  accuracy; one that guesses from the text alone does not. Where the examples have videos, the
  check goes on in time (`TIME_CONTROLS`): each video as its middle frame alone, its frames in a
  random order (not its own, another per video, fixed by the seed), and its frames reversed, each
  frame keeping its slot's time. A model that
  reads the order of the frames loses accuracy on all three (on the motion task the reversed video
  asks for the opposite answer); one that reads a single frame keeps it.

Generation goes through `vlmrl.rollout.generation.generate_groups`, in batches, under one progress bar. It
is deterministic for a given seed and leaves the caller's random state as it was, so the trainer
can call it every N steps on the same held-out set. The arithmetic (`summarize`, `pass_at_k`,
`length_buckets`, `mean_scores`, `derangement`) is separate from generation and tested by hand.
`EvalSettings` (how an evaluation runs) lives in the torch-free `vlmrl.evaluation.eval_settings`, so the
`vlmrl eval` flags read their defaults from it; it is re-exported here.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image
from tqdm import tqdm

from vlmrl.config import MAX_EVAL_EXAMPLES, GenerationSettings, RolloutConfig, saved_dict
from vlmrl.disk import output_folder, safe_filename, write_text
from vlmrl.errors import VlmrlError, warn
from vlmrl.evaluation.eval_settings import (
    EvalSettings,  # re-exported: `from vlmrl.evaluation.evaluate import EvalSettings`
)
from vlmrl.rollout.generation import generate_groups
from vlmrl.rollout.sampling import broken_logits_cause, non_finite_parameters, take_broken_rows
from vlmrl.report.rollout_log import trace_of
from vlmrl.rewards.checks import check_rewards
from vlmrl.rewards.reward import Reward, evaluation_rewards
from vlmrl.rollout.scoring import score_completions
from vlmrl.rollout.tool_rollout import (ToolBox, added_counts, cache_statistics, generate_trajectories,
                                        trajectory_statistics)
from vlmrl.seeds import derive_seed
from vlmrl.tasks import Example, Task, Video
from vlmrl.tools.contract import ToolLimits
from vlmrl.tools.registry import resolve_tools

BLANK_COLOR = "white"
"""Colour of the blank image in the blind check (the background of the built-in tasks)."""


@dataclass
class Evaluation:
    """What `evaluate` returns: summary numbers, one record per example, and how it was run."""

    results: dict
    """Summary numbers (keys in `summarize`'s docstring); JSON-ready."""
    records: list[dict]
    """Per example: where it comes from (split, idx; a data row's row, source_split, id), prompt, answer,
    greedy completion, its scores and length, samples, blind answers."""
    settings: dict = field(default_factory=dict)
    """Task name and parameters and the EvalSettings; callers add the model and split."""


# ---------------------------------------------------------------- pure arithmetic


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k from `samples` completions of which `correct` are right (Chen et al. 2021):
    1 - C(samples - correct, k) / C(samples, k). With samples == k: 1.0 if any is right, else 0.0."""
    if not 0 < k <= samples or not 0 <= correct <= samples:
        raise ValueError(f"need 0 < k <= samples and 0 <= correct <= samples; got {samples=} {correct=} {k=}")
    if samples - correct < k:
        return 1.0
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def mean_scores(scores: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each reward component over the rows that have it, in first-seen key order."""
    totals: dict[str, list[float]] = {}
    for row in scores:
        for name, value in row.items():
            totals.setdefault(name, []).append(float(value))
    return {name: sum(values) / len(values) for name, values in totals.items()}


def length_buckets(lengths: list[int], correct: list[float], buckets: int) -> list[dict]:
    """Accuracy by completion length, in `buckets` quantile buckets of `lengths`.

    Edges are the lengths at ranks n*i/buckets (i = 1..buckets-1) of the sorted lengths; bucket i
    holds lengths in [edge_i, edge_{i+1}), so equal lengths always share a bucket and a bucket may
    hold more or fewer than n/buckets rows; empty buckets are left out. Each bucket reports its
    observed min_tokens and max_tokens, n and accuracy.
    """
    if len(lengths) != len(correct):
        raise ValueError(f"{len(lengths)} lengths but {len(correct)} correctness values")
    if not lengths:
        return []
    ordered = sorted(lengths)
    inner = sorted({ordered[len(ordered) * i // buckets] for i in range(1, buckets)} - {ordered[0]})
    edges = [ordered[0], *inner, math.inf]
    rows = []
    for low, high in zip(edges, edges[1:]):
        inside = [(n, c) for n, c in zip(lengths, correct) if low <= n < high]
        if inside:
            rows.append({"min_tokens": min(n for n, _ in inside), "max_tokens": max(n for n, _ in inside),
                         "n": len(inside), "accuracy": sum(c for _, c in inside) / len(inside)})
    return rows


def shuffled_order(n: int, seed: str) -> list[int]:
    """A permutation of range(n) drawn uniformly from all but the identity (n >= 2), fixed by `seed`:
    the order of a video's frames in the shuffled-frames check (a derangement would not do: among
    the 4-cycles of 4 frames only one in six keeps the last frame after the first)."""
    if n < 2:
        raise ValueError(f"a shuffled order needs at least 2 items, got {n}")
    rng, order = random.Random(f"frames:{seed}:{n}"), list(range(n))
    while order == sorted(order):
        rng.shuffle(order)
    return order


def derangement(n: int, seed: int) -> list[int]:
    """A permutation p of range(n) with p[i] != i for every i (n >= 2), fixed by `seed`.

    Sattolo's algorithm: a uniformly random single cycle, which never maps an index to itself.
    n < 2 has no derangement: ValueError.
    """
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 items, got {n}")
    rng = random.Random(f"derangement:{seed}:{n}")
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)  # j < i: no element stays in place
        order[i], order[j] = order[j], order[i]
    return order


def blank_images(examples: list[Example]) -> list[Example]:
    """Each example with blank images of the same sizes and modes (the originals that tools read too),
    and blank videos of the same frames and times (their originals too)."""
    def blank(images: list[Image.Image]) -> list[Image.Image]:
        return [Image.new(image.mode, image.size, BLANK_COLOR) for image in images]

    def blank_videos(videos: list[Video]) -> list[Video]:
        return [Video(blank(list(v.frames)), v.timestamps) for v in videos]

    return [replace(ex, images=blank(ex.images), originals=blank(ex.originals), videos=blank_videos(ex.videos),
                    video_originals=blank_videos(ex.video_originals)) for ex in examples]


def shuffled_images(examples: list[Example], seed: int) -> tuple[list[Example], list[int]]:
    """Each example with another example's images and videos (a derangement), and which one it got."""
    source = derangement(len(examples), seed)
    return [replace(ex, images=examples[j].images, originals=examples[j].originals, videos=examples[j].videos,
                    video_originals=examples[j].video_originals) for ex, j in zip(examples, source)], source


TIME_CONTROLS = ("single_frame", "shuffled_frames", "reversed_frames")
"""The blind checks in time, run where the examples have videos (see the module docstring)."""


def with_frames(examples: list[Example], reorder) -> list[Example]:
    """Each example with every video's frames replaced by `reorder(frames, times, key)` -> (frames,
    times); key: "i:k" for video k of example i. The videos the tools read (`video_originals`, the
    full videos a task may show fewer frames of) get the same check, each by its own frames: a
    `frames` call cannot see past the check."""
    def redo(videos: list[Video], i: int) -> list[Video]:
        return [Video(*reorder(list(video.frames), list(video.timestamps), f"{i}:{k}")) for k, video in enumerate(videos)]

    return [replace(ex, videos=redo(ex.videos, i), video_originals=redo(ex.video_originals, i))
            for i, ex in enumerate(examples)]


def time_controls(examples: list[Example], seed: int) -> dict[str, list[Example]]:
    """The examples under each of `TIME_CONTROLS`: the middle frame ((n - 1) // 2) alone at its time;
    the frames in a random order other than their own, fixed by the seed and the video
    (`shuffled_order(n, "seed:i:k")`, another per video, so that the order a model would read is a
    fresh one each time; a one-frame video stays as it is); the frames reversed. Shuffled and reversed
    frames keep the slots' times."""
    def middle(frames, times, key):
        return [frames[(len(frames) - 1) // 2]], [times[(len(frames) - 1) // 2]]

    def shuffled(frames, times, key):
        order = shuffled_order(len(frames), f"{seed}:{key}") if len(frames) > 1 else [0]
        return [frames[j] for j in order], times

    return {"single_frame": with_frames(examples, middle), "shuffled_frames": with_frames(examples, shuffled),
            "reversed_frames": with_frames(examples, lambda frames, times, key: (frames[::-1], times))}


# ---------------------------------------------------------------- generation


@dataclass
class _Answers:
    """Completions of a list of examples, in order (G per example, contiguous)."""

    texts: list[str]
    lengths: list[int]  # tokens, end-of-turn token included (the model's only, with tools)
    truncated: list[bool]
    scores: list[dict[str, float]]
    turns: list[list[dict]] = field(default_factory=list)  # with tools: each answer's turns (text only)
    tool_stats: list[dict[str, float]] = field(default_factory=list)  # with tools: calls, invalid calls, ...
    cache_counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # cached tool -> (calls, computed)


def _answer(sample, rewards: list[Reward], examples: list[Example], prompts_per_call: int,
            progress: tqdm) -> _Answers:
    """Generate (`sample(batch, first index)` -> Rollout) and score completions of every example with
    `rewards` (`evaluation_rewards`), a batch at a time; a component that does not apply to an answer
    (None) is left out of its scores."""
    answers = _Answers([], [], [], [])
    for start in range(0, len(examples), prompts_per_call):
        rollout = sample(examples[start:start + prompts_per_call], start)
        columns = score_completions(rewards, rollout)  # name -> (N,), NaN: does not apply
        answers.texts += rollout.texts
        answers.lengths += rollout.lengths.tolist()
        answers.truncated += rollout.truncated.tolist()
        answers.scores += [{name: float(values[i]) for name, values in columns.items() if not values[i].isnan()}
                           for i in range(len(rollout.texts))]
        if getattr(rollout, "trajectories", None) is not None:
            stats = trajectory_statistics(rollout)  # name -> (N,)
            answers.tool_stats += [{name: float(v[i]) for name, v in stats.items()} for i in range(len(rollout.texts))]
            answers.cache_counts = added_counts(answers.cache_counts, rollout.cache_counts)
            answers.turns += [[{"role": t.role, "text": t.text, "images": len(t.images), "error": t.error}
                               for t in trajectory.turns] for trajectory in rollout.trajectories]
        progress.update(1)
    return answers


def _sampler(model, processor, settings: EvalSettings):
    """`sample(rows, generation)` -> a function of (batch, first index) giving a Rollout: single-turn,
    or multi-turn with `settings.tools`; seeded from (seed, "eval", first index)."""
    tools = resolve_tools(settings.tools, settings.tool_models)  # once, and an unknown tool is an error before any generation

    def sample(generation: GenerationSettings):
        rollout = _tool_settings(settings, generation)
        toolbox = ToolBox(rollout, tools, ToolLimits(timeout_s=rollout.tool_timeout_s)) if tools else None

        def run(batch: list[Example], start: int):
            seed = derive_seed(settings.seed, "eval", start)
            if toolbox is None:
                rollout = generate_groups(model, processor, batch, generation, seed=seed)
            else:
                rollout = generate_trajectories(model, processor, batch, toolbox, seed=seed)
            stop_at_broken_logits(model)
            return rollout
        return run
    return sample


def stop_at_broken_logits(model) -> None:
    """One line naming the cause when the model sampled from NaN/inf logits (sampling.py), at the first
    batch that did. Within a run of several processes the trainer's next check stops every process
    together instead (an error on the evaluating process alone would leave the others waiting)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return
    if rows := take_broken_rows(model):
        raise VlmrlError(f"evaluation stopped: {broken_logits_cause(rows, non_finite_parameters(model))}")


def _tool_settings(settings: EvalSettings, generation: GenerationSettings) -> RolloutConfig:
    """The rollout settings of a multi-turn answer: `generation`'s sampling, `settings`' tools and limits."""
    return RolloutConfig(**vars(generation), tools=list(settings.tools), tool_models=dict(settings.tool_models),
                         max_turns=settings.max_turns,
                         max_trajectory_tokens=settings.max_trajectory_tokens,
                         tool_image_side=settings.tool_image_side)


def _calls(n: int, per_call: int) -> int:
    return -(-n // per_call)


def held_out_count(task: Task, split: str, n: int) -> int:
    """How many examples of `split` an evaluation asking for `n` takes: n, or all the rows of a split
    that holds fewer (a file-backed task's `size`), each once, with a warning saying so: examples past
    the split's rows would repeat rows and count them twice. VlmrlError for a bad split or n."""
    task.check_split(split)
    if not 1 <= n <= MAX_EVAL_EXAMPLES:  # all are made first: a 20-digit n would never start
        raise VlmrlError(f"the number of examples must be in [1, {MAX_EVAL_EXAMPLES:,}], got {n}")
    rows = task.size(split) if hasattr(task, "size") else None
    if rows is None or rows >= n:
        return n
    if rows < 1:
        raise VlmrlError(f"task {task.name!r} split {split!r} has no rows to evaluate")
    warn(f"split {split!r} of task {task.name!r} holds {rows} rows: evaluating those {rows}, each once "
         f"(not the {n} asked for)")
    return rows


def held_out_examples(task: Task, split: str = "test", n: int = 64) -> list[Example]:
    """Examples 0..n-1 of `split`, or every row of a split that holds fewer, each once
    (`held_out_count`): the same fixed set every time (VlmrlError for a bad split or n)."""
    return [task.example(i, split=split) for i in range(held_out_count(task, split, n))]


def evaluate(model, processor, task: Task, examples: list[Example], settings: EvalSettings | None = None,
             show_progress: bool = True) -> Evaluation:
    """Answer `examples` and measure accuracy, pass@k, rewards, lengths and the blind-image drop.

    Returns the summary (`results`, keys in `summarize`), one record per example and the settings.
    The model is put in eval mode and given back in the mode it had; the global random state is
    left untouched, so the trainer's sampling does not change when it evaluates.
    """
    settings = settings or EvalSettings()
    settings.validate()
    if not examples:
        raise VlmrlError("nothing to evaluate: the list of examples is empty")
    was_training = model.training
    model.eval()
    try:
        passes = _generate_passes(model, processor, task, examples, settings, show_progress)
    finally:
        model.train(was_training)
    k = settings.k
    samples_correct = None
    if passes.samples is not None:
        sample_correct = [row.get("accuracy", 0.0) for row in passes.samples.scores]  # (n*k,)
        samples_correct = [round(sum(sample_correct[i * k:(i + 1) * k])) for i in range(len(examples))]
    results = summarize(
        task.name, passes.real.scores, passes.real.lengths, passes.real.truncated,
        samples_correct=samples_correct, k=k, temperature=settings.temperature,
        blank_correct=_correct(passes.blank), shuffled_correct=_correct(passes.shuffled),
        buckets=settings.length_buckets, time_correct={name: _correct(a) for name, a in passes.time.items()})
    if passes.real.tool_stats:  # means over the greedy answers: calls, invalid_calls, turns, cut
        results["tools"] = mean_scores(passes.real.tool_stats)
    if passes.real.cache_counts:  # the greedy pass's calls of each cached tool, and the share answered from its cache
        results["tool_cache"] = cache_statistics(passes.real.cache_counts)
    records = _records(examples, passes, samples_correct, k)
    run_settings = {"task": task.name, "task_params": asdict(task.params), **saved_dict(settings)}  # no secret
    return Evaluation(results=results, records=records, settings=run_settings)


@dataclass
class _Passes:
    """Every generation pass of one evaluation; None where a pass was not asked for (or n < 2)."""

    real: _Answers  # greedy, real images
    samples: _Answers | None  # k sampled per example, real images
    blank: _Answers | None  # greedy, blank images
    shuffled: _Answers | None  # greedy, example i shows the image of example shuffle_source[i]
    shuffle_source: list[int] | None
    time: dict[str, _Answers] = field(default_factory=dict)  # greedy, per TIME_CONTROLS (videos only)


def _generate_passes(model, processor, task: Task, examples: list[Example], settings: EvalSettings,
                     show_progress: bool) -> _Passes:
    """Run the greedy, sampled and blind passes under one progress bar and a forked random state."""
    n, k, batch = len(examples), settings.k, settings.batch_size
    greedy = GenerationSettings(group_size=1, max_new_tokens=settings.max_new_tokens, temperature=0,
                                decode=settings.decode)
    greedy.validate()  # the decode path is one of DECODES
    sampled = GenerationSettings(group_size=max(k, 1), max_new_tokens=settings.max_new_tokens,
                                 temperature=settings.temperature, top_p=settings.top_p, decode=settings.decode)
    sampling_batch = max(1, batch // max(k, 1))  # prompts per call, k completions each
    in_time = settings.blind_check and any(ex.videos for ex in examples)
    blind_passes = ((2 if n >= 2 else 1) + (len(TIME_CONTROLS) if in_time else 0)) if settings.blind_check else 0
    calls = _calls(n, batch) * (1 + blind_passes) + (_calls(n, sampling_batch) if k else 0)
    device = next(model.parameters()).device
    sample = _sampler(model, processor, settings)
    rewards = evaluation_rewards(settings.rewards, task)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            tqdm(total=calls, desc=f"eval {task.name}", unit="batch", disable=not show_progress,
                 dynamic_ncols=True) as progress:

        def answer(rows: list[Example], generation: GenerationSettings, per_call: int) -> _Answers:
            return _answer(sample(generation), rewards, rows, per_call, progress)

        passes = _Passes(real=answer(examples, greedy, batch), samples=None, blank=None, shuffled=None,
                         shuffle_source=None)
        if k:
            progress.set_description(f"eval {task.name} pass@{k}")
            passes.samples = answer(examples, sampled, sampling_batch)
        if settings.blind_check:
            progress.set_description(f"eval {task.name} blind")
            passes.blank = answer(blank_images(examples), greedy, batch)
            if n >= 2:
                moved, passes.shuffle_source = shuffled_images(examples, settings.seed)
                passes.shuffled = answer(moved, greedy, batch)
            if in_time:
                passes.time = {name: answer(rows, greedy, batch)
                               for name, rows in time_controls(examples, settings.seed).items()}
    return passes


def _correct(answers: _Answers | None) -> list[float] | None:
    return None if answers is None else [row.get("accuracy", 0.0) for row in answers.scores]


def summarize(task_name: str, scores: list[dict[str, float]], lengths: list[int], truncated: list[bool],
              samples_correct: list[int] | None = None, k: int = 0, temperature: float = 1.0,
              blank_correct: list[float] | None = None, shuffled_correct: list[float] | None = None,
              buckets: int = 4, time_correct: dict[str, list[float]] | None = None) -> dict:
    """The results dict from per-example numbers (row i of every list is example i).

    `scores`, `lengths`, `truncated`: the greedy completions' reward components, token counts and
    cut-offs; `samples_correct[i]`: how many of example i's k samples are right; `blank_correct` and
    `shuffled_correct`: greedy accuracy (0/1) with the blank and the shuffled image; `time_correct`:
    the same under each of `TIME_CONTROLS` that ran (videos only).

    Keys: task, n, accuracy (greedy), rewards (mean of each component), completion_tokens (mean,
    end-of-turn token included), truncated (share cut at max_new_tokens), by_length (list of
    {min_tokens, max_tokens, n, accuracy}), pass_at_k (None, or {k, temperature, pass@1, pass@k}:
    unbiased estimator from k samples, so pass@1 is the samples' mean accuracy and pass@k the share
    of examples with any sample right), blind (None, or {blank, shuffled} and, with videos,
    {single_frame, shuffled_frames, reversed_frames}, each None or {accuracy, drop}; drop = greedy
    accuracy - blind accuracy, positive when the image, or the frames' order, helps).
    """
    n = len(scores)
    correct = [row.get("accuracy", 0.0) for row in scores]  # None (left out): not right
    accuracy = sum(correct) / n
    results = {
        "task": task_name,
        "n": n,
        "accuracy": accuracy,
        "rewards": mean_scores(scores),
        "completion_tokens": sum(lengths) / n,
        "truncated": sum(truncated) / n,
        "by_length": length_buckets(lengths, correct, buckets),
        "pass_at_k": None,
        "blind": None,
    }
    if samples_correct is not None:
        results["pass_at_k"] = {
            "k": k, "temperature": temperature,
            "pass@1": sum(pass_at_k(k, c, 1) for c in samples_correct) / n,
            "pass@k": sum(pass_at_k(k, c, k) for c in samples_correct) / n,
        }
    if blank_correct is not None or shuffled_correct is not None:
        results["blind"] = {name: None if values is None else {
            "accuracy": sum(values) / n, "drop": accuracy - sum(values) / n}
            for name, values in (("blank", blank_correct), ("shuffled", shuffled_correct),
                                 *(time_correct or {}).items())}
    return results


def _records(examples: list[Example], passes: _Passes, samples_correct: list[int] | None,
             k: int) -> list[dict]:
    """One JSON-ready record per example: where it comes from (`trace_of`: split, idx, and for a data
    file's row its row, source_split and id), question, gold answer, every answer the model gave."""
    records = []
    for i, example in enumerate(examples):
        real = passes.real
        trace = trace_of(example)  # split, idx; a data file's row, source_split and id
        record = {**trace, "idx": i if trace["idx"] is None else trace["idx"], "prompt": example.prompt,
                  "answer": example.answer, "completion": real.texts[i],
                  "completion_tokens": real.lengths[i], "truncated": real.truncated[i],
                  "scores": real.scores[i]}
        if real.turns:
            record["turns"] = real.turns[i]
        if passes.samples is not None:
            record["samples"] = passes.samples.texts[i * k:(i + 1) * k]
            record["samples_correct"] = samples_correct[i]
        if passes.blank is not None:
            record["blank"] = {"completion": passes.blank.texts[i],
                               "accuracy": passes.blank.scores[i].get("accuracy", 0.0)}
        if passes.shuffled is not None:
            record["shuffled"] = {"image_from": passes.shuffle_source[i],
                                  "completion": passes.shuffled.texts[i],
                                  "accuracy": passes.shuffled.scores[i].get("accuracy", 0.0)}
        for name, answers in passes.time.items():
            record[name] = {"completion": answers.texts[i], "accuracy": answers.scores[i].get("accuracy", 0.0)}
        records.append(record)
    return records


# ---------------------------------------------------------------- reporting


def scalar_metrics(results: dict, prefix: str = "eval/") -> dict[str, float]:
    """The headline numbers as a flat dict for a metrics log: accuracy, rewards, lengths, pass@k,
    blind accuracies and drops (by_length is left out)."""
    flat = {"accuracy": results["accuracy"], "completion_tokens": results["completion_tokens"],
            "truncated": results["truncated"]}
    flat |= {f"reward/{name}": value for name, value in results["rewards"].items()}
    if results["pass_at_k"]:
        flat |= {"pass@1": results["pass_at_k"]["pass@1"], "pass@k": results["pass_at_k"]["pass@k"]}
    for kind, summary in (results["blind"] or {}).items():
        if summary:
            flat |= {f"{kind}/accuracy": summary["accuracy"], f"{kind}/drop": summary["drop"]}
    flat |= {f"tools/{name}": value for name, value in (results.get("tools") or {}).items()}
    flat |= {f"tools/{name}": value for name, value in (results.get("tool_cache") or {}).items()}
    return {prefix + name: float(value) for name, value in flat.items()}


def format_table(results: dict) -> str:
    """The results as a few aligned text tables for a terminal."""
    n = results["n"]
    lines = [f"{results['task']}: {n} examples",
             f"  {'greedy accuracy':<26}{results['accuracy']:>8.1%}"]
    if results["pass_at_k"]:
        sampling = results["pass_at_k"]
        label = f"(k={sampling['k']}, T={sampling['temperature']:g})"
        lines += [f"  {'pass@1 ' + label:<26}{sampling['pass@1']:>8.1%}",
                  f"  {'pass@' + str(sampling['k']):<26}{sampling['pass@k']:>8.1%}"]
    lines += [f"  {'completion tokens (mean)':<26}{results['completion_tokens']:>8.1f}",
              f"  {'truncated':<26}{results['truncated']:>8.1%}",
              "", "mean reward components (greedy)"]
    lines += [f"  {name:<26}{value:>8.3f}" for name, value in results["rewards"].items()]
    if results.get("tools"):
        lines += ["", "tool use per answer (greedy, mean)"]
        lines += [f"  {name:<26}{value:>8.2f}" for name, value in results["tools"].items()]
    if results.get("tool_cache"):
        lines += ["", "cached tools (greedy): calls, and the share answered from the cache"]
        lines += [f"  {name:<30}{value:>8.4g}" for name, value in results["tool_cache"].items()]
    lines += ["", "accuracy by completion length (greedy)", f"  {'tokens':<16}{'n':>6}{'accuracy':>12}"]
    for bucket in results["by_length"]:
        low, high = bucket["min_tokens"], bucket["max_tokens"]
        span = str(low) if low == high else f"{low}-{high}"
        lines.append(f"  {span:<16}{bucket['n']:>6}{bucket['accuracy']:>12.1%}")
    if results["blind"]:
        lines += ["", "blind-image check (greedy)", f"  {'image':<16}{'accuracy':>10}{'drop':>12}",
                  f"  {'real':<16}{results['accuracy']:>10.1%}"]
        for kind in results["blind"]:  # blank, shuffled; with videos the checks in time
            summary = results["blind"][kind]
            if summary is None:
                lines.append(f"  {kind:<16}{'n/a (needs 2+ examples)':>22}")
            else:
                lines.append(f"  {kind:<16}{summary['accuracy']:>10.1%}{100 * summary['drop']:>+9.1f} pts")
    return "\n".join(lines)


def save_evaluation(evaluation: Evaluation, folder: str | Path, filename: str = "eval.json") -> Path:
    """Write {"results", "settings", "examples"} as JSON to folder/filename, whole or not at all (a
    bad path or a full disk is one line, disk.py); returns the path."""
    document = {"results": evaluation.results, "settings": evaluation.settings, "examples": evaluation.records}
    return write_text(Path(folder) / filename, "the evaluation", json.dumps(document, indent=2, default=str) + "\n")


def run_eval(model_dir: str, task_name: str | Task, task_params: dict, split: str = "test", n: int = 64,
             settings: EvalSettings | None = None, out_dir: str | None = None, dtype: str = "auto",
             device: str = "auto") -> tuple[Evaluation, Path]:
    """`vlmrl eval`: load the model folder, evaluate `n` examples of `split`, write the JSON.

    `task_name` is a task's name (built with `task_params`) or a Task built in Python (`vlmrl.evaluate`).
    The file is out_dir/eval.json, or model_dir/eval_<task>_<split>.json without `out_dir`.
    Task, split and settings are checked before the model loads; tools on a family whose tool rollouts
    are off (models/support.py) are refused in one line once it has, as the preflight refuses them.
    """
    from vlmrl.models import load_policy
    from vlmrl.models.context import check_generation_length
    from vlmrl.models.loading import resolve_device
    from vlmrl.models.support import tool_rollouts_unsupported
    from vlmrl.models.vision_attention import use_batched_vision_attention
    from vlmrl.tasks import get_task

    settings = settings or EvalSettings()
    settings.validate()
    resolve_device(device, "--device")
    task = task_name if isinstance(task_name, Task) else get_task(task_name, **task_params)
    examples = held_out_examples(task, split, n)
    check_rewards(evaluation_rewards(settings.rewards, task), task, examples[:8])  # before the model loads
    if out_dir is not None or Path(model_dir).is_dir():  # a bad output path in one line, before the model loads
        output_folder(out_dir if out_dir is not None else model_dir, "the evaluation")
    model, processor = load_policy(model_dir, dtype=dtype, device=device)
    check_generation_length(model, "--max-new-tokens", settings.max_new_tokens)
    if settings.tools:
        if (reason := tool_rollouts_unsupported(model)) is not None:  # as the preflight refuses rollout.tools
            raise VlmrlError(f"tools {settings.tools}: tool rollouts are off for this model ({reason}); evaluate it "
                             "without tools (--tools alone)")
        check_generation_length(model, "max_trajectory_tokens", settings.max_trajectory_tokens)
    use_batched_vision_attention(model, True)  # the same numbers, far fewer kernel launches
    evaluation = evaluate(model, processor, task, examples, settings)
    evaluation.settings = {"model": str(model_dir), "split": split, **evaluation.settings}
    if out_dir is not None:
        path = save_evaluation(evaluation, out_dir)
    else:
        named = task_name if isinstance(task_name, str) else task.name
        path = save_evaluation(evaluation, model_dir, safe_filename(f"eval_{named}_{split}.json"))
    return evaluation, path
