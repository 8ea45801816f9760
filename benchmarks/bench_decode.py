"""Generation speed of each decode path (`rollout.decode`, vlmrl/decoding.py), against the memory floor.

Run: `python benchmarks/bench_decode.py [--arch-3b] [--prompts 8 --group 8 --image 896 --tokens 256]`
(`--arch-3b`: the Qwen2.5-VL-3B architecture, random weights, bf16; else the offline tiny model).

For each decode path (dynamic, static, compiled by default) the script times `generate_groups`, the
rollout's own generation (one prefill per prompt, G rows continued from it), with every completion
forced to `--tokens` new tokens (min = max new tokens). It runs `--warmup` calls first (the
compiled path compiles there), then `--repeats` calls of --tokens tokens and of 1 token. Printed per path:
- generation: seconds for the whole call (prefill, vision, all decode steps), the median of the repeats;
- decode ms/step: (t(tokens) - t(1)) / (tokens - 1), the cost of one decode step for all rows, each
  timing the least of the repeats (the least disturbed); a difference below 0 (noise on a busy
  machine) is shown as 0, with a note;
- tokens/s: generated tokens (rows x tokens) per second of the whole call;
- floor share: the memory floor of one decode step (the text model's weights read once, plus the
  KV cache read once at its mean length over the completion) divided by the measured step; 100%
  would be bound by memory bandwidth alone. Needs the device's bandwidth (`--bandwidth` GB/s; known
  for H100 SXM and H200); blank when unknown (CPUs).
- same tokens: whether the path's completions equal the dynamic path's (greedy, `--greedy`) or, sampled
  with one seed, the share of equal rows;
- mismatch KL: sampled only, KL(sampler || training) (k3, mean over tokens) between the log-probs the
  sampler recorded and the training pass's (LogprobScorer) on one call left free to stop; the
  rollout/training mismatch that `algorithm.tis_cap` corrects (docs/algorithms.md).
`--results FILE` appends the table in Markdown with date, machine and command; `--json FILE` writes
the figures per path (gpu_check.py's table reads them); `--no-kl` leaves the mismatch KL out (one
call and a training pass less per path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_trl import bench_model, circle_image, machine, sync  # noqa: E402

from vlmrl import grpo  # noqa: E402
from vlmrl.config import GenerationSettings  # noqa: E402
from vlmrl.models.support import hf_model  # noqa: E402
from vlmrl.rollout.generation import generate_groups  # noqa: E402
from vlmrl.rollout.prompts import encode_prompts  # noqa: E402
from vlmrl.tasks import Example  # noqa: E402
from vlmrl.training.logprobs import LogprobScorer  # noqa: E402

BANDWIDTH_GBS = {"H100": 3350.0, "H200": 4800.0}
"""HBM bandwidth by GPU name fragment (SXM parts), GB/s."""


def floor_ms(model, rows: int, prompt: int, tokens: int, bandwidth: float) -> float:
    """Milliseconds to read the text model's weights and the mean KV cache once at `bandwidth` GB/s."""
    inner = hf_model(model)
    text = inner.config.get_text_config()
    weights = sum(p.numel() * p.element_size() for n, p in inner.named_parameters() if "visual" not in n
                  and "vision" not in n)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = next(inner.parameters()).element_size()
    kv = 2 * text.num_hidden_layers * rows * text.num_key_value_heads * head_dim * (prompt + tokens / 2) * element
    return (weights + kv) / (bandwidth * 1e9) * 1e3


def timed(model, processor, examples, settings, seed: int = 0):
    device = next(model.parameters()).device
    sync(device)
    start = time.perf_counter()
    rollout = generate_groups(model, processor, examples, settings, seed=seed)
    sync(device)
    return time.perf_counter() - start, rollout


def mismatch_kl(model, processor, examples, settings) -> str:
    """KL(sampler || training) of one sampled call (k3, mean over completion tokens)."""
    rollout = generate_groups(model, processor, examples, settings, seed=1)
    with torch.no_grad():
        trained = LogprobScorer(processor, temperature=settings.temperature)(model, rollout)[0]  # (N, T)
    kl = grpo.kl_penalty(rollout.sampler_logp, trained, "k3")  # (N, T)
    return f"{float(grpo.masked_mean(kl, rollout.completion_mask)):.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--image", type=int, default=448, help="image side in pixels (896: 1024 image tokens)")
    parser.add_argument("--tokens", type=int, default=64, help="completion length (min = max new tokens)")
    parser.add_argument("--paths", default="dynamic,static,compiled")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampled at 1.0)")
    parser.add_argument("--size", default="small", help="tiny-model size (tiny, small)")
    parser.add_argument("--arch-3b", action="store_true", help="the Qwen2.5-VL-3B architecture, bf16")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bandwidth", type=float, default=None, help="device memory bandwidth, GB/s")
    parser.add_argument("--results", default=None, help="append the table (Markdown) to this file")
    parser.add_argument("--json", default=None, help="write the figures per path (JSON) to this file")
    parser.add_argument("--no-kl", dest="kl", action="store_false", help="no mismatch KL (faster)")
    args = parser.parse_args()

    from vlmrl.models import load_policy

    model, processor = load_policy(bench_model(args, Path(tempfile.mkdtemp()) / "model"), device=args.device)
    examples = [Example(circle_image(i, args.image), "How many circles are in the image?", "1")
                for i in range(args.prompts)]
    prompt = encode_prompts(processor, examples, torch.device(args.device))["input_ids"].shape[1]  # padded length
    bandwidth = args.bandwidth
    if bandwidth is None and args.device == "cuda":
        name = torch.cuda.get_device_name()
        bandwidth = next((v for k, v in BANDWIDTH_GBS.items() if k in name), None)
    plain_generate = model.generate
    forced = lambda **kw: plain_generate(**kw, min_new_tokens=kw["max_new_tokens"])  # noqa: E731 (no early stop)
    model.generate = forced
    rows = args.prompts * args.group
    reference, figures = None, {}
    lines = ["| path | generation (s) | decode ms/step | tokens/s | floor share | same tokens | mismatch KL |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for path in args.paths.split(","):
        settings = {n: GenerationSettings(group_size=args.group, max_new_tokens=n, decode=path,
                                          temperature=0 if args.greedy else 1.0) for n in (args.tokens, 1)}
        for _ in range(args.warmup):
            timed(model, processor, examples, settings[args.tokens])
            timed(model, processor, examples, settings[1])
        full = [timed(model, processor, examples, settings[args.tokens]) for _ in range(args.repeats)]
        one = [timed(model, processor, examples, settings[1])[0] for _ in range(args.repeats)]
        seconds, rollout = statistics.median(t for t, _ in full), full[0][1]
        step_ms = (min(t for t, _ in full) - min(one)) / (args.tokens - 1) * 1e3  # each timing's least disturbed
        if step_ms < 0:
            print(f"note: {path}: {args.tokens} tokens took less than 1 token (a busy machine's noise): decode "
                  "ms/step shown as 0", flush=True)
            step_ms = 0.0
        share = (f"{floor_ms(model, rows, prompt, args.tokens, bandwidth) / step_ms:.0%}"
                 if bandwidth and step_ms else "n/a")
        if reference is None:
            reference, same = rollout.completion_ids, "(reference)"
        else:
            equal = (rollout.completion_ids == reference).all(-1).float().mean().item()
            same = "yes" if equal == 1.0 else f"{equal:.0%} of rows"
        model.generate = plain_generate  # free to stop: min_new_tokens would ban the stop token
        kl = "n/a" if args.greedy or not args.kl else mismatch_kl(model, processor, examples, settings[args.tokens])
        model.generate = forced
        figures[path] = {"generation_s": seconds, "ms_per_step": step_ms, "tokens_per_s": rows * args.tokens / seconds,
                         "floor_share": share, "same_tokens": same, "mismatch_kl": kl}
        lines.append(f"| {path} | {seconds:.3f} | {step_ms:.2f} | {rows * args.tokens / seconds:.0f} | {share} "
                     f"| {same} | {kl} |")
        print(lines[-1], flush=True)
    name = f"Qwen2.5-VL-3B architecture ({args.layers} layers)" if args.arch_3b else f"tiny-model {args.size}"
    header = (f"{name}, {args.device}, {args.prompts} prompts x G={args.group}, {args.image} px, {args.tokens} "
              f"tokens, {'greedy' if args.greedy else 'sampled'}")
    print("\n" + header + "\n" + "\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": header, "paths": figures}, indent=1))
    if args.results:
        with open(args.results, "a") as out:
            out.write(f"\n### {datetime.date.today()}: decode paths, {header}\n\nMachine: {machine()}\n"
                      f"Command: `python {shlex.join(sys.argv)}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
