"""The preflight's estimate of a training micro-batch's activations against what the pass takes.

`model.gradient_checkpointing=auto` and `train.micro_batch_size=auto` are settled from the
preflight's memory estimate (preflight.py), whose activations come from what the loaded model keeps
for backward per token and per image token (activation_memory.py). Here one micro-batch (`--prompts`
groups of G completions of `--tokens` random tokens after a circle image and a question) goes through
the policy's training pass (LogprobScorer, loss = sum of log-probs, backward), packed and plain,
gradient checkpointing off and on, and the table gives for each:
- estimate: the preflight's `activations` for that micro-batch (`estimate_memory`);
- kept for backward: the bytes autograd saved in the forward (each storage once, no parameter;
  without checkpointing only: checkpointed layers keep theirs out of sight of the hooks);
- peak: the memory the pass took above where it started, the parameters' gradients already
  allocated by a warm-up pass (CUDA: peak allocated; CPU: peak resident memory, glibc told to give
  every large block back at once so that the resident size follows the live tensors).

`--frozen-embedding` keeps the input embedding (and the output layer tied to it) out of training:
a shallow build's peak is otherwise its embedding gradients at the end of backward.

Run: `python benchmarks/bench_memory.py [--arch-3b | --model DIR | --size small] [--prompts 2 --group 8
--image 448 --tokens 64 --dtype auto --frozen-embedding]`; `--results FILE` appends the table
(Markdown, date, machine, command).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import shlex
import sys
import tempfile
from pathlib import Path

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # before torch allocates: every block >= 64 KiB its own mapping
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pass import completions_of  # noqa: E402
from bench_vs_trl import MemoryPeak, bench_model, machine, publish  # noqa: E402

from vlmrl.config import load_config  # noqa: E402
from vlmrl.models.loading import enable_checkpointing, load_policy  # noqa: E402
from vlmrl.rollout.prompts import encode_prompts, image_token_id  # noqa: E402
from vlmrl.safety.activation_memory import measure_activation_costs, saved_bytes  # noqa: E402
from vlmrl.safety.preflight import estimate_memory  # noqa: E402
from vlmrl.training.logprobs import LogprobScorer  # noqa: E402

MIB = 2 ** 20


def train_pass(model, scorer: LogprobScorer, completions) -> None:
    logp, _ = scorer(model, completions)
    logp.sum().backward()


def measured(model, scorer: LogprobScorer, completions, checkpointing: bool,
             memory: MemoryPeak) -> tuple[float | None, float]:
    """(MiB kept for backward, or None under checkpointing; MiB peak above the start) of one pass."""
    train_pass(model, scorer, completions)  # warm-up: the parameters' gradients are allocated now
    model.zero_grad(set_to_none=False)
    gc.collect()
    if completions.completion_ids.device.type == "cpu":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    memory.start()
    kept = saved_bytes(lambda: train_pass(model, scorer, completions), model)
    peak = memory.stop()
    model.zero_grad(set_to_none=False)
    return (None if checkpointing else kept / MIB), peak


def prompt_lengths(model, processor, completions) -> tuple[int, int]:
    """(tokens, image tokens) of the micro-batch's prompt (every prompt has the same image size)."""
    prompt = encode_prompts(processor, completions.rows[:1], completions.completion_ids.device)["input_ids"]  # (1, P)
    return prompt.shape[1], int((prompt == image_token_id(processor, model.config)).sum())


def estimated(args, model, lengths: tuple[int, int], packed: bool, checkpointing: bool, costs) -> float:
    """MiB: the preflight's activations for this micro-batch."""
    config = load_config(None, [
        f"model.name_or_path={args.model_dir}", f"model.device={args.device}", f"model.dtype={args.dtype}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.tokens}", f"train.micro_batch_size={args.prompts * args.group}",
        f"train.pack_groups={str(packed).lower()}", f"model.gradient_checkpointing={str(checkpointing).lower()}"])
    prompt, image_tokens = lengths
    memory = estimate_memory(config, model, "train", 1, prompt, args.tokens, image_tokens, costs)
    return memory.activations / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="groups in the micro-batch")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--image", type=int, default=448, help="image side in pixels (896: 1024 image tokens)")
    parser.add_argument("--tokens", type=int, default=64, help="completion length")
    parser.add_argument("--size", default="small", help="tiny-model size (tiny, small)")
    parser.add_argument("--arch-3b", action="store_true", help="the Qwen2.5-VL-3B architecture, bf16")
    parser.add_argument("--model", default=None, help="a saved model folder (e.g. the 3B one, built once)")
    parser.add_argument("--layers", type=int, default=36, help="with --arch-3b: text layers (36 = the real one)")
    parser.add_argument("--vision-depth", type=int, default=32, help="with --arch-3b: vision blocks (32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--frozen-embedding", action="store_true",
                        help="the input embedding (and a tied output layer) does not train")
    parser.add_argument("--results", default=None, help="append the table (Markdown) to this file")
    args = parser.parse_args()

    args.model_dir = bench_model(args, Path(tempfile.mkdtemp()) / "model")
    model, processor = load_policy(args.model_dir, device=args.device, dtype=args.dtype)
    model.train()
    model.get_input_embeddings().weight.requires_grad_(not args.frozen_embedding)
    completions = completions_of(model, processor, args)
    costs, lengths = measure_activation_costs(model, processor), prompt_lengths(model, processor, completions)
    memory = MemoryPeak(completions.completion_ids.device)
    rows = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_checkpointing(model)
        for packed in (True, False):
            scorer = LogprobScorer(processor, pack_groups=packed)
            kept, peak = measured(model, scorer, completions, checkpointing, memory)
            rows.append((packed, checkpointing, estimated(args, model, lengths, packed, checkpointing, costs),
                         kept, peak))
    publish(table(args, rows, next(model.parameters()).dtype), args.results)


def table(args, rows: list[tuple], dtype: torch.dtype) -> list[str]:
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_memory.py"] + sys.argv[1:])
    name = args.model or (f"Qwen2.5-VL-3B architecture ({args.layers} layers, {args.vision_depth} vision blocks)"
                          if args.arch_3b else
                          f"tiny-model {args.size}")
    name += ", embedding frozen" if args.frozen_embedding else ""
    lines = [f"### {datetime.date.today().isoformat()}: activation estimate against the training pass, {name}, "
             f"{args.device}, {dtype}, {args.prompts} prompts x G={args.group}, {args.image} px, {args.tokens} tokens", "",
             f"- machine: {machine()}", f"- command: `{command}`", "",
             "| micro-batch | checkpointing | estimate (MiB) | kept for backward (MiB) | peak (MiB) | estimate / peak |",
             "|---|---|---:|---:|---:|---:|"]
    for packed, checkpointing, estimate, kept, peak in rows:
        lines.append(f"| {'packed' if packed else 'plain'} | {'on' if checkpointing else 'off'} | {estimate:.0f} | "
                     f"{'-' if kept is None else f'{kept:.0f}'} | {peak:.0f} | {estimate / peak:.2f} |")
    return lines + [""]


if __name__ == "__main__":
    main()
