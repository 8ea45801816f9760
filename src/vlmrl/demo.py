"""`vlmrl demo` (`make demo`): reinforcement learning that works on a laptop CPU, offline.

The lesson of the scaling study, in minutes: SFT to learn the structure, then RL to go past the
demonstrations. The shapes demo learns from a weak teacher (its reference completions miscount the
most crowded 30% of images) and GRPO from the exact count.

1. build the small offline model (a Qwen2.5-VL architecture, random weights);
2. supervised warm start on the task's reference completions (`vlmrl sft`);
3. evaluate: held-out test accuracy, OOD accuracy, and the blind-image check;
4. GRPO from the warm start (`vlmrl train`);
5. evaluate again, write the report, print the before/after table.

Each phase is an ordinary run directory under the demo folder (`sft/`, `grpo/`), made by the same
code as `vlmrl sft` and `vlmrl train` with the preset below (printed as overrides, so every number
can be reproduced by hand). Running the demo again reuses finished phases and resumes an
interrupted one from its newest checkpoint; Ctrl-C saves a checkpoint and writes a partial report.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from vlmrl.config import Config, load_config
from vlmrl.evaluation.attention_maps import attention_maps
from vlmrl.evaluation.cell_attention import region_attention
from vlmrl.evaluation.evaluate import (
    TIME_CONTROLS,
    EvalSettings,
    evaluate,
    format_table,
    held_out_examples,
    save_evaluation,
)
from vlmrl.models import build_tiny_model, load_policy
from vlmrl.models.tiny_model import TINY_MODEL_VERSION, model_summary
from vlmrl.safety.checkpoint import latest_checkpoint
from vlmrl.tasks import run_task


@dataclass(frozen=True)
class DemoPreset:
    """One demo: the task and the overrides of each phase (applied to the default Config)."""

    shared: list[str]
    """Overrides of every phase: the task, its parameters, model settings."""
    sft: list[str]
    """Overrides of the warm start."""
    grpo: list[str]
    """Overrides of the RL phase."""
    eval_n: int
    """Held-out examples per split in the before/after evaluation."""
    max_new_tokens: int
    """Longest completion, in every phase."""
    size: str = "small"
    """The offline model to build (`vlmrl tiny-model --size`)."""
    tokenizer: str = "bpe"
    """Its tokenizer (`vlmrl tiny-model --tokenizer`)."""
    attention_n: int = 0
    """Held-out test examples on which the share of image attention that each answer part puts on
    its region of the image (`Task.answer_regions`: the cryptogram's decoded letters and their table
    cells) is measured before training, after SFT and after GRPO; 0: not measured."""
    curriculum: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """SFT stages before the warm start, in order: (name, overrides on top of `shared` and `sft`).
    Each starts from the model the stage before it ended with (the first from the offline model) and
    the warm start from the last; each is an ordinary run folder, `stages/NAME`, reused or resumed
    like the phases."""
    tool_arms: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Further evaluation arms of a preset with tools, on the same held-out test examples: (name, the
    tools the model may call), besides the run's own tools ("test") and none at all ("no_tools")."""


# Why the shapes preset looks like this (measured on 2 CPU cores; docs/results.md "What it took"):
# - large circles (0.17-0.2 of the side): the count reaches the random-init model as the share of
#   the image the circles cover; with the task's default sizes (0.08-0.13) that signal is ~3x
#   weaker and SFT sat at chance for 300+ steps, with these sizes it breaks out in ~50 steps;
# - the vision tower stays at its random weights (vision_lr_scale=0): its features already carry
#   the count, and steps are ~1.5x faster;
# - a weak teacher (teacher_error=0.3: the SFT data counts the most crowded 30% of images one
#   short) and 150 SFT steps on a cosine schedule: the warm start ends on the plateau of imitating
#   that teacher (~72%) rather than in the middle of its breakout, where it landed anywhere from
#   46.5% to 89.5% by CPU; GRPO, paid for the true count, is what goes past the teacher;
# - the strict rubric in GRPO: the chapter rubric pays no format, and the policy drifted into
#   repeated tags until every completion hit the length limit;
# - GRPO warms up (a fresh AdamW's first full-size steps undid the warm start) and decays on a
#   cosine schedule, so it keeps what it gained instead of drifting off at full learning rate.
DAPO_STYLE = ["rollout.temperature=1.0", "algorithm.beta=0", "algorithm.aggregation=token",
              "algorithm.eps_high=0.28"]
"""The RL settings every preset shares: sampling at temperature 1, no KL, token-level loss, clip-higher."""
GRPO_8X8 = ["rollout.prompts_per_step=8", "rollout.group_size=8", *DAPO_STYLE]
"""Every preset's GRPO phase: 8 prompts x 8 completions a step, DAPO-style."""
ONE_LETTER = ("task.params.vocabulary=strings", "task.params.min_word_length=1", "task.params.max_word_length=1",
              "task.params.min_words=1", "task.params.max_words=1", "task.params.held_out=pairs",
              "task.params.reference=pairs", "task.params.pair_breaks=false", "task.params.walk_commas=true",
              "sft.text_examples=0", "train.lr=1e-3")
"""The one-letter messages of the glyph cryptogram's first curriculum stages (on top of its words setting)."""
PRESETS = {
    "shapes": DemoPreset(
        shared=["task.name=shapes", "task.params.targets=[circle]", "task.params.distractors=false",
                "task.params.min_size=0.17", "task.params.max_size=0.2", "task.params.rubric=strict",
                "task.params.teacher_error=0.3", "model.vision_lr_scale=0"],
        sft=["sft.batch_size=32", "train.steps=150", "train.lr=1e-3", "train.warmup_steps=30",
             "train.schedule=cosine", "train.micro_batch_size=32", "train.save_every=50", "eval.every=50",
             "eval.n=64"],
        grpo=[*GRPO_8X8,
              "train.steps=60", "train.lr=1e-4", "train.warmup_steps=10", "train.schedule=cosine",
              "train.micro_batch_size=64", "train.save_every=10", "train.log_rollouts_every=5", "eval.every=10",
              "eval.n=200"],
        eval_n=400, max_new_tokens=40),
    # Why the cryptogram preset looks like this (issue 36; measured on 2 CPU cores, docs/results.md
    # "The cryptogram demo"): the random vision tower's features tell the letters apart (a ridge probe
    # on the merged-patch feature of a 28-px cell: 100%), yet the language model did not learn to
    # read them in 100-300 SFT steps, not even a single letter shown alone (teacher-forced letter
    # accuracy the same with the real and a shuffled image); what it reads at once is colour:
    # - tiles: each plain letter in white on a tile of its own colour (a single letter was read at
    #   100% by SFT step 50, against 29% with the glyph alone);
    # - a small alphabet (9 letters), two 3-letter words, each table entry in one 28-px cell (one
    #   image token), sorted by coded letter; the prompt is the coded message alone;
    # - entries=message: only the entries the message uses are filled in, so even attention spread
    #   over the whole image says which letters occur (with every entry filled, the image stayed
    #   unused through 300 steps: 50% teacher-forced with the real and a shuffled image);
    # - reference=pairs: each coded letter, then its plain letter, before <chars>, so a letter is
    #   looked up at the position of its coded letter (one step); with the <chars> block alone the
    #   model had to copy the coded letter first and ended at 7.5% exact; with pairs it breaks out
    #   between SFT steps 200 and 300 (96% exact); 64 new tokens hold the walk;
    # - held_out=messages_and_ciphers: no test message and no test cipher is ever trained on;
    # - GRPO at lr 2e-5: the warm start decodes every held-out <chars> block already, and at 1e-4
    #   GRPO drifted off it (held-out 93, 87, 86, 88, 89, 89% at steps 10-60); at 2e-5 it holds
    #   (93% at every evaluation on the same 100 messages).
    "cryptogram": DemoPreset(
        shared=["task.name=cryptogram", "task.params.letters=etaoinshr", "task.params.layout=grid",
                "task.params.cell_px=28", "task.params.entries_per_row=3", "task.params.tiles=true",
                "task.params.entries=message", "task.params.min_word_length=3", "task.params.max_word_length=3",
                "task.params.min_words=2", "task.params.max_words=2", "task.params.ood_extra_words=1",
                "task.params.instructions=false", "task.params.reference=pairs",
                "task.params.held_out=messages_and_ciphers", "model.vision_lr_scale=0"],
        sft=["sft.batch_size=32", "train.steps=500", "train.lr=1e-3", "train.warmup_steps=30",
             "train.schedule=cosine", "train.micro_batch_size=32", "train.save_every=100", "eval.every=100",
             "eval.n=64"],
        grpo=[*GRPO_8X8,
              "train.steps=60", "train.lr=2e-5", "train.warmup_steps=10", "train.schedule=cosine",
              "train.micro_batch_size=64", "train.save_every=10", "train.log_rollouts_every=5", "eval.every=10",
              "eval.n=100"],
        eval_n=200, max_new_tokens=64, attention_n=64),
    # Thinking with images (issue 15): zoom on the panel of the named tag, then name its pattern.
    # - symbols=patterns: each tag is a patch of fine lines (horizontal, vertical, checkered or
    #   diagonal; stripes 4 px wide, half a view pixel) on the view's 8 px grid, so the 56 px view
    #   shows every tag as the same flat tint (exactly: the view does not depend on the patterns) and
    #   the 112 px zoom of its panel shows the lines 2 px wide. Measured: 97% at SFT step 75 (1
    #   thread), where a 1-digit code on a card stayed at chance (6-17%) through 200 SFT steps: the
    #   random vision tower's pooled features tell the patterns apart linearly (100% with a ridge
    #   probe on 450 zooms), not digits (14%, chance 11%);
    # - layout=panels with hint=true: the question names the tag's panel. Without the hint 125-300
    #   SFT steps never found the named colour's panel (zoom credit at chance): the random vision
    #   tower gives tokens colour but no position;
    # - the prompt without instructions (SFT teaches the call) and the tiny tokenizer's tool tags:
    #   a prompt of ~11 text tokens instead of ~180; a trajectory of ~100 tokens.
    "zoom": DemoPreset(
        shared=["task.name=zoom", "task.params.symbols=patterns", "task.params.layout=panels",
                "task.params.distractor_shapes=0", "task.params.distractor_tags=3", "task.params.digits=1",
                "task.params.ood_digits=2", "task.params.view_side=56", "task.params.tag_min=80",
                "task.params.tag_max=104", "task.params.instructions=false", "task.params.hint=true",
                "task.params.call_style=window", "model.vision_lr_scale=0",
                "rollout.tools=[zoom_window]", "rollout.tool_image_side=112", "rollout.max_turns=3",
                "rollout.max_trajectory_tokens=192"],
        sft=["sft.batch_size=32", "train.steps=100", "train.lr=1e-3", "train.warmup_steps=20",
             "train.micro_batch_size=32", "train.save_every=50", "eval.every=50", "eval.n=32"],
        grpo=[*GRPO_8X8,
              "train.steps=10", "train.lr=1e-4", "train.warmup_steps=3", "train.micro_batch_size=64",
              "train.save_every=5", "train.log_rollouts_every=5", "eval.every=10", "eval.n=32"],
        eval_n=200, max_new_tokens=48),
    # Reasoning over time (issue 45): which way does the square move, from a 4-frame video.
    # - the motion task's defaults: one 28 px square on 112 px frames travelling half the side, four
    #   directions; the random vision tower's video tokens give the direction to a linear probe at 100%
    #   (ridge on the 32 merged tokens, 500 train / 200 test videos), and SFT breaks out between steps 50
    #   (20%, one answer for all) and 100 (67%), 94% at step 150 (64 held-out, 2 CPU cores shared);
    # - a 25-token reference (the square's start and end sides, then the answer): the first one, 40
    #   tokens, was cut at max_new_tokens;
    # - GRPO at lr 2e-5, as the cryptogram's: the warm start answers most held-out videos already.
    "video": DemoPreset(
        shared=["task.name=motion", "model.vision_lr_scale=0"],
        sft=["sft.batch_size=32", "train.steps=200", "train.lr=1e-3", "train.warmup_steps=30",
             "train.schedule=cosine", "train.micro_batch_size=32", "train.save_every=50", "eval.every=50",
             "eval.n=64"],
        grpo=[*GRPO_8X8,
              "train.steps=20", "train.lr=2e-5", "train.warmup_steps=5", "train.schedule=cosine",
              "train.micro_batch_size=64", "train.save_every=10", "train.log_rollouts_every=5", "eval.every=10",
              "eval.n=64"],
        eval_n=200, max_new_tokens=32),
    # Reasoning over time with a tool (issue 45): the square goes out and comes back, and the model is
    # shown 2 of the 9 frames, the first and the last, which are the same picture: only the `frames`
    # tool (a second's window of the full video) shows which way it went first (tools disabled: 25%).
    # - the tool returns its window as a short video, which the family encodes as it does a prompt's
    #   (the first window, 0 to 2 s: 4 frames, 2 temporal patches of 16 merged tokens; the same frames
    #   as 4 images learn at the same pace with twice the vision tokens);
    # - SFT on the reference trajectories (the call `frames(0, 2.0)`, then the answer) breaks out later
    #   than the 4-frame demo: 20% at step 50, 19-30% at 100, 41-48% at 150, 73% at 200 and 100% at
    #   250 and 300 (64 held-out videos; with a 200-step schedule it ended at 52%), so 300 steps;
    # - GRPO at lr 2e-5 as the 4-frame demo's: the warm start answers every held-out video already.
    "video-tool": DemoPreset(
        shared=["task.name=motion", "task.params.bounce=true", "task.params.frames=9", "task.params.view_frames=2",
                "model.vision_lr_scale=0", "rollout.tools=[frames]", "rollout.tool_image_side=112",
                "rollout.max_turns=3", "rollout.max_trajectory_tokens=192"],
        sft=["sft.batch_size=32", "train.steps=300", "train.lr=1e-3", "train.warmup_steps=30",
             "train.schedule=cosine", "train.micro_batch_size=32", "train.save_every=50", "eval.every=100",
             "eval.n=64"],
        grpo=[*GRPO_8X8,
              "train.steps=10", "train.lr=2e-5", "train.warmup_steps=3", "train.schedule=cosine",
              "train.micro_batch_size=64", "train.save_every=5", "train.log_rollouts_every=5", "eval.every=10",
              "eval.n=64"],
        eval_n=200, max_new_tokens=64),
    # Vision models as tools (issue 52): count the shapes of one colour, some touching, in a 112 px view
    # of a 448 px image, with find_objects and measure (a touching group is one region: only the total
    # area says how many there are).
    # - reading=total: the answer divides measure's total area by one shape's area (`blue: total area
    #   882 px / 148 px = 6.`), ~170 tokens of trajectory; reading the regions one sum at a time (~300
    #   tokens) reached 57.5% after GRPO (docs/results.md "The census demo");
    # - SFT at lr 3e-3 for 350 steps: copying the 3-4 digit total out of the tool's answer needs an
    #   induction head, which the random language model forms between SFT steps 200 and 400 (the tool's
    #   total copied in 18, 29, 42 of 64 held-out answers at steps 200, 300, 400 of a 400-step run); at
    #   lr 1e-3 it was not formed by step 200. 350 steps: 61% of the 200 held-out images after SFT (400
    #   steps: 71%), 100% after GRPO from either, and the demo within 20 minutes;
    # - the weak teacher (teacher=regions, teacher_reads=0.5): half of its answers say the region count
    #   (a region of touching shapes counted as one shape), so SFT makes a model that says the region
    #   count on some scenes; GRPO, paid for the true count, drops that reading within 10 steps;
    # - four arms on the same 200 held-out images: all three tools ("test"), none ("no_tools"), zoom
    #   only, find_objects and measure only; the blind-image checks on the first.
    "census": DemoPreset(
        shared=["task.name=census", "task.params.questions=[count]", "task.params.instructions=false",
                "task.params.teacher=regions", "task.params.teacher_reads=0.5", "task.params.reading=total",
                "model.vision_lr_scale=0", "rollout.tools=[zoom,find_objects,measure]", "rollout.tool_image_side=112",
                "rollout.max_turns=3", "rollout.max_trajectory_tokens=256"],
        sft=["sft.batch_size=32", "train.steps=350", "train.lr=3e-3", "train.warmup_steps=20",
             "train.schedule=cosine", "train.micro_batch_size=16", "train.save_every=100", "eval.every=0"],
        grpo=[*GRPO_8X8,
              "train.steps=15", "train.lr=1e-4", "train.warmup_steps=5", "train.schedule=cosine",
              "train.micro_batch_size=32", "train.save_every=5", "train.log_rollouts_every=5", "eval.every=15",
              "eval.n=64"],
        eval_n=200, max_new_tokens=64,
        tool_arms=(("zoom_only", ("zoom",)), ("cv_only", ("find_objects", "measure")))),
    # The cryptogram as written (issue 53): 26 letters, 1-3 words of the word list, every decoder
    # entry a plain glyph in a 56-px grid cell, nothing but the letters to carry the cipher: 85.5% ->
    # 86.0% of 200 held-out messages, 0% blank or shuffled, 5.8x attention on the cells, 63.5 min at
    # 2 threads (docs/results.md "The preset"; the stages' curves and what failed in "Sessions 1-8"):
    # - the letters tokenizer (one token a letter) and a curriculum of one-letter messages first: the
    #   letter shown alone (98.4% at 240 steps), then looked up among 1-2 entries (81%), then in the
    #   full table of 26 with the table written out before the walk (90.9% after 640 steps; after 320
    #   it moved between 38.8% and 67.2% from run to run, and words from the 38.8% model lost the
    #   reading); the text copies first left a model that never learnt to read a letter alone (1.6%);
    # - the words warm start: 1,600 steps as four 400-step cosines (three curriculum stages and the
    #   warm start), each step's 16 examples learnt a second time without the image
    #   (`sft.text_examples=16`), the decoder's entries left out of their loss, so the copies (the
    #   walk's coded letters from the prompt, <chars> from the walk) are learnt from text while the
    #   image rows keep the reading: without them the copies were not formed by step 800 (coded
    #   letters 2.6%); 85.5% of 200 held-out messages exact after SFT;
    # - pair_breaks, no walk commas: a word break written as a pair "_ _", so the token before each
    #   coded letter is the letter before it in the message;
    # - GRPO at lr 2e-5 for 20 steps: the warm start decodes most messages already (86.0% after,
    #   +0.5 points; 60 steps at 5e-5: the same).
    "cryptogram-glyphs": DemoPreset(
        shared=["task.name=cryptogram", "task.params.layout=grid", "task.params.cell_px=56",
                "task.params.entries_per_row=6", "task.params.entries=all", "task.params.reference=table",
                "task.params.pair_breaks=true", "task.params.walk_commas=false", "task.params.instructions=false",
                "task.params.held_out=messages_and_ciphers", "task.params.min_words=1", "task.params.max_words=3",
                "task.params.ood_extra_words=1", "model.vision_lr_scale=0"],
        sft=["sft.batch_size=16", "sft.text_examples=16", "train.steps=400", "train.lr=1e-3",
             "train.warmup_steps=30", "train.schedule=cosine", "train.micro_batch_size=16", "train.save_every=100",
             "eval.every=0", "train.log_rollouts_every=0"],
        grpo=[*GRPO_8X8,
              "train.steps=20", "train.lr=2e-5", "train.warmup_steps=5", "train.schedule=cosine",
              "train.micro_batch_size=32", "train.save_every=10", "train.log_rollouts_every=5", "eval.every=0"],
        eval_n=200, max_new_tokens=256, tokenizer="letters", attention_n=64,
        curriculum=(("alone", (*ONE_LETTER, "task.params.entries=alone", "train.steps=240")),
                    ("lookup", (*ONE_LETTER, "task.params.entries=some", "task.params.extra_entries=1",
                                "task.params.min_extra_entries=0", "train.steps=320", "train.lr=3e-4")),
                    ("table-1", (*ONE_LETTER, "task.params.reference=table", "train.steps=320", "train.lr=3e-4")),
                    ("table-2", (*ONE_LETTER, "task.params.reference=table", "train.steps=320", "train.lr=3e-4")),
                    ("words-1", ()), ("words-2", ()), ("words-3", ()))),
}


def ensure_tiny_model(folder: Path, size: str, seed: int = 0, tokenizer: str = "bpe") -> Path:
    """Build the offline model into `folder` unless a matching one (same size, seed, tokenizer and
    version) is there."""
    info = folder / "vlmrl_tiny.json"
    wanted = {"size": size, "seed": seed, "tokenizer": tokenizer, "version": TINY_MODEL_VERSION}
    # A folder written before --tokenizer existed has the default one.
    if info.exists() and wanted.items() <= {"tokenizer": "bpe", **json.loads(info.read_text())}.items():
        return folder
    build_tiny_model(folder, size=size, seed=seed, tokenizer=tokenizer)
    return folder


def phase_config(preset: DemoPreset, phase: str, model: Path, out: Path, stage: tuple[str, ...] = ()) -> Config:
    """The Config of one phase ("sft" or "grpo"; with `stage`, the overrides of a curriculum stage
    on top of the phase's), resuming when the folder has a checkpoint."""
    overrides = [f"model.name_or_path={model}", "model.device=cpu", f"output_dir={out}",
                 f"rollout.max_new_tokens={preset.max_new_tokens}", *preset.shared, *getattr(preset, phase), *stage]
    if latest_checkpoint(out) is not None:
        overrides.append("resume=true")
    return load_config(None, overrides)


def run_curriculum(preset: DemoPreset, model_dir: Path, out: Path, lap) -> Path:
    """Run the preset's SFT curriculum (each stage from the last one's final model, a finished stage
    reused) and return the model the warm start begins from; `lap(name)` after each stage."""
    from vlmrl.training.sft import sft

    start = model_dir
    for n, (name, stage) in enumerate(preset.curriculum, 1):
        print(f"-- stage {n}/{len(preset.curriculum)} of the curriculum: {name} --")
        stage_dir = out / "stages" / name
        if not (stage_dir / "final").exists():
            sft(phase_config(preset, "sft", start, stage_dir, stage))
        start = stage_dir / "final"
        lap(f"stage_{name}")
    return start


def evaluate_model(model_dir: Path, config: Config, n: int, out: Path,
                   arms: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> dict:
    """Test and OOD accuracy, with the blind-image check on test; eval JSON files into `out`.

    With tools (rollout.tools), answers are multi-turn with the run's tools and limits, and test is
    answered once more by the same model with the tools disabled ("no_tools"), in one turn of up to
    the trajectory's whole token budget, and once per arm of `arms` (name, tools) with those tools only."""
    model, processor = load_policy(str(model_dir), device="cpu")
    task = run_task(config.task.name, config.seed, config.task.params)
    rollout = config.rollout
    settings = EvalSettings(batch_size=32, max_new_tokens=rollout.max_new_tokens, blind_check=True,
                            tools=list(rollout.tools), tool_models=dict(rollout.tool_models), max_turns=rollout.max_turns,
                            max_trajectory_tokens=rollout.max_trajectory_tokens, tool_image_side=rollout.tool_image_side,
                            decode=rollout.decode)
    runs = [(split, split, settings) for split in ("test", "ood") if split in task.splits]
    if rollout.tools:
        runs.append(("no_tools", "test", replace(settings, tools=[], blind_check=False,
                                                       max_new_tokens=rollout.max_trajectory_tokens)))
        runs += [(name, "test", replace(settings, tools=list(tools), blind_check=False)) for name, tools in arms]
    results = {}
    for name, split, run_settings in runs:
        evaluation = evaluate(model, processor, task, held_out_examples(task, split, n), run_settings)
        save_evaluation(evaluation, out, f"eval_{name}.json")
        results[name] = evaluation.results
    print(format_table(results["test"]))
    return results


def attention_on_regions(model_dir: Path, config: Config, n: int, maps_dir: Path | None = None) -> dict:
    """The share of image attention each answer part puts on its region (`region_attention`), on
    the reference completions of `n` held-out test examples; with `maps_dir`, also the heatmaps of
    the model's own answer to the first of them (`vlmrl attention`) at the layer that looks most."""
    model, processor = load_policy(str(model_dir), device="cpu")
    task = run_task(config.task.name, config.seed, config.task.params)
    examples = held_out_examples(task, "test", n)
    summary = region_attention(model, processor, examples, [task.answer_regions(e) for e in examples]).summary()
    if maps_dir is not None:
        maps = attention_maps(str(model_dir), examples[0].images, examples[0].prompt, layer=summary["best_layer"],
                              out_dir=maps_dir, max_new_tokens=config.rollout.max_new_tokens, device="cpu")
        summary["maps"] = {"dir": str(maps_dir), "completion": maps.completion, "layer": maps.layer}
    return summary


def attention_table(attention: dict) -> str:
    """The share of image attention on each answer part's region, before and after training, as a
    multiple of the uniform share."""
    phases = [name for name in ("before", "sft", "grpo") if name in attention]
    labels = {"before": "untrained", "sft": "SFT", "grpo": "+GRPO"}
    uniform = attention[phases[0]]["uniform"]
    lines = [f"  {'share of image attention on the region':<42}" + "".join(f"{labels[p]:>16}" for p in phases)]
    for name, key, ratio in (("mean over layers", "share", "ratio"), ("best layer", "best_share", "best_ratio")):
        cells = "".join(f"{f'{attention[p][key]:.1%} ({attention[p][ratio]:.1f}x)':>16}" for p in phases)
        lines.append(f"  {name:<42}{cells}")
    lines.append(f"  {'(uniform: ' + format(uniform, '.1%') + ' of the image attention)':<42}"
                 + "".join(f"{'layer ' + str(attention[p]['best_layer']):>16}" for p in phases))
    return "\n".join(lines)


def before_after_table(before: dict, after: dict, arms: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> str:
    """Test and OOD accuracy, the tool arms (`DemoPreset.tool_arms`) and the blind-image drop, before and after
    RL."""
    labels = [f"test, only {', '.join(tools)}" for name, tools in arms if name in before]
    width = max([30, *(len(label) + 2 for label in labels)])  # the label column, wide enough for every arm

    def row(name: str, pick) -> str:
        a, b = pick(before), pick(after)
        if a is None or b is None:
            return f"  {name:<{width}}{'n/a':>10}{'n/a':>10}"
        return f"  {name:<{width}}{a:>10.1%}{b:>10.1%}{100 * (b - a):>+9.1f} pts"

    def blind(results, kind):
        summary = (results["test"].get("blind") or {}).get(kind)
        return None if summary is None else summary["accuracy"]

    lines = [f"  {'':<{width}}{'SFT':>10}{'+GRPO':>10}{'change':>13}",
             row("test accuracy", lambda r: r["test"]["accuracy"]),
             row("OOD accuracy", lambda r: r["ood"]["accuracy"] if "ood" in r else None),
             *([row("test, tools disabled", lambda r: r["no_tools"]["accuracy"])] if "no_tools" in before else []),
             *[row(label, lambda r, name=name: r[name]["accuracy"])
               for label, name in zip(labels, [name for name, _ in arms if name in before])],
             row("test, blank image", lambda r: blind(r, "blank")),
             row("test, shuffled image", lambda r: blind(r, "shuffled"))]
    in_time = [kind for kind in TIME_CONTROLS if kind in (before["test"].get("blind") or {})]
    lines += [row(f"test, {kind.replace('_', ' ')}", lambda r, kind=kind: blind(r, kind)) for kind in in_time]
    return "\n".join(lines)


def run_demo(out_dir: str = "runs/demo", preset_name: str = "shapes") -> dict:
    """The whole demo; returns (and writes to summary.json) the before/after numbers."""
    from vlmrl.training.sft import sft
    from vlmrl.training.trainer import train

    preset = PRESETS[preset_name]
    out = Path(out_dir)
    model_dir = ensure_tiny_model(out / "model", preset.size, tokenizer=preset.tokenizer)
    print(model_summary(model_dir))
    curriculum = {"curriculum": {name: list(stage) for name, stage in preset.curriculum}} if preset.curriculum else {}
    summary: dict = {"preset": preset_name, "overrides": {"shared": preset.shared, "sft": preset.sft,
                                                          "grpo": preset.grpo, **curriculum}}
    seconds = summary["seconds"] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    attention = {}
    try:
        print("\n== 1/4 supervised warm start ==")
        start = run_curriculum(preset, model_dir, out, lap)
        sft_config = phase_config(preset, "sft", start, out / "sft")
        if preset.attention_n:
            summary["attention"] = attention
            attention["before"] = attention_on_regions(model_dir, sft_config, preset.attention_n)
        warm = out / "sft" / "final"
        if not warm.exists():
            sft(sft_config)
        lap("sft")
        print("\n== 2/4 evaluate the warm start ==")
        summary["sft"] = evaluate_model(warm, sft_config, preset.eval_n, out / "sft", preset.tool_arms)
        if preset.attention_n:
            attention["sft"] = attention_on_regions(warm, sft_config, preset.attention_n, out / "sft" / "attention")
        lap("eval_sft")
        print("\n== 3/4 GRPO ==")
        grpo_config = phase_config(preset, "grpo", warm, out / "grpo")
        if not (out / "grpo" / "final").exists():
            train(grpo_config)
        lap("grpo")
        print("\n== 4/4 evaluate after GRPO ==")
        summary["grpo"] = evaluate_model(out / "grpo" / "final", grpo_config, preset.eval_n, out / "grpo",
                                         preset.tool_arms)
        if preset.attention_n:
            attention["grpo"] = attention_on_regions(out / "grpo" / "final", grpo_config, preset.attention_n,
                                                     out / "grpo" / "attention")
        lap("eval_grpo")
    finally:
        for phase in [*(f"stages/{name}" for name, _ in preset.curriculum), "sft", "grpo"]:
            write_report(out / phase)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    table = before_after_table(summary["sft"], summary["grpo"], preset.tool_arms)
    print(f"\n{preset_name}: held-out accuracy before and after GRPO ({sum(seconds.values()) / 60:.1f} min of "
          f"training and evaluation)\n{table}\n"
          + (f"\nattention of each decoded part on its region ({preset.attention_n} held-out examples, "
             f"teacher-forced reference)\n{attention_table(attention)}\n" if attention else "") + "\n"
          f"report: {out / 'grpo' / 'report.html'}   numbers: {out / 'summary.json'}")
    return summary


def write_report(run_dir: Path) -> None:
    """The HTML report of a (possibly partial) run, when the run has metrics."""
    if (run_dir / "metrics.jsonl").exists():
        from vlmrl.report import write_report as write_html

        path = write_html(run_dir)
        print(f"report: {path}")
