"""The packed training pass, one speedup off against on, in one process:
`--compare attention`: the dense mask against block attention (`train.block_attention`);
`--compare fused`: the model's own RMSNorm and MLP against liger's fused kernels (`train.fused_kernels`,
CUDA only), both with block attention;
`--compare vision`: the vision tower's attention, one call per window (transformers' loop) against
one per window length (`train.batched_vision_attention`, vision_attention.py).
All but the compared speedup stay at vlmrl's defaults.

Run: `python benchmarks/bench_pass.py [--compare attention|fused|vision] [--arch-3b] [--prompts 2 --group 8
--image 896 --tokens 256]` (`--arch-3b`: the Qwen2.5-VL-3B architecture, random weights, bf16; else
the offline tiny model).

Each prompt (one circle image and a question) is packed with G completions of `--tokens` random
tokens, as the training phase packs a group (packing.py); `--prompts` groups go through one pass
(one micro-batch of prompts x group rows). For each variant, after `--warmup` passes, the median of
`--repeats`:
- train pass: the policy's forward and backward (LogprobScorer, loss = sum of log-probs);
- forward: a no-grad forward (the old and reference log-prob passes);
- peak memory of the train pass (on CUDA);
- attention calls per forward: calls of F.scaled_dot_product_attention in one no-grad forward
  (the launches the vision tower's windows cost: Qwen2.5-VL-3B at 8 images of 896 px, 14,368 per
  tower pass in a loop, 32 batched);
- attention scores (`--compare attention`): the (query, key) pairs the attention computes per head
  and layer, the dense square U L^2 against the blocks' P^2 + S T (P + T);
and, on against off: the largest log-prob difference and the gradients' cosine.
`--results FILE` appends the table in Markdown with date, machine and command.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import bench_model, circle_image, machine, publish, sync  # noqa: E402

from vlmrl.models.fused_kernels import fused_kernels_unsupported, use_fused_kernels  # noqa: E402
from vlmrl.models.loading import enable_checkpointing, load_policy  # noqa: E402
from vlmrl.models.vision_attention import use_batched_vision_attention  # noqa: E402
from vlmrl.rollout.completions import Completions  # noqa: E402
from vlmrl.rollout.prompts import encode_prompts  # noqa: E402
from vlmrl.tasks import Example  # noqa: E402
from vlmrl.training.logprobs import LogprobScorer  # noqa: E402


def completions_of(model, processor, args) -> Completions:
    """`--prompts` groups of G rows, each completion `--tokens` random text tokens (fixed seed)."""
    examples = [Example(circle_image(i, args.image), "How many circles are in the image? Think first.", "1")
                for i in range(args.prompts)]
    rows = [e for e in examples for _ in range(args.group)]
    generator = torch.Generator().manual_seed(0)
    special = set(processor.tokenizer.added_tokens_decoder)  # image placeholders, chat markers, ...
    text = torch.tensor([i for i in range(min(1000, model.config.get_text_config().vocab_size)) if i not in special])
    ids = text[torch.randint(len(text), (len(rows), args.tokens), generator=generator)]  # (N, T)
    return Completions(rows, ids.to(args.device), torch.ones_like(ids).to(args.device))


def score_counts(processor, completions: Completions, args) -> tuple[int, int]:
    """(query, key) pairs per head and layer: the dense square U L^2, and the blocks U (P^2 + G T (P + T))."""
    prompt = encode_prompts(processor, completions.rows[::args.group], completions.completion_ids.device)
    width, slots = prompt["input_ids"].shape[1], args.group * args.tokens  # P, G T
    return (args.prompts * (width + slots) ** 2,
            args.prompts * (width ** 2 + slots * (width + args.tokens)))


VARIANTS = {  # the speedup compared: (label, block attention, fused kernels, vision windows batched) off, then on
    "attention": (("dense mask", False, False, True), ("blocks", True, False, True)),
    "fused": (("own modules", True, False, True), ("fused kernels", True, True, True)),
    "vision": (("a call per window", True, False, False), ("windows batched", True, False, True)),
}


class CountingAttention(TorchFunctionMode):
    """Counts the calls of F.scaled_dot_product_attention made under it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.nn.functional.scaled_dot_product_attention
        return func(*args, **(kwargs or {}))


def measure(model, scorer, completions, args) -> dict[str, float]:
    """Median seconds of the train pass and of a no-grad forward, peak memory, and the results."""
    def train_pass():
        model.zero_grad(set_to_none=True)
        logp, _ = scorer(model, completions)
        logp.sum().backward()
        return logp.detach()

    for _ in range(args.warmup):
        train_pass()
        with torch.no_grad():
            scorer(model, completions)
    train, forward = [], []
    device = completions.completion_ids.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        logp = train_pass()
        sync(device)
        train.append(time.perf_counter() - start)
        with torch.no_grad():
            start = time.perf_counter()
            scorer(model, completions)
            sync(device)
            forward.append(time.perf_counter() - start)
    # the last pass's gradients as they are: the next pass starts from None (zero_grad), so no copy
    # (a float64 copy of the 3B model's would be 30 GB; `gradient_cosine` takes one tensor at a time)
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    with torch.no_grad(), CountingAttention() as counting:
        scorer(model, completions)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return {"train": statistics.median(train), "forward": statistics.median(forward), "memory": peak,
            "logp": logp.float(), "grads": grads, "calls": counting.calls}


def gradient_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The cosine of two gradients given tensor by tensor, summed in float64 one tensor at a time."""
    dot = norm_a = norm_b = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = x.double(), y.double()
        dot += float(x.mul(y).sum())
        norm_a += float(x.square().sum())
        norm_b += float(y.square().sum())
    return dot / math.sqrt(norm_a * norm_b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=sorted(VARIANTS), default="attention", help="the speedup off against on")
    parser.add_argument("--prompts", type=int, default=2, help="groups in the pass (U)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--image", type=int, default=448, help="image side in pixels (896: 1024 image tokens)")
    parser.add_argument("--tokens", type=int, default=64, help="completion length")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="small", help="tiny-model size (tiny, small)")
    parser.add_argument("--arch-3b", action="store_true", help="the Qwen2.5-VL-3B architecture, bf16")
    parser.add_argument("--model", default=None, help="a saved model folder (e.g. the 3B one, built once)")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--results", default=None, help="append the table (Markdown) to this file")
    args = parser.parse_args()

    model, processor = load_policy(bench_model(args, Path(tempfile.mkdtemp()) / "model"), device=args.device)
    model.train()
    if args.compare == "fused" and (reason := fused_kernels_unsupported(model)) is not None:
        parser.error(f"--compare fused: {reason}")
    if args.checkpointing:
        enable_checkpointing(model)
    completions = completions_of(model, processor, args)
    results = []
    for _, blocks, fused, batched in VARIANTS[args.compare]:
        use_fused_kernels(model, fused)
        use_batched_vision_attention(model, batched)
        results.append(measure(model, LogprobScorer(processor, 1.0, True, 1024, blocks), completions, args))
    use_fused_kernels(model, False)
    publish(table(args, processor, completions, results), args.results)


def table(args, processor, completions, results: list[dict]) -> list[str]:
    """The Markdown table of the two variants, with date, machine and command."""
    (off_label, *_), (on_label, *_) = VARIANTS[args.compare]
    off, on = results
    logp_diff = float((off["logp"] - on["logp"]).abs().max())
    cosine = gradient_cosine(off["grads"], on["grads"])
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_pass.py"] + sys.argv[1:])
    name = args.model or (f"Qwen2.5-VL-3B architecture ({args.layers} layers)" if args.arch_3b else
                          f"tiny-model {args.size}")
    rows = [("train pass (s)", "train", "{:.3f}"), ("no-grad forward (s)", "forward", "{:.3f}"),
            ("attention calls per forward", "calls", "{:d}")]
    if args.device == "cuda":
        rows.append(("peak memory, train pass (MiB)", "memory", "{:.0f}"))
    lines = [f"### {datetime.date.today().isoformat()}: packed pass, {off_label} against {on_label}, {name}, "
             f"{args.device}, {args.prompts} prompts x G={args.group}, {args.image} px, {args.tokens} tokens, "
             f"checkpointing {'on' if args.checkpointing else 'off'}", "",
             f"- machine: {machine()}", f"- command: `{command}`", "",
             f"| | {off_label} | {on_label} | {on_label} / {off_label} |", "|---|---:|---:|---:|"]
    for label, key, fmt in rows:
        lines.append(f"| {label} | {fmt.format(off[key])} | {fmt.format(on[key])} | {on[key] / off[key]:.3f} |")
    if args.compare == "attention":
        dense_scores, block_scores = score_counts(processor, completions, args)
        lines.append(f"| attention scores per head and layer | {dense_scores} | {block_scores} | "
                     f"{block_scores / dense_scores:.3f} |")
    lines += ["", f"{on_label.capitalize()} against {off_label}: largest log-prob difference {logp_diff:.2e}, "
              f"gradient cosine {cosine:.6f}.", ""]
    return lines


if __name__ == "__main__":
    main()
