"""The shape of the code: the layers of pyproject.toml's import contracts, no import cycle, small
functions, and few parameters on the path of a training step."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "vlmrl"
MAX_LINES = 60
MAX_PARAMETERS = 5
STEP_MODULES = ("training/trainer", "training/sft", "training/policy_update", "training/experience",
                "training/session", "training/reference", "training/logprobs", "training/packing",
                "training/output_layer", "rollout/scoring", "rollout/generation", "rollout/prefill",
                "rollout/completions", "rollout/prompts", "rollout/tool_rollout", "rollout/trajectories",
                "models/token_inputs", "models/support", "safety/faults", "report/rollout_log", "tools/calls",
                "tools/running", "tools/results",
                "grpo", "seeds")
"""The modules a training step runs through (docs/development.md, "One training step, file by file")."""


def functions(path: Path):
    """(name, first line, lines, parameters other than self/cls) of every function in `path`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            names += [f"*{a.arg}" for a in (args.vararg, args.kwarg) if a is not None]
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1, names


def test_the_import_contracts_hold():
    """pyproject.toml [tool.importlinter]: the layers, and what tasks, rewards and grpo may not import."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0
    finally:
        os.chdir(cwd)


def test_no_import_cycle():
    graph = grimp.build_graph("vlmrl")
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for child in sorted(edges[module]):
            if state.get(child) == 1:
                cycle = path[path.index(child):] + [child] if child in path else [module, child]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if child not in state:
                visit(child, path + [child])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_no_function_is_longer_than_60_lines():
    long = [f"{path.relative_to(ROOT)}:{line} {name} ({lines} lines)"
            for path in sorted(SOURCE.rglob("*.py")) for name, line, lines, _ in functions(path) if lines > MAX_LINES]
    assert not long, long


def test_functions_of_the_training_step_take_at_most_5_parameters():
    found = {path.relative_to(SOURCE).with_suffix("").as_posix() for path in SOURCE.rglob("*.py")}
    assert set(STEP_MODULES) <= found, set(STEP_MODULES) - found
    many = [f"{name} in {module}.py:{line} takes {len(params)}: {', '.join(params)}"
            for module in STEP_MODULES for name, line, _, params in functions(SOURCE / f"{module}.py")
            if len(params) > MAX_PARAMETERS]
    assert not many, many
