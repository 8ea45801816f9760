"""`vlmrl compare STUDY.yaml`: a grid of arms x seeds, run and compared in one command.

A study file names the arms (each a config plus overrides, trained with `vlmrl train` or `sft`),
the seeds, and where the runs go:

    output_dir: runs/study-shapes
    seeds: [0, 1, 2]
    parallel: 1                 # runs at once, each its own process (cores / threads each)
    threads: 1                  # OMP_NUM_THREADS of each run (the warm start, alone, gets parallel x threads)
    common: [train.trackers=[]] # overrides of every run
    eval_split: test            # the held-out accuracy the table compares: eval/<split>/accuracy
    warm_start:                 # optional: one run first; {warm_start} in any override is its final model
      command: sft
      config: configs/shapes_sft_tiny.yaml
      overrides: [train.steps=100]
    arms:
      - {name: grpo, config: configs/shapes_grpo_tiny.yaml, overrides: [model.name_or_path={warm_start}]}
      - {name: more-sft, command: sft, config: configs/shapes_sft_tiny.yaml, overrides: [train.steps=140]}

Run `arm` with seed `s` lives in OUTPUT_DIR/arm/seed_s, with its own log (run.log). The grid is
resumable: a run with its final model is skipped, one with a checkpoint continues from it
(resume=true), the others start; a failed run is named with its log and the others go on. Then
OUTPUT_DIR/compare.html (held-out accuracy mean +- std per arm, curves against step and wall clock
with the seeds' spread as a band) and compare.md (the table) are written (report/compare.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from vlmrl.config import read_yaml
from vlmrl.errors import VlmrlError, require
from vlmrl.fields import Naming, build
from vlmrl.report.compare import write_comparison

WARM_START = "{warm_start}"
"""Written in an override, stands for the warm-start run's final model folder."""


@dataclass
class RunSpec:
    """One training command of the study."""

    config: str = ""
    """The config file of the run."""
    command: str = "train"
    """train (RL) or sft."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides on top of the config and the study's `common` ones."""

    def validate(self) -> None:
        require((self.command in ("train", "sft"), f"a study run's command must be train or sft; got {self.command!r}"),
                (bool(self.config), "every study run needs a config file (config: PATH)"),
                (Path(self.config).is_file(), f"study config file {self.config!r} does not exist"))


@dataclass
class Arm(RunSpec):
    """A row of the comparison: a run spec with a name."""

    name: str = ""
    """The arm's name (its folder and its row)."""

    def validate(self) -> None:
        super().validate()
        require((bool(self.name) and "/" not in self.name, f"every arm needs a name without '/'; got {self.name!r}"))


@dataclass
class Study:
    """A grid of arms x seeds (see the module doc)."""

    arms: list[Arm] = field(default_factory=list)
    """The arms, in the order of the table."""
    output_dir: str = "runs/study"
    """Where the runs, compare.html and compare.md go."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of every arm (the run's `seed`)."""
    parallel: int = 1
    """Runs at once, each in its own process."""
    threads: int = 1
    """OMP_NUM_THREADS of each run (parallel x threads should not exceed the cores)."""
    common: list[str] = field(default_factory=list)
    """Overrides of every run."""
    eval_split: str = "test"
    """The held-out split whose accuracy (eval/<split>/accuracy, last evaluation) the table compares."""
    warm_start: None | RunSpec = None
    """A run made once before the grid; {warm_start} in an override is its final model."""

    def validate(self) -> None:
        names = [arm.name for arm in self.arms]
        require((bool(self.arms), "a study needs at least one arm"),
                (len(set(names)) == len(names), f"arm names must differ; got {names}"),
                (bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), f"seeds must differ; got {self.seeds}"),
                (self.parallel >= 1 and self.threads >= 1, "parallel and threads must be >= 1"))


def load_study(path: str | Path) -> Study:
    """The study in a YAML file: every key and type checked, config files present."""
    return build(Study, read_yaml(path), Naming(noun="study key"))


@dataclass
class Run:
    """One process of the study: what it runs and where."""

    name: str
    """arm/seed_s, or warm_start."""
    spec: RunSpec
    folder: Path
    seed: int | None
    """None for the warm start (its config's seed)."""

    @property
    def finished(self) -> bool:
        return (self.folder / "final").is_dir() and (self.folder / "metrics.jsonl").is_file()

    @property
    def resumable(self) -> bool:
        return any((self.folder / "checkpoints").glob("step_*"))

    def argv(self, study: Study, warm_model: str) -> list[str]:
        overrides = [item.replace(WARM_START, warm_model) for item in [*study.common, *self.spec.overrides]]
        overrides += [f"output_dir={self.folder}"] + ([f"seed={self.seed}"] if self.seed is not None else [])
        return [sys.executable, "-m", "vlmrl", self.spec.command, self.spec.config, *overrides,
                *(["resume=true"] if self.resumable and not self.finished else [])]


def plan(study: Study) -> tuple[Run | None, list[Run]]:
    """The warm-start run (or None) and the grid's runs, arm by arm, seed by seed."""
    root = Path(study.output_dir)
    warm = Run("warm_start", study.warm_start, root / "warm_start", None) if study.warm_start else None
    grid = [Run(f"{arm.name}/seed_{seed}", arm, root / arm.name / f"seed_{seed}", seed)
            for arm in study.arms for seed in study.seeds]
    uses_warm = any(WARM_START in item for run in grid for item in [*study.common, *run.spec.overrides])
    if uses_warm and warm is None:
        raise VlmrlError(f"an override uses {WARM_START} but the study has no warm_start")
    if warm is not None and any(WARM_START in item for item in [*study.common, *warm.spec.overrides]):
        raise VlmrlError(f"{WARM_START} is the warm start's final model: it cannot be in common or in the "
                         "warm start's own overrides (both apply to the warm start); put it in the arms' overrides")
    return warm, grid


def start(run: Run, study: Study, warm_model: str, threads: int) -> subprocess.Popen:
    """The run's process (`threads` torch threads), its output going to FOLDER/run.log."""
    run.folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    argv = run.argv(study, warm_model)
    with (run.folder / "run.log").open("a") as log:  # the child keeps its own copy of the file
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


@contextlib.contextmanager
def stopping(active: dict):
    """Within: if the study stops (Ctrl-C, an error), its running processes are asked to stop too
    (SIGTERM: each saves a checkpoint after its step, so the next `vlmrl compare` resumes them)."""
    try:
        yield
    except BaseException:
        for _, process in active.values():
            process.terminate()
        for _, process in active.values():
            process.wait()
        raise


def execute(runs: list[Run], study: Study, warm_model: str, label: str, parallel: int, threads: int) -> list[str]:
    """Run the unfinished `runs`, `parallel` at a time with `threads` threads each, with one progress
    bar; returns the failures as "name (exit N; see LOG)", in the order of `runs`."""
    pending = [run for run in runs if not run.finished]
    failed: dict[str, str] = {}
    active: dict[str, tuple[Run, subprocess.Popen]] = {}
    with tqdm(total=len(runs), initial=len(runs) - len(pending), desc=label, unit="run", dynamic_ncols=True) as bar, \
            stopping(active):
        while pending or active:
            while pending and len(active) < parallel:
                run = pending.pop(0)
                active[run.name] = (run, start(run, study, warm_model, threads))
                bar.set_postfix_str(", ".join(active))  # which runs are going
            time.sleep(0.5)
            for name, (run, process) in list(active.items()):
                if process.poll() is None:
                    continue
                del active[name]
                bar.update(1)
                if process.returncode != 0 or not run.finished:
                    failed[name] = f"{name} (exit {process.returncode}; see {run.folder / 'run.log'})"
    return [failed[run.name] for run in runs if run.name in failed]  # not in the order they ended


def run_study(path: str | Path, report_only: bool = False) -> Path:
    """Run the study's unfinished runs (unless `report_only`), then write its comparison; returns
    compare.html. VlmrlError naming the runs that failed (the report holds the others)."""
    study = load_study(path)
    warm, grid = plan(study)
    failed: list[str] = []
    if not report_only:
        if warm is not None:
            failed = execute([warm], study, "", "warm start", 1, study.parallel * study.threads)  # alone: every core
            if failed:
                raise VlmrlError(f"the warm-start run failed: {failed[0]}")
        failed = execute(grid, study, str(warm.folder / "final") if warm else "", "study", study.parallel, study.threads)
    page = write_comparison(study, grid)
    if failed:
        raise VlmrlError(f"{len(failed)} of {len(grid)} runs failed: {'; '.join(failed)}; the comparison in {page} "
                         "holds the others, and the command resumes the failed ones")
    return page
