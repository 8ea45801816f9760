"""Per-call cost of every tool on this CPU at the census demo's sizes: zoom, find_objects, measure, the model tools.

Run: `OMP_NUM_THREADS=1 python benchmarks/tool_costs.py [--repeats 20]`. The scenes are the census task's
(`vlmrl demo --preset census`: 448 px originals, a 112 px view), each call runs through `run_tool` as the rollout
runs it, with the tools showing `rollout.tool_image_side` = 112 px, on one thread (torch's and OpenCV's). Each
model tool of the model-tool table (`vlmrl.tools.model_table.MODEL_TOOLS`, or `vlmrl.tools.model_tools.MODEL_KINDS`
before it) runs its tiny random build (`build_tiny_tool_model(out, name)`, built here in a temporary folder), with
the arguments its signature asks for (the census colour's phrase, a box or a point: `ARGUMENTS`).

Columns, each a median in milliseconds per call: of `--repeats` calls for the built-in tools; for a model tool,
of `--repeats` / 4 (at least 3) turns of 8, each after 8 calls alone and their hits (the load drifts):
- alone: a call computed by itself, each on a scene not seen before (no cache hit; the digest of the image,
  the work, the overlay and `run_tool`'s checks of the result);
- in a batch of 8: a turn of 8 calls on 8 new scenes, computed in one forward by the model tool's `prefetch`,
  then run (answered from its cache), as the tool rollout runs a turn: the whole over 8 (model tools only);
- a cache hit: the same call again on the same scene (the tools that keep a cache: the model tools,
  find_objects, measure; a measure of boxes alone is computed every time, by design).
The first find_objects call (making its colour table) and each model tool's first call (loading its model)
are printed apart. A hit costs mostly the digest of the 448 px image (cache.image_key: about a millisecond). Prints a markdown table after a line naming the machine (CPU model, threads, torch, OpenCV, the
load average before and after: the machine may be shared).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

SIDE = 112
"""The census demo's rollout.tool_image_side: the side of the images the tools return."""
BATCH = 8
"""Calls of one turn computed together by a model tool's prefetch."""
ARGUMENTS: dict[str, Any] = {"query": "{colour} circle", "box": [112, 112, 336, 336], "point": [224, 224],
                             "points": [[224, 224]], "boxes": [[112, 112, 336, 336]]}
"""A model tool's argument by name ({colour}: the census question's colour); a required parameter not here
leaves the tool out of the table (said in a line)."""


def machine_line() -> str:
    """CPU model, cores, threads used, torch and OpenCV versions, load average."""
    import cv2
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return (f"{model}, {os.cpu_count()} cores, torch {torch.__version__} on {torch.get_num_threads()} thread(s), "
            f"OpenCV {cv2.__version__} on {cv2.getNumThreads()} thread(s), load average "
            f"{', '.join(f'{v:.2f}' for v in os.getloadavg())}")


def census_scenes() -> Iterator[tuple[Any, str]]:
    """(448 px original, the colour asked about) of the census test examples 0, 1, 2, ... (the demo's task
    settings): each a scene no tool has seen yet."""
    from vlmrl.tasks import get_task

    task = get_task("census", seed=0, questions=["count"], instructions=False, teacher="regions")
    for index in itertools.count():
        example = task.example(index, split="test")
        yield example.originals[0], example.meta["asked"][0]


def model_tool_names() -> list[str]:
    """The model tools of the model-tool table (model_table.MODEL_TOOLS; before it, model_tools.MODEL_KINDS)."""
    try:
        return list(importlib.import_module("vlmrl.tools.model_table").MODEL_TOOLS)
    except ImportError:
        return list(importlib.import_module("vlmrl.tools.model_tools").MODEL_KINDS)


def median_ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1000:.1f}"


class Bench:
    """Runs calls through `run_tool` on the census scenes, as the rollout does."""

    def __init__(self, tools: dict, repeats: int):
        from vlmrl.tools import ToolLimits

        self.tools, self.repeats, self.limits = tools, repeats, ToolLimits()
        self.batches = max(3, repeats // 4)
        self.scenes = census_scenes()

    def run(self, name: str, scene: Any, arguments: dict) -> float:
        """Seconds of one call (an error result stops the benchmark: its arguments are wrong)."""
        from vlmrl.tools import ToolCall, ToolContext, run_tool

        context = ToolContext([scene], max_side=SIDE)
        start = time.perf_counter()
        result = run_tool(ToolCall(name, arguments), self.tools, context, self.limits)
        took = time.perf_counter() - start
        if result.error is not None:
            raise RuntimeError(f"{name}({arguments}): {result.text}")
        return took

    def alone_and_hit(self, name: str, arguments_of, repeats: int) -> tuple[list[float], list[float]]:
        """Seconds of `repeats` calls each on a new scene, and of the same call again (`arguments_of(scene,
        colour)` -> the call's arguments)."""
        alone, hit = [], []
        for _ in range(repeats):
            scene, colour = next(self.scenes)
            arguments = arguments_of(scene, colour)
            alone.append(self.run(name, scene, arguments))
            hit.append(self.run(name, scene, arguments))
        return alone, hit

    def batched(self, name: str, arguments_of) -> tuple[list[float], list[float], list[float]]:
        """Seconds per call of turns of BATCH calls on new scenes: the tool's prefetch, then each call; between
        them (the machine's load drifts), as many calls alone and their hits (`alone_and_hit`)."""
        from vlmrl.tools import ToolContext

        alone, hit, per_call = [], [], []
        for _ in range(self.batches):
            one, again = self.alone_and_hit(name, arguments_of, BATCH)
            alone, hit = alone + one, hit + again
            turn = [(scene, arguments_of(scene, colour)) for scene, colour in (next(self.scenes) for _ in range(BATCH))]
            start = time.perf_counter()
            self.tools[name].prefetch([(ToolContext([scene], max_side=SIDE), arguments) for scene, arguments in turn])
            for scene, arguments in turn:
                self.run(name, scene, arguments)
            per_call.append((time.perf_counter() - start) / BATCH)
        return alone, hit, per_call


def two_ids(scene: Any, colour: str) -> dict:
    """measure's arguments for the first two regions of `colour` (one when there is only one)."""
    from vlmrl.tools.cv_tools import find_regions

    regions, _ = find_regions(scene, colour)
    return {"ids": list(range(1, min(len(regions), 2) + 1)), "colour": colour}


CV_CALLS: dict[str, tuple[str, Any]] = {
    'zoom(box=[112, 112, 224, 224])': ("zoom", lambda scene, colour: {"box": [112, 112, 224, 224]}),
    'find_objects(colour=C)': ("find_objects", lambda scene, colour: {"colour": colour}),
    'find_objects() (all colours)': ("find_objects", lambda scene, colour: {}),
    'measure(ids=[1, 2], colour=C) (regions)': ("measure", two_ids),
    'measure(colour=C) (area statistics)': ("measure", lambda scene, colour: {"colour": colour}),
    'measure(boxes=[two boxes]) (boxes)': ("measure", lambda scene, colour: {
        "boxes": [[0, 0, 50, 50], [100, 100, 200, 150]]}),
}
"""The built-in tools' calls timed (C: the census question's colour), by label: (tool, arguments of a scene)."""


def model_arguments(tool: Any, name: str) -> list[dict]:
    """Candidate arguments of model tool `tool` from its signature (its `prepare`'s, else its own, after the
    context): the required ones from ARGUMENTS (with "{colour}" to fill), then the same with each optional one
    of ARGUMENTS added (a tool that needs a box or a point). Empty when a required one is not in ARGUMENTS."""
    signature = inspect.signature(getattr(tool, "prepare", tool))
    parameters = list(signature.parameters.values())[1:]
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p not in ARGUMENTS for p in required):
        print(f"{name}: no sample value for its argument(s) {[p for p in required if p not in ARGUMENTS]}: left out")
        return []
    base = {p: ARGUMENTS[p] for p in required}
    return [base] + [base | {p.name: ARGUMENTS[p.name]} for p in parameters
                     if p.name not in base and p.name in ARGUMENTS]


def filled(arguments: dict, colour: str) -> dict:
    return {k: v.format(colour=colour) if isinstance(v, str) else v for k, v in arguments.items()}


def model_rows(bench_repeats: int, out: Path) -> list[str]:
    """The table's rows of every model tool (tiny builds in `out`)."""
    from vlmrl.models.tool_models import build_tiny_tool_model
    from vlmrl.tools import resolve_tools

    rows = []
    for name in model_tool_names():
        try:
            folder = build_tiny_tool_model(out / name, name)
            tools = resolve_tools([name], {name: str(folder)})
        except Exception as error:  # noqa: BLE001 - a tool of the table not buildable here: said, left out
            print(f"{name}: the tiny build failed ({type(error).__name__}: {error}): left out")
            continue
        bench = Bench(tools, bench_repeats)
        scene, colour = next(bench.scenes)
        chosen, start = None, time.perf_counter()
        for candidate in model_arguments(tools[name], name):
            try:
                bench.run(name, scene, filled(candidate, colour))
            except RuntimeError as error:
                print(f"{name}: {error}")
                continue
            chosen = candidate
            break
        if chosen is None:
            continue
        print(f"{name}: first call (loads the model) {(time.perf_counter() - start) * 1000:.0f} ms")
        alone, hit, batched = bench.batched(name, lambda s, c: filled(chosen, c))
        shown = ", ".join(f"{k}={v!r}" for k, v in filled(chosen, "C").items())
        rows.append(f"| `{name}({shown})`, tiny build | {median_ms(alone)} | {median_ms(batched)} | {median_ms(hit)} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import cv2
    import torch

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    from vlmrl.tools import resolve_tools

    before = machine_line()
    tools = resolve_tools(["zoom", "find_objects", "measure"])
    bench = Bench(tools, args.repeats)
    scene, colour = next(bench.scenes)
    start = time.perf_counter()
    bench.run("find_objects", scene, {"colour": colour})
    print(f"first find_objects call (makes its colour table; OpenCV already imported): "
          f"{(time.perf_counter() - start) * 1000:.0f} ms")
    rows = []
    for label, (name, arguments_of) in CV_CALLS.items():
        alone, hit = bench.alone_and_hit(name, arguments_of, args.repeats)
        cached = name != "zoom" and "boxes" not in label
        rows.append(f"| `{label}` | {median_ms(alone)} | - | {median_ms(hit) if cached else '-'} |")
    with tempfile.TemporaryDirectory() as out:
        rows += model_rows(args.repeats, Path(out))
    print(f"\nmachine: {before}\nafter: load average {', '.join(f'{v:.2f}' for v in os.getloadavg())}")
    turns = max(3, args.repeats // 4)
    print(f"census scenes (448 px originals), tools showing {SIDE} px, ms per call: median of {args.repeats} calls "
          f"(model tools: {turns} turns of {BATCH} and {turns * BATCH} calls alone)\n")
    print(f"| call | alone | in a batch of {BATCH} (prefetch) | a cache hit |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
