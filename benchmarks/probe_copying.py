"""How fast the offline small model's untrained language model learns to copy from its context (issue 52).

Run: `OMP_NUM_THREADS=1 python benchmarks/probe_copying.py [--mode fixed|repeat] [--steps 400] [--lr 1e-3]`.
Builds the offline model (`vlmrl tiny-model --size small`, seed 0) in a temporary folder, then trains its
language model alone (text only, AdamW, batches of 32, the loss on the copyable tokens only) on one synthetic
copying task and prints, every 25 steps, the loss and the accuracy on the tokens that can be copied:
- fixed: 6 random tokens, 10 random tokens, a separator, the same 10 tokens again (the copy sits at a fixed
  offset: a positional head suffices);
- repeat: 64 random tokens where a span of 3-10 of the first half is repeated at a random later place (the
  copy needs an induction head: find where the current token occurred before, take the next one).
Why: the census demo's model reads numbers out of a tool's answer (docs/results.md "The census demo") and
learns that slowest; this probe separates the copying from the task. Random tokens are drawn from the
tokenizer's ordinary tokens (ids 5 .. vocab - 40: not the special and tag tokens at the ends).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F


def batch(mode: str, vocab: int, generator: torch.Generator, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (rows, T), copyable (rows, T - 1) bool: which next-token targets the context gives)."""
    low, high = 5, vocab - 40
    if mode == "fixed":
        span = torch.randint(low, high, (rows, 10), generator=generator)
        tokens = torch.cat([torch.randint(low, high, (rows, 6), generator=generator), span,
                            torch.full((rows, 1), low), span], dim=1)  # (rows, 27)
        copyable = torch.zeros(rows, tokens.shape[1] - 1, dtype=torch.bool)
        copyable[:, 17:] = True  # the targets 18.., the copied span after its first token
        return tokens, copyable
    length = 64
    tokens = torch.randint(low, high, (rows, length), generator=generator)
    copyable = torch.zeros(rows, length - 1, dtype=torch.bool)
    for row in range(rows):
        n = int(torch.randint(3, 11, (1,), generator=generator))
        start = int(torch.randint(0, length // 2 - n, (1,), generator=generator))
        again = int(torch.randint(start + n + 1, length - n + 1, (1,), generator=generator))
        tokens[row, again:again + n] = tokens[row, start:start + n]
        copyable[row, again:again + n - 1] = True  # positions that predict the repeat's 2nd..nth token
    return tokens, copyable


def main() -> None:
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.tiny_model import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("fixed", "repeat"), default="fixed")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        build_tiny_model(folder, size="small", seed=0)
        model = AutoModelForImageTextToText.from_pretrained(folder)
    language, head = model.model.language_model, model.lm_head
    vocab = head.out_features
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    print(f"mode {args.mode}, lr {args.lr}, torch threads {torch.get_num_threads()}")
    print("step  copy loss  copy accuracy  seconds")
    for step in range(args.steps + 1):
        tokens, copyable = batch(args.mode, vocab, generator)
        logits = head(language(input_ids=tokens).last_hidden_state[:, :-1])  # (rows, T - 1, vocab)
        losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")  # (rows, T - 1)
        optimizer.zero_grad()
        losses[copyable].mean().backward()  # trained on the copyable tokens only, as SFT trains on completions
        optimizer.step()
        if step % 25 == 0:
            right = (logits.argmax(-1) == tokens[:, 1:])[copyable].float().mean().item()
            print(f"{step:>4}  {losses[copyable].mean().item():>9.3f}  {right:>13.1%}  {time.perf_counter() - start:>7.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
