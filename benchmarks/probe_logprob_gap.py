"""Where the sampler's log-probs part from the training pass's, per decode path and numeric setting
(issue 46, item 3).

A tiny model of a real architecture samples completions of two image prompts with each decode path
(dynamic, static, compiled); the training pass (LogprobScorer) then scores the same tokens. The table
gives the largest |sampler - training| log-prob over the completion tokens, at the first decode step
(logits of the prefill) and at the later ones (logits of the decode step and its cache), under:

- default: torch's defaults (fp32 matrix products without TF32; cuDNN convolutions with TF32 on CUDA)
- no-tf32: TF32 off for matrix products and cuDNN convolutions
- no-tf32+math-sdpa: the same, and scaled-dot-product attention by its math formula
- no-cudagraph: the compiled step by inductor without CUDA graphs (mode "default")
- aot_eager, eager: the compiled step traced by dynamo (and AOT autograd) but run by torch's eager
  kernels: whether inductor's generated code is where the numbers part

A cache slot off by one moves the later steps on every device and setting; TF32 or reduction order
moves with the setting (and vanishes on a CPU). Each (setting, path) runs in a process of its own,
so a compiled graph never outlives the setting it was compiled under.

    python benchmarks/probe_logprob_gap.py --device cuda --arch qwen2_5_vl
    python benchmarks/probe_logprob_gap.py --device cpu --paths dynamic,static,compiled [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {"default": {}, "no-tf32": {"tf32": False}, "no-tf32+math-sdpa": {"tf32": False, "sdpa": "math"},
            "no-cudagraph": {"mode": "default"}, "aot_eager": {"backend": "aot_eager"},
            "eager": {"backend": "eager"}}
"""name -> what it changes: TF32 flags, the attention backend, the compiled step's mode or backend."""


def measure(folder: str, device: str, path: str, setting: str, dtype: str = "float32") -> dict:
    """One (path, setting): the largest gaps at the first and at later decode steps."""
    import contextlib

    import torch
    from PIL import Image

    from vlmrl.config import GenerationSettings
    from vlmrl.models import load_policy
    from vlmrl.rollout.generation import generate_groups
    from vlmrl.tasks import Example
    from vlmrl.training.logprobs import LogprobScorer

    from vlmrl.rollout import decoding, generation

    change = SETTINGS[setting]
    if change.get("tf32") is False:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    attention = contextlib.nullcontext()
    if change.get("sdpa") == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attention = sdpa_kernel(SDPBackend.MATH)
    if "mode" in change or "backend" in change:  # the compile switch decode_kwargs hands `generate`
        def with_compile_change(*args, _plain=decoding.decode_kwargs):
            extra = _plain(*args)
            if "compile_config" in extra:
                extra["compile_config"].mode = change.get("mode", extra["compile_config"].mode)
                extra["compile_config"].backend = change.get("backend", extra["compile_config"].backend)
            return extra
        generation.decode_kwargs = with_compile_change
    model, processor = load_policy(folder, device=device, dtype=dtype)
    examples = [Example(Image.new("RGB", (56, 84), (200, 10, 10)), "Count.", "1"),
                Example(Image.new("RGB", (112, 112), (20, 100, 10)), "How many circles are in the image?", "2")]
    settings = GenerationSettings(group_size=3, max_new_tokens=12, temperature=1.0, decode=path)
    with attention:
        rollout = generate_groups(model, processor, examples, settings, seed=5)
        with torch.no_grad():
            trained = LogprobScorer(processor, temperature=1.0)(model, rollout)[0]  # (N, T)
    mask = rollout.completion_mask.bool()  # (N, T)
    gap = (rollout.sampler_logp - trained.float()).abs() * mask  # (N, T)
    d = (trained.float() - rollout.sampler_logp)[mask]  # old - sampler on the sampled tokens
    return {"first": float(gap[:, 0].max()), "later": float(gap[:, 1:].max()),
            "later_step": int(gap[:, 1:].max(0).values.argmax()) + 1,
            "kl": float((torch.expm1(d) - d).mean())}  # k3 of KL(sampler || training), as the run logs it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--arch", default="qwen2_5_vl")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--paths", default="dynamic,static,compiled")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--jobs", type=int, default=1, help="(setting, path) runs at once")
    parser.add_argument("--stderr-dir", default=None, help="keep each run's stderr here (with TORCH_LOGS=output_code: inductor's code)")
    parser.add_argument("--one", nargs=3, metavar=("FOLDER", "PATH", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], args.device, args.one[1], args.one[2], args.dtype)))
        return
    from vlmrl.models import build_tiny_model

    folder = str(build_tiny_model(Path(tempfile.mkdtemp()) / args.arch, size="tiny", arch=args.arch, seed=0))
    print(f"{args.arch}, {args.dtype}, {args.device}: largest |sampler - training| log-prob, mismatch KL (k3)")
    print("| setting | path | first step | later steps (at step) | mismatch KL |\n|---|---|---:|---:|---:|")
    runs = [(setting, path) for setting in args.settings.split(",") for path in args.paths.split(",")
            if path == "compiled" or not ("mode" in SETTINGS[setting] or "backend" in SETTINGS[setting])]
    for start in range(0, len(runs), args.jobs):
        batch = runs[start:start + args.jobs]
        started = [subprocess.Popen([sys.executable, __file__, "--device", args.device, "--dtype", args.dtype,
                                     "--one", folder, path, setting],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for setting, path in batch]
        for (setting, path), process in zip(batch, started):
            out, err = process.communicate()
            if args.stderr_dir:
                Path(args.stderr_dir, f"{setting}-{path}.txt".replace("+", "_")).write_text(err)
            if process.returncode:
                print(f"| {setting} | {path} | failed: {err.strip().splitlines()[-1][:120]} | |")
                continue
            gap = json.loads(out.strip().splitlines()[-1])
            print(f"| {setting} | {path} | {gap['first']:.2e} | {gap['later']:.2e} ({gap['later_step']}) | "
                  f"{gap['kl']:.2e} |", flush=True)

if __name__ == "__main__":
    main()
