"""How many steps does the language model take to learn the cryptogram reference's copies, from text alone?

The words stage of the glyph cryptogram (issue 53) learns to read the decoder within ~300 steps and
then waits hundreds more for two in-order copies: the walk's coded letters, copied from the prompt,
and the <chars> block, copied from the walk's plain letters. Those are text skills, and text alone
trains them at a fraction of the image task's cost a step (no image tokens). This probe trains
the model on the task's own prompts and reference completions with no image: what only the image
tells, the decoder's entries (`reference=table`) and the walk's plain letters (a model trained on
the image task reads them from the image again, not from the table's text), is left out of the
loss, since a letter nobody can predict is noise in the gradient (with the walk's letters trained
too, the untrained small model's coded copy was at 11.7% at step 200, against 81.5% without them:
docs/results.md); every other completion token is trained (`--train-walk`: the walk's plain
letters too, copies of the table's text with reference=table). It reports, every
`--every` steps, the share of each kind of token predicted right in the training batches
(teacher-forced, greedy):

- walk: the walk's plain letters (untrained unless --train-walk: chance);
- walk_coded: the walk's coded letters (copied in order from the prompt's coded message);
- chars: the <chars> block's letters (copied in order from the walk);
- answer: the answer's letters (the <chars> block joined into words).

So a reference format (`task.params.pair_breaks`, `task.params.walk_commas`, ...) can be judged in
minutes before the hours of the image task (generic copying of random tokens, without the task:
`probe_copying.py`). The model is trained in this process (AdamW, the config's lr with its
warm-up, constant after, gradients clipped at 1) and, with `--save`, written out.

    python benchmarks/probe_walk_copies.py runs/letters-model --steps 400 task.params.walk_commas=false \\
        task.params.pair_breaks=true

Key=value arguments are config overrides on top of `probe_cryptogram_reading.BASE` with
reference=table and every entry filled (the words stage of the glyph curriculum).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from probe_cryptogram_reading import BASE, walk_coded_letters
from vlmrl.config import load_config
from vlmrl.models import load_policy
from vlmrl.tasks import Example, get_task
from vlmrl.tasks.cryptogram import decoded_letter_cells, table_letter_cells, walk_letter_cells

KINDS = ("walk", "walk_coded", "chars", "answer")
WORDS_STAGE = ["task.params.reference=table", "task.params.entries=all", "task.params.cell_px=56"]


def spans(example: Example) -> dict[str, list[tuple[int, int]]]:
    """Each kind of copied letter's (start, end) characters in the reference completion, and the
    table's entries ("unknown": not trained, only the image tells them)."""
    text = example.reference_completion
    walk = [(a, b) for a, b, _ in walk_letter_cells(example)]
    opened = text.index("<answer>") + len("<answer>")
    answer = [(opened + i, opened + i + 1) for i, ch in enumerate(text[opened:text.index("</answer>")]) if ch.isalpha()]
    return {"unknown": [(a, b) for a, b, _ in table_letter_cells(example)], "walk": walk,
            "walk_coded": [(a, b) for a, b, _ in walk_coded_letters(example)], "chars": [(a, b) for a, b, _ in decoded_letter_cells(example)],
            "answer": answer}


def encode(tokenizer, example: Example) -> tuple[list[int], list[str]]:
    """The prompt and the reference completion as one token sequence, and each token's kind: the
    kinds of `spans`, "prompt" (not trained), "unknown" (not trained) or "other" (trained)."""
    prompt = tokenizer(example.prompt + "\n", add_special_tokens=False).input_ids
    completion = tokenizer(example.reference_completion, add_special_tokens=False, return_offsets_mapping=True)
    kinds = ["other"] * len(completion.input_ids)
    for kind, places in spans(example).items():
        for start, end in places:
            token = next(t for t, (a, b) in enumerate(completion.offset_mapping) if a < end and b > start)
            kinds[token] = kind
    return prompt + completion.input_ids, ["prompt"] * len(prompt) + kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the starting model folder (vlmrl tiny-model, or a stage's final)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50, help="steps between reports (the batches in between)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--train-walk", action="store_true",
                        help="train the walk's plain letters too (copies of the table's text with reference=table)")
    parser.add_argument("--out", help="write the curve here (JSON)")
    parser.add_argument("--save", help="write the trained model to this folder")
    args = parser.parse_intermixed_args()
    config = load_config(None, [*BASE, *WORDS_STAGE, *args.overrides])
    task = get_task(config.task.name, seed=config.seed, **config.task.params)
    torch.manual_seed(config.seed)
    order = random.Random(config.seed)
    model, processor = load_policy(args.model, device="cpu")
    tokenizer = processor.tokenizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=0.0)
    model.train()
    curve, counts, start = [], {}, time.time()
    for step in range(1, args.steps + 1):
        batch = [encode(tokenizer, task.example(order.randrange(10**9), "train")) for _ in range(args.batch)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])  # [B, T]
        kinds = [kinds + ["pad"] * (width - len(kinds)) for _, kinds in batch]
        mask = torch.tensor([[kind != "pad" for kind in row] for row in kinds]).long()  # [B, T]
        untrained = ("prompt", "unknown", "pad") + (() if args.train_walk else ("walk",))
        trained = torch.tensor([[kind not in untrained for kind in row] for row in kinds])[:, 1:]
        for group in optimizer.param_groups:
            group["lr"] = config.train.lr * min(1.0, step / max(config.train.warmup_steps, 1))
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [B, T-1, V]: predicts ids[:, 1:]
        targets = ids[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[trained], targets[trained])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        right = logits.argmax(-1) == targets  # [B, T-1]
        kind_of = torch.tensor([[KINDS.index(k) if k in KINDS else -1 for k in row] for row in kinds])[:, 1:]
        for index, kind in enumerate(KINDS):
            chosen = kind_of == index  # [B, T-1]
            total = counts.setdefault(kind, [0, 0])
            total[0] += int(right[chosen].sum())
            total[1] += int(chosen.sum())
        if step % args.every == 0:
            curve.append({"step": step, "loss": float(loss.detach()), "seconds": time.time() - start,
                          **{kind: right_ / max(seen, 1) for kind, (right_, seen) in counts.items()}})
            counts = {}
            print(f"step {step}: loss {curve[-1]['loss']:.3f}, " + ", ".join(
                f"{kind} {curve[-1][kind]:.1%}" for kind in KINDS) + f" ({curve[-1]['seconds']:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "overrides": args.overrides, "curve": curve}, indent=1))
    if args.save:
        model.save_pretrained(args.save)
        processor.save_pretrained(args.save)


if __name__ == "__main__":
    main()
