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
    before:                     # optional: more runs after the warm start, in order; {NAME} is one's final model
      - {name: teacher, config: configs/shapes_grpo_tiny.yaml, overrides: [model.name_or_path={warm_start}]}
    arms:
      - {name: grpo, config: configs/shapes_grpo_tiny.yaml, overrides: [model.name_or_path={warm_start}]}
      - {name: more-sft, command: sft, config: configs/shapes_sft_tiny.yaml, overrides: [train.steps=140]}
      - {name: distill, config: configs/shapes_grpo_tiny.yaml,
         overrides: [model.name_or_path={warm_start}, algorithm.teacher={teacher}]}

A `config:` path is looked up next to the study file first, then in the working directory (so a
study file written for the working directory, like the shipped ones, works from there). The
output_dir and every path inside an override belong to the runs, and are read from the working
directory as `vlmrl train` reads them. An arm's name, and a `before` run's, is a plain folder name,
not one of the study's own (compare.html, compare.md, warm_start), and no two are alike.

The preparatory runs (the warm start, then each `before` run in order) run one at a time, each
with every thread, before the grid; each in OUTPUT_DIR/NAME (OUTPUT_DIR/warm_start for the warm
start). `{NAME}` in an arm's overrides, or in a later preparatory run's, is that run's final
model: a teacher for distillation, say, trained from the warm start. `common` applies to the
preparatory runs too, so it may name none of them.

Run `arm` with seed `s` lives in OUTPUT_DIR/arm/seed_s, with its own log (run.log). Before the
first run starts, the study holds OUTPUT_DIR (a second study there is refused: folder_lock.py) and
resolves every run's config (file, `common`, the arm's overrides, its seed) as `vlmrl config`
does, so a bad override is one line before the warm start, not hours later. Each run's resolved
spec is kept in RUN/study_spec.json; a run that has a checkpoint or its final model and whose spec
has changed since (an edited override, config file, or a preparatory run it uses) is refused
with what changed: it is never reused silently. The grid is resumable: a run with its final model
is skipped, one with a checkpoint continues from it (resume=true), the others start; a failed run
is named with its log and the others go on. However the study is stopped (Ctrl-C, SIGTERM to it or
to one of its runs), each run saves a checkpoint after its step and running the same command again
continues it exactly (processes.py). Then OUTPUT_DIR/compare.html (held-out accuracy mean +-
std per arm, curves against step and wall clock with the seeds' spread as a band) and compare.md
(the table) are written (report/compare.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vlmrl.config import load_config, read_yaml, saved_dict
from vlmrl.disk import writing
from vlmrl.errors import Stopped, VlmrlError, require, warn
from vlmrl.fields import Naming, build
from vlmrl.report.compare import write_comparison
from vlmrl.safety.folder_lock import hold, holder
from vlmrl.safety.resume import flatten
from vlmrl.study.processes import Job, Outcome, StopForwarder, checkpoint_step, execute, finished

WARM_FOLDER = "warm_start"
"""The warm start's name: its folder, and `{warm_start}` in an override is its final model."""
WARM_START = "{" + WARM_FOLDER + "}"
RESERVED_NAMES = ("compare.html", "compare.md", WARM_FOLDER)
"""What the study itself writes in OUTPUT_DIR: no arm or before run may be named so (compared without case)."""

SPEC_FILE = "study_spec.json"
"""In each run folder: the spec the run was made with (`Run.resolve`)."""

_PLAIN_NAME = re.compile(r"[\w+=@,-][\w.+=@,-]{0,99}")
"""A folder name that is one path component anywhere: no separator, not hidden, '.' or '..'."""


@dataclass
class RunSpec:
    """One training command of the study."""

    config: str = ""
    """The config file of the run (next to the study file, or in the working directory)."""
    command: str = "train"
    """train (RL) or sft."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides on top of the config and the study's `common` ones."""

    def validate(self) -> None:
        require((self.command in ("train", "sft"), f"a study run's command must be train or sft; got {self.command!r}"),
                (bool(self.config), "every study run needs a config file (config: PATH)"),
                (Path(self.config).is_file(), f"study config file {self.config!r} does not exist"))


@dataclass
class NamedRun(RunSpec):
    """A run spec with a name: its folder, and what the study calls it."""

    name: str = ""
    """A plain folder name."""
    kind = "arm"
    """What the run is, in messages."""

    def validate(self) -> None:
        super().validate()
        require((_PLAIN_NAME.fullmatch(self.name) is not None,
                 f"{'an' if self.kind[0] in 'aeiou' else 'a'} {self.kind}'s name must be a plain folder name (letters, "
                 f"digits, . _ - + = @ ,; at most 100, not starting with '.'); got {self.name!r}"),
                (self.name.lower() not in RESERVED_NAMES,
                 f"{self.kind} name {self.name!r} is taken by the study's own output ({', '.join(RESERVED_NAMES)}): "
                 "rename it"))


@dataclass
class Arm(NamedRun):
    """A row of the comparison (its name is its folder and its row)."""


@dataclass
class BeforeRun(NamedRun):
    """A preparatory run after the warm start: `{name}` in an override is its final model."""

    kind = "before run"


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
    before: list[BeforeRun] = field(default_factory=list)
    """Runs made once after the warm start, in order; {name} in an override is one's final model."""

    def validate(self) -> None:
        names = [run.name for run in [*self.before, *self.arms]]
        require((bool(self.arms), "a study needs at least one arm"),
                (len({name.lower() for name in names}) == len(names),
                 f"the names of the arms and before runs must differ (also in case: some disks ignore it); got {names}"),
                (bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), f"seeds must differ; got {self.seeds}"),
                (self.parallel >= 1 and self.threads >= 1, "parallel and threads must be >= 1"))


def load_study(path: str | Path) -> Study:
    """The study in a YAML file: every key and type checked, config files found (module doc)."""
    data = read_yaml(path)
    arms = data.get("arms") if isinstance(data.get("arms"), list) else []
    before = data.get("before") if isinstance(data.get("before"), list) else []
    for spec in [data.get("warm_start"), *before, *arms]:
        if isinstance(spec, dict) and isinstance(spec.get("config"), str) and spec["config"]:
            spec["config"] = find_config(spec["config"], Path(path).parent)
    return build(Study, data, Naming(noun="study key"))


def find_config(text: str, study_folder: Path) -> str:
    """A study's config path: next to the study file if there, else from the working directory."""
    given = Path(text).expanduser()
    for candidate in ([given] if given.is_absolute() else [study_folder / given, given]):
        if candidate.is_file():
            return str(candidate)
    raise VlmrlError(f"study config file {text!r} does not exist (looked in {study_folder} and in the working "
                     "directory)")


@dataclass
class Run:
    """One process of the study: what it runs and where."""

    name: str
    """arm/seed_s, warm_start, or a before run's name."""
    spec: RunSpec
    folder: Path
    seed: int | None
    """None for a preparatory run (its config's seed)."""

    @property
    def finished(self) -> bool:
        return finished(self.folder)

    @property
    def resumable(self) -> bool:
        return checkpoint_step(self.folder) is not None

    @property
    def who(self) -> str:
        """The run's part of the study, in messages."""
        if isinstance(self.spec, NamedRun):
            return f"{self.spec.kind} {self.spec.name!r}"
        return "the warm start"

    def uses(self, study: Study, prepared: list[Run]) -> list[Run]:
        """The preparatory runs whose final model the run's overrides (or `common`) name."""
        texts = [*study.common, *self.spec.overrides]
        return [run for run in prepared if any(placeholder(run) in item for item in texts)]

    def overrides(self, study: Study, models: dict[str, str]) -> list[str]:
        """`common`, the run's own overrides (each `{name}` of `models` filled in), its folder and its seed."""
        overrides = []
        for item in [*study.common, *self.spec.overrides]:
            for name, model in models.items():
                item = item.replace("{" + name + "}", model)
            overrides.append(item)
        return overrides + [f"output_dir={self.folder}"] + ([f"seed={self.seed}"] if self.seed is not None else [])

    def argv(self, study: Study, models: dict[str, str]) -> list[str]:
        return [sys.executable, "-m", "vlmrl", self.spec.command, self.spec.config, *self.overrides(study, models),
                *(["resume=true"] if self.resumable and not self.finished else [])]

    def resolve(self, study: Study, prepared: list[Run], digests: dict[str, str]) -> dict:
        """The run's spec: its command, its config resolved and checked as `vlmrl config` does (less
        output_dir, resume and resume_changes), and the spec digest of each preparatory run it uses
        (`digests`: by name; the warm start's under "warm_start", the before runs' under "before")."""
        try:
            config = saved_dict(load_config(self.spec.config, self.overrides(study, final_models(prepared))))  # no secret
        except VlmrlError as error:
            raise VlmrlError(f"{self.who} ({self.spec.config}): {error}") from error
        config.pop("output_dir"), config.pop("resume"), config.pop("resume_changes")
        used = [run.name for run in self.uses(study, prepared)]
        spec = {"command": self.spec.command, "config": config,
                "warm_start": digests[WARM_FOLDER] if WARM_FOLDER in used else None}
        if any(name != WARM_FOLDER for name in used):  # absent otherwise: the specs of studies before `before`
            spec["before"] = {name: digests[name] for name in used if name != WARM_FOLDER}
        return json.loads(json.dumps(spec))  # as it reads back from SPEC_FILE (tuples become lists)


def placeholder(run: Run) -> str:
    """`{name}` of a preparatory run: its final model in an override."""
    return "{" + run.name + "}"


def plan(study: Study) -> tuple[list[Run], list[Run]]:
    """The preparatory runs (the warm start, then the before runs) and the grid's runs, arm by arm,
    seed by seed. VlmrlError when a run names a preparatory run that is not made before it."""
    root = Path(study.output_dir)
    prepared = [Run(WARM_FOLDER, study.warm_start, root / WARM_FOLDER, None)] if study.warm_start else []
    prepared += [Run(run.name, run, root / run.name, None) for run in study.before]
    grid = [Run(f"{arm.name}/seed_{seed}", arm, root / arm.name / f"seed_{seed}", seed)
            for arm in study.arms for seed in study.seeds]
    if not study.warm_start and any(WARM_START in item for run in [*prepared, *grid]
                                    for item in [*study.common, *run.spec.overrides]):
        raise VlmrlError(f"an override uses {WARM_START} but the study has no warm_start")
    for index, run in enumerate(prepared):
        for used in run.uses(study, prepared[index:]):  # itself or one made after it
            made = "the warm start's" if used.name == WARM_FOLDER else f"{used.who}'s"
            raise VlmrlError(f"{placeholder(used)} is {made} final model, not made before {run.who} that uses it: it "
                             f"cannot be in common (which applies to every run) or in the overrides of {used.who} or "
                             "of a run made before it; put it in the arms' overrides or in a later before run's")
    return prepared, grid


def final_models(prepared: list[Run]) -> dict[str, str]:
    """What each `{name}` stands for: the preparatory run's final model folder."""
    return {run.name: str(run.folder / "final") for run in prepared}


def check_runs(study: Study, prepared: list[Run], grid: list[Run]) -> dict[str, dict]:
    """Before anything runs: every run's spec resolved (a bad config or override is a VlmrlError
    naming the arm), no run folder in use by a live process, and no run with progress made with
    another spec (`refuse_changed`). Returns each run's spec by name."""
    specs: dict[str, dict] = {}
    digests: dict[str, str] = {}
    for run in [*prepared, *grid]:
        specs[run.name] = run.resolve(study, prepared, digests)
        if run in prepared:  # a later run that uses it records this digest: it changes when this spec does
            digests[run.name] = hashlib.sha256(json.dumps(specs[run.name], sort_keys=True).encode()).hexdigest()[:16]
    for run in [*prepared, *grid]:
        if (pid := holder(run.folder)) is not None:
            raise VlmrlError(f"{run.folder} is in use by another vlmrl run (process {pid}), perhaps of an earlier "
                             "study that was killed: wait for it to end or stop it, then run the study again")
        refuse_changed(run, specs[run.name])
    return specs


def refuse_changed(run: Run, spec: dict) -> None:
    """VlmrlError when the run has a checkpoint or its final model and SPEC_FILE says it was made
    with another spec (or cannot say: none, made by an older vlmrl, or unreadable); saying what
    changed and what to do."""
    if not (run.finished or run.resumable):
        return  # nothing to reuse: it starts from step 0 with the new spec
    folder = run.folder.parent if isinstance(run.spec, Arm) else run.folder
    remedy = (f"to keep those runs, give the study another output_dir; to run it again, delete {folder}"
              + ("" if isinstance(run.spec, Arm) else " and the folders of the runs that use it"))
    try:
        recorded = json.loads((run.folder / SPEC_FILE).read_text())
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict):
        raise VlmrlError(f"{run.folder} holds a run with no readable record of its spec ({SPEC_FILE}; made by an "
                         f"older vlmrl?), which cannot be reused unchecked: {remedy}")
    changes = spec_changes(recorded, spec)
    if changes:
        shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
        raise VlmrlError(f"{run.who} changed since {run.folder} was made ({shown}): {remedy}")


def spec_changes(before: dict, after: dict) -> list[str]:
    """`key: old -> new` for every setting that differs between two specs (`Run.resolve`). A key
    only one of them has (a setting a later vlmrl added or removed) is no change of the user's,
    but a preparatory run used by one spec and not the other is."""
    old, new = flatten(before), flatten(after)
    changes = []
    for key in sorted(old.keys() | new.keys()):
        if key == "warm_start" and old.get(key) != new.get(key):
            changes.append("the warm start it starts from")
        elif key.startswith("before.") and old.get(key) != new.get(key):
            changes.append(f"the run {key.removeprefix('before.')!r} it uses")
        elif key in old and key in new and json.dumps(old.get(key)) != json.dumps(new.get(key)):
            changes.append(f"{key.removeprefix('config.')}: {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}")
    return changes


def record_specs(runs: list[Run], specs: dict[str, dict]) -> None:
    """Each unfinished run's spec into its SPEC_FILE (checked by `check_runs` on the next start)."""
    for run in runs:
        if not run.finished:
            with writing("the run's spec", run.folder / SPEC_FILE):
                run.folder.mkdir(parents=True, exist_ok=True)
                (run.folder / SPEC_FILE).write_text(json.dumps(specs[run.name], indent=1) + "\n")


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warn_if_oversubscribed(study: Study) -> None:
    """One line when parallel x threads is more than the cores: the runs would slow each other and
    the table's training times would say so."""
    cores, wanted = usable_cores(), study.parallel * study.threads
    if wanted > cores:
        warn(f"parallel {study.parallel} x threads {study.threads} = {wanted} threads on {cores} core"
             f"{'s' if cores > 1 else ''}: the runs slow each other down, and the table's training times with them; "
             "lower parallel or threads")


def run_study(path: str | Path, report_only: bool = False) -> Path:
    """Run the study's unfinished runs (unless `report_only`), then write its comparison; returns
    compare.html. VlmrlError naming the runs that failed or were stopped (the report holds the
    others); Stopped when the study itself was stopped by a signal."""
    study = load_study(path)
    prepared, grid = plan(study)
    if report_only:
        return write_comparison(study, grid)
    folder_lock = hold(study.output_dir, "another vlmrl compare")
    try:
        specs = check_runs(study, prepared, grid)
        warn_if_oversubscribed(study)
        record_specs([*prepared, *grid], specs)
        unfinished = [outcome for outcome in run_all(study, prepared, grid, path) if not outcome.done]
        page = write_comparison(study, grid)
    finally:
        folder_lock.release()
    if unfinished:
        raise VlmrlError(f"{len(unfinished)} of {len(grid)} runs did not finish: "
                         f"{'; '.join(outcome.describe() for outcome in unfinished)}; the comparison in {page} holds "
                         "the others; run the same command again to continue them")
    return page


def run_all(study: Study, prepared: list[Run], grid: list[Run], path: str | Path) -> list[Outcome]:
    """The preparatory runs (one at a time, each with every thread), then the grid; the grid's
    outcomes. Stopped when a stop signal came, once the running runs have saved their checkpoints
    and ended."""
    models = final_models(prepared)
    with StopForwarder() as stops:
        for run in prepared:
            label = "warm start" if run.name == WARM_FOLDER else run.name
            outcomes = execute([Job(run.name, run.folder, run.argv(study, models))], 1,
                               study.parallel * study.threads, label, stops)
            stop_if_asked(stops, outcomes, path)
            if outcomes and not outcomes[0].done:
                raise VlmrlError(f"{run.who} did not finish: {outcomes[0].describe()}; run the same command again "
                                 "to continue it")
        jobs = [Job(run.name, run.folder, run.argv(study, models)) for run in grid]
        outcomes = execute(jobs, study.parallel, study.threads, "study", stops)
        stop_if_asked(stops, outcomes, path)
    return outcomes


def stop_if_asked(stops: StopForwarder, outcomes: list[Outcome], path: str | Path) -> None:
    """Stopped (one line: where each run continues, and how) when the study received a stop signal."""
    if not stops.received:
        return
    runs = "; ".join(outcome.describe() for outcome in outcomes if not outcome.done) or "no run was going"
    raise Stopped(stops.received[0], f"{signal.Signals(stops.received[0]).name} received: the study stopped ({runs}); "
                                     f"to continue, run the same command again: vlmrl compare {path}")
