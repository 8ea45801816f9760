"""Does SFT teach the language model to read a cryptogram's letters? Curves of steps -> accuracy.

Runs `vlmrl sft` (the Python API, the project's own loop) on a cryptogram setting with a checkpoint
every `--every` steps, then scores the untrained model and each checkpoint teacher-forced on
`--n` held-out test messages: the reference completion (with `reference=pairs`, "a t, o h, ...": each
plain letter is written right after its coded letter, so it is predicted where it is looked up) is
fed after the prompt, and a letter counts as read when the model's most likely next token at the
position before it is the letter's token. Reported per checkpoint:

- letters: the share of the walk's plain letters read right, with the message's own decoder;
- shuffled: the same with another test message's decoder (what the text alone gives: word prior,
  letter frequencies);
- other_cell: the share guessed as the plain letter of another filled cell than the one looked up
  (with the message's own decoder): a glyph read from the wrong cell;
- messages: the share of messages whose every walk letter is read right (teacher-forced, so an
  upper bound of greedy exact decoding as far as the lookups go).

With `reference=table` ("decoder: a q, b x, ... message: f u, ..."), "letters" are the decoder's
entries of the message's coded letters (where each is read from the image), and the text skills
after them are scored too: table (every entry) and walk (the walk's plain letters, after the
table); with reference=pairs or table, walk_coded (the walk's coded letters, copied from the
prompt) and chars (the <chars> block's letters, copied from the walk), each with a shuffled decoder
and per message.

The SFT's wall-clock and CPU seconds (this process's, all threads) go beside the curve in
`OUT/reading.json`; the first argument may be any model folder, e.g. an earlier probe's
`OUT/final`, to run the stages of a curriculum one after the other; `--steps 0` scores that model
alone on the setting given (how a stage's model reads the next stage's decoder, without training);
`--score-with KEY=VALUE` scores another setting than the one trained (a mixed stage on its hardest
decoder).

    python benchmarks/probe_cryptogram_reading.py runs/small-model --out runs/probe-a --steps 150 \\
        --every 50 task.params.cell_px=56 model.vision_lr_scale=1

Key=value arguments are config overrides on top of the base below (the cryptogram as issue 53
writes it: 26 letters, 1-3 words, the grid decoder with every entry filled, no tiles).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import vlmrl
from vlmrl.config import load_config
from vlmrl.evaluation.evaluate import held_out_examples
from vlmrl.models import load_policy
from vlmrl.models.token_inputs import join_prompt_and_completion
from vlmrl.rollout.prompts import encode_prompts
from vlmrl.tasks import Example, get_task
from vlmrl.tasks.cryptogram import decoded_letter_cells, table_letter_cells, walk_letter_cells

BASE = ["task.name=cryptogram", "task.params.layout=grid", "task.params.cell_px=28",
        "task.params.entries_per_row=6", "task.params.reference=pairs", "task.params.instructions=false",
        "task.params.held_out=messages_and_ciphers", "task.params.min_words=1", "task.params.max_words=3",
        "task.params.ood_extra_words=1", "model.vision_lr_scale=0",
        "sft.batch_size=32", "train.micro_batch_size=32", "train.lr=1e-3", "train.warmup_steps=30",
        "train.schedule=cosine", "eval.every=0", "train.keep_checkpoints=0", "train.log_rollouts_every=0"]


@torch.no_grad()
def walk_reading(model, processor, examples: list[Example], images: list, batch_size: int = 16,
                 guesses: list[str] | None = None, spans=None) -> dict[str, tuple[int, int, int]]:
    """Per set of letters in `spans` (name -> function of an example giving its letters' (start,
    end, box), as `Task.answer_regions`; default {"letters": walk_letter_cells}): (letters read
    right, letters, messages with every such letter right), teacher-forced with `images` in place of
    each example's decoder; `guesses`, when given, gets the model's most likely token at each letter
    of the first set (its text, stripped), example by example in order."""
    spans = spans or {"letters": walk_letter_cells}
    tokenizer = processor.tokenizer
    counts = {name: [0, 0, 0] for name in spans}
    for first in range(0, len(examples), batch_size):
        rows = [Example(image=image, prompt=ex.prompt, answer=ex.answer, meta=ex.meta,
                        reference_completion=ex.reference_completion)
                for ex, image in zip(examples[first:first + batch_size], images[first:first + batch_size])]
        encoded = [tokenizer(ex.reference_completion, add_special_tokens=False, return_offsets_mapping=True)
                   for ex in rows]
        length = max(len(e.input_ids) for e in encoded)
        ids = torch.full((len(rows), length), tokenizer.pad_token_id)  # (B, T)
        mask = torch.zeros(len(rows), length, dtype=torch.long)  # (B, T)
        for i, e in enumerate(encoded):
            ids[i, :len(e.input_ids)] = torch.tensor(e.input_ids)
            mask[i, :len(e.input_ids)] = 1
        inputs = join_prompt_and_completion(encode_prompts(processor, rows, torch.device("cpu")), ids, mask)
        prompt_len = inputs["input_ids"].shape[1] - length  # P
        predicted = model(**inputs, use_cache=False).logits.argmax(-1)  # (B, P+T)
        for i, (ex, e) in enumerate(zip(rows, encoded)):
            for n, (name, letter_spans) in enumerate(spans.items()):
                tokens = [next(t for t, (a, b) in enumerate(e.offset_mapping) if a < end and b > start)
                          for start, end, _ in letter_spans(ex)]
                hits = [int(predicted[i, prompt_len + t - 1]) == e.input_ids[t] for t in tokens]
                if guesses is not None and n == 0:
                    guesses.extend(tokenizer.decode([int(predicted[i, prompt_len + t - 1])]).strip()
                                   for t in tokens)
                count = counts[name]
                count[0], count[1], count[2] = count[0] + sum(hits), count[1] + len(hits), count[2] + all(hits)
    return {name: tuple(count) for name, count in counts.items()}


def walk_coded_letters(example: Example) -> list[tuple[int, int, None]]:
    """The walk's coded letters ("a" of "a t,"), copied from the prompt's coded message: their
    (start, end) characters in the reference completion, two before each walk letter."""
    return [(start - 2, end - 2, None) for start, end, _ in walk_letter_cells(example)]


def other_cell_share(examples: list[Example], guesses: list[str], entries: str) -> float:
    """The share of walk letters guessed as the plain letter of another filled cell than the one
    looked up (a glyph read, the wrong cell): the filled cells are `meta["filled"]` with
    entries=some, every cell with entries=all, the message's own otherwise."""
    other, guessed = 0, iter(guesses)
    for ex in examples:
        meta = ex.meta
        decode = {coded: plain for plain, coded in zip(meta["letters"], meta["cipher"])}
        walk = [coded for coded in meta["coded"].split(" ") if coded != "_"]
        filled = meta["filled"] if entries == "some" else decode if entries == "all" else walk
        for coded in walk:
            other += next(guessed) in {decode[c] for c in filled if c != coded}
    return other / len(guesses)


def score(folder, task, examples: list[Example]) -> dict[str, float]:
    """Teacher-forced reading of `examples` by the model in `folder`, real and shuffled decoders:
    the letters where the task reads them (`answer_regions`: the walk's with reference=pairs, the
    decoder's entries of the message's letters with reference=table) and, with reference=table,
    every entry of the decoder ("table") and the walk's letters copied from it ("walk"); with
    reference=pairs or table, the walk's coded letters copied from the prompt ("walk_coded") and the
    <chars> block's letters copied from the walk ("chars"), text alone."""
    model, processor = load_policy(str(folder), device="cpu")
    model.eval()
    spans = {"letters": task.answer_regions}
    if task.params.reference in ("pairs", "table"):
        spans |= {"walk_coded": walk_coded_letters, "chars": decoded_letter_cells}
    if task.params.reference == "table":
        spans |= {"table": table_letter_cells, "walk": walk_letter_cells}
    guesses: list[str] = []
    real = walk_reading(model, processor, examples, [ex.image for ex in examples], guesses=guesses, spans=spans)
    shuffled = walk_reading(model, processor, examples, [ex.image for ex in examples[1:] + examples[:1]],
                            spans=spans)
    result = {"letters": real["letters"][0] / real["letters"][1],
              "shuffled": shuffled["letters"][0] / shuffled["letters"][1],
              "other_cell": other_cell_share(examples, guesses, task.params.entries),
              "messages": real["letters"][2] / len(examples), "letter_count": real["letters"][1]}
    for name in spans.keys() - {"letters"}:
        result |= {name: real[name][0] / real[name][1], f"{name}_shuffled": shuffled[name][0] / shuffled[name][1],
                   f"{name}_messages": real[name][2] / len(examples)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the starting model folder (vlmrl tiny-model)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value, on top of BASE")
    parser.add_argument("--out", required=True, help="the SFT run folder")
    parser.add_argument("--steps", type=int, default=150, help="SFT steps (0: score the model alone)")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints scored")
    parser.add_argument("--n", type=int, default=64, help="held-out test messages scored")
    parser.add_argument("--score-with", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the scored setting only, on top of the trained one (repeatable): "
                             "e.g. a mixed stage scored on its hardest decoder")
    args = parser.parse_intermixed_args()
    steps = [f"train.steps={args.steps}", f"train.save_every={args.every}"] if args.steps else []
    overrides = [*BASE, f"model.name_or_path={args.model}", f"output_dir={args.out}", *steps, *args.overrides]
    config = load_config(None, overrides)
    scored = load_config(None, [*overrides, *args.score_with])  # the trained setting when none is given
    task = get_task(scored.task.name, seed=scored.seed, **scored.task.params)
    examples = held_out_examples(task, "test", args.n)
    curve = [{"step": 0, **score(args.model, task, examples)}]
    print(json.dumps(curve[-1]), flush=True)
    seconds = cpu_seconds = 0.0
    if args.steps:
        start, cpu_start = time.time(), time.process_time()
        result = vlmrl.sft(config)
        seconds, cpu_seconds = time.time() - start, time.process_time() - cpu_start
        for folder in sorted((result.run_dir / "checkpoints").glob("step_*")):
            curve.append({"step": int(folder.name.split("_")[1]), **score(folder, task, examples)})
            print(json.dumps(curve[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "reading.json").write_text(json.dumps(
        {"overrides": overrides, "score_with": args.score_with, "sft_seconds": seconds,
         "sft_cpu_seconds": cpu_seconds, "curve": curve}, indent=1))
    print(f"sft {seconds:.0f} s ({cpu_seconds:.0f} CPU s); " + "; ".join(
        f"step {c['step']}: letters {c['letters']:.1%} (shuffled {c['shuffled']:.1%}, other cell "
        f"{c['other_cell']:.1%}), messages {c['messages']:.1%}"
        + (f", table {c['table']:.1%} (shuffled {c['table_shuffled']:.1%}), walk {c['walk']:.1%}" if "table" in c else "")
        + (f", walk's coded letters {c['walk_coded']:.1%}, chars {c['chars']:.1%}" if "chars" in c else "")
        for c in curve))


if __name__ == "__main__":
    main()
