"""Per-call cost of the model tool `depth` (tools/depth_tool.py) on this CPU, on the tiny Depth Anything or a folder.

Run: `OMP_NUM_THREADS=1 python benchmarks/bench_depth_tool.py [--calls 20] [--model FOLDER] [--small]`.
Without --model it builds the tiny Depth Anything (`vlmrl tiny-model OUT --tool depth`) in a temporary
folder. Each call runs through `run_tool`, as the rollout runs it, on a 448x448 census-like scene
(bench_cv_tools.py's), the tools showing 448 px, with two regions to compare. Prints the first call
(the model's load), the median and 90th percentile of `--calls` calls on different images (no cache
hit), of the same calls again (all cache hits), and one turn of 8 calls computed in one forward
(`ModelTool.prefetch`) against the same 8 one at a time. `--small` also times one forward of a random
Depth Anything of Depth-Anything-V2-Small's shape (24.8M parameters, DINOv2-S; 518 x 518 input, what a
square image becomes; random weights cost the same).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cv_tools import census_scene, timed  # noqa: E402

REGIONS = [[40, 40, 120, 120], [300, 280, 420, 400]]


def small_forward() -> tuple[int, float]:
    """(parameters, seconds of one forward) of a random Depth Anything of V2-Small's shape on one 518x518 input
    (the second of two: the first warms up)."""
    import torch
    from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation

    config = DepthAnythingConfig(backbone_config={"model_type": "dinov2", "image_size": 518, "hidden_size": 384,
                                                  "num_attention_heads": 6, "out_indices": [3, 6, 9, 12],
                                                  "reshape_hidden_states": False, "apply_layernorm": True})
    model = DepthAnythingForDepthEstimation(config).eval()
    pixels = torch.randn(1, 3, 518, 518)
    with torch.inference_mode():
        for _ in range(2):
            start = time.perf_counter()
            model(pixel_values=pixels)
    return sum(p.numel() for p in model.parameters()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--model", default=None, help="a depth model folder (default: the tiny Depth Anything)")
    parser.add_argument("--small", action="store_true", help="also time a V2-Small-size Depth Anything's forward")
    args = parser.parse_args()
    from vlmrl.models.tool_models import build_tiny_tool_model
    from vlmrl.tools import ToolCall, ToolContext, ToolLimits, resolve_tools, run_tool

    folder = args.model or str(build_tiny_tool_model(Path(tempfile.mkdtemp()) / "depth", "depth"))
    tools, limits = resolve_tools(["depth"], {"depth": folder}), ToolLimits()
    depth = tools["depth"]
    scenes = [census_scene(seed) for seed in range(args.calls + 8)]

    def run(scene, **arguments):
        result = run_tool(ToolCall("depth", arguments), tools, ToolContext([scene], max_side=448), limits)
        assert result.error is None, result.text
        return result

    start = time.perf_counter()
    run(scenes[-1], regions=REGIONS)
    print(f"first call (loads the model): {(time.perf_counter() - start) * 1000:.0f} ms")
    print(f"{args.calls} calls each, 448x448 scene, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| call | median ms | p90 ms |\n|---|---|---|")
    for label in ("computed", "from the cache"):
        queue = iter(scenes[:args.calls])
        times = sorted(timed(lambda: run(next(queue), regions=REGIONS), args.calls))
        print(f"| `depth(regions=[2 boxes])`, {label} | {statistics.median(times):.1f} | "
              f"{times[int(0.9 * (len(times) - 1))]:.1f} |")
    turn = [(ToolContext([scene], max_side=448), {"box": [0, 0, 224, 448]}) for scene in scenes[args.calls:]]
    start = time.perf_counter()
    depth.prefetch(turn)
    together = (time.perf_counter() - start) * 1000
    alone = type(depth)(depth.folder, cache_size=0)
    start = time.perf_counter()
    for context, arguments in turn:
        alone(context, **arguments)
    print(f"a turn of {len(turn)} calls: {together:.0f} ms in one forward, "
          f"{(time.perf_counter() - start) * 1000:.0f} ms one at a time")
    if args.small:
        parameters, seconds = small_forward()
        print(f"V2-Small-size Depth Anything ({parameters / 1e6:.1f}M parameters, 518x518): one forward {seconds:.2f} s")


if __name__ == "__main__":
    main()
