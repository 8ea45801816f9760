"""What a reward function of your own cannot do to the run (rewards/contain.py): in the reward worker or,
a function of `__main__`, contained in the trainer's process; and what every reward answer is checked
against (rewards/score.py): lists of its own, numbers of any kind, values and sums within float32's reach."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmrl.config import MAX_REWARD_TIMEOUT_S, load_config
from vlmrl.errors import VlmrlError
from vlmrl.rewards import contain
from vlmrl.rewards.checks import check_weights
from vlmrl.rewards.reward import Reward, build_rewards, resolve
from vlmrl.rewards.score import RewardError, score_batch
from vlmrl.tasks import Example

TESTS = Path(__file__).resolve().parent

MISBEHAVING = '''
import os, sys, threading, time

def fine(completions):
    return [1.0 for _ in completions]

def exits(completions):
    sys.exit(0)

def ends(completions):
    os._exit(0)

def hangs(completions):
    threading.Event().wait()

def spins(completions):
    while True:
        pass

def side_effects(completions, pid_file):
    """Everything a reward must not do to the trainer; it then answers as it should."""
    threading.Thread(target=threading.Event().wait, name="left-behind").start()
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    open(pid_file[0], "w").write(f"{os.getpid()} {child}")
    os.chdir("/")
    return [1.0 for _ in completions]
'''


def process_exists(pid: int) -> bool:
    """Whether a process with this id is running (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def example(answer: str = "3", **columns) -> Example:
    return Example(image=None, prompt="How many?", answer=answer, meta={"idx": 0, "split": "train", "columns": columns})


def entries(*items) -> list:
    return load_config(None, [f"rewards={json.dumps(list(items))}"]).rewards


@pytest.fixture
def mine(tmp_path) -> str:
    """The file of misbehaving rewards; its import path prefix."""
    (tmp_path / "mine.py").write_text(MISBEHAVING)
    return f"{tmp_path}/mine.py"


# --------------------------------------------------------------------------- in the reward worker


@pytest.mark.parametrize("name, timeout_s, message", [
    ("exits", None, r"failed in the reward worker: SystemExit: 0 \| prompt: 'How many\?'"),
    ("ends", None, r"failed in the reward worker: the reward worker stopped while it was to finish the job "
                   r"\(exit code 0\) \| prompt"),
    ("hangs", 0.5, r"ran past its 0.5 s limit \(timeout_s\) and was stopped \(its reward worker was killed\) \| prompt"),
    ("spins", 0.5, r"ran past its 0.5 s limit \(timeout_s\) and was stopped"),
])
def test_a_reward_that_exits_or_never_returns_in_the_worker_is_one_line_naming_it(mine, name, timeout_s, message):
    reward = build_rewards(entries({"name": f"{mine}:{name}", "timeout_s": timeout_s}))[0]
    started = time.monotonic()
    with pytest.raises(RewardError, match=rf"^reward '{name}' \({mine}:{name}\) {message}") as raised:
        score_batch([reward], [example()], ["one"])
    assert "\n" not in str(raised.value) and time.monotonic() - started < 10
    assert score_batch(build_rewards(entries(f"{mine}:fine")), [example()], ["x"]) == {"fine": [1.0]}  # a new worker


def test_what_a_reward_does_to_its_worker_stays_there_and_ends_with_it(mine, tmp_path):
    """A thread left running, a forked child and another working folder: the trainer keeps its own,
    scores right, and exits at once with nothing left behind (grad mode and the like are the worker's
    interpreter's: they cannot reach the trainer's)."""
    script = ("import os\nfrom vlmrl.rewards.reward import resolve\nfrom vlmrl.rewards.score import score_batch\n"
              "from vlmrl.tasks import Example\n"
              f"example = Example(None, 'How many?', '3', {{'columns': {{'pid_file': {str(tmp_path / 'pids')!r}}}}})\n"
              f"scores = score_batch([resolve('{mine}:side_effects')], [example], ['x'])\n"
              "print(scores, os.getcwd())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(TESTS.parent / "src")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["{'side_effects':", "[1.0]}", str(tmp_path)]
    worker, child = map(int, (tmp_path / "pids").read_text().split())
    deadline = time.monotonic() + 10
    while (process_exists(worker) or process_exists(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_exists(worker) and not process_exists(child)


def test_the_trainer_never_imports_a_worker_reward_and_sends_only_what_it_takes(tmp_path):
    (tmp_path / "loud.py").write_text("import os\nos.chdir('/')\n"  # an import with a side effect
                                      "def loud(completions, images, scale=2.0):\n"
                                      "    return [scale * len(images[0]) for _ in completions]\n"
                                      "def texts(completions):\n    return [len(completions) for _ in completions]\n")
    rewards = build_rewards(entries({"name": f"{tmp_path}/loud.py:loud", "kwargs": {"scale": 3.0}},
                                    f"{tmp_path}/loud.py:texts"))
    loaded = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
    assert os.getcwd() != "/" and str(tmp_path / "loud.py") not in loaded  # never imported here
    assert rewards[0].takes == {"completions", "images", "scale"} and rewards[0].needs == ("completions", "images")
    assert score_batch(rewards, [example(), example()], ["a", "b"]) == {"loud": [0.0, 0.0], "texts": [2.0, 2.0]}
    with pytest.raises(VlmrlError, match=r"reward '.*loud.py:nothere': .*loud.py has no 'nothere'"):
        build_rewards(entries(f"{tmp_path}/loud.py:nothere"))


def test_a_reward_module_that_exits_or_hangs_at_import_is_one_line_and_the_trainer_goes_on(tmp_path, monkeypatch):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\ndef f(completions):\n    return []\n")
    with pytest.raises(VlmrlError, match=r"^reward '.*exits_at_import.py:f': cannot load it in the worker: "
                                         r"SystemExit: 3$"):
        build_rewards(entries(f"{tmp_path}/exits_at_import.py:f"))
    (tmp_path / "hangs_at_import.py").write_text("import threading\nthreading.Event().wait()\n")
    monkeypatch.setattr("vlmrl.worker.LOAD_S", 1.0)
    with pytest.raises(VlmrlError, match=r"reward '.*hangs_at_import.py:f': the reward worker did not load the job "
                                         r"within 1 s"):
        build_rewards(entries(f"{tmp_path}/hangs_at_import.py:f"))


def test_a_function_from_python_whose_module_the_worker_cannot_import_runs_here_contained(monkeypatch):
    made = types.ModuleType("made_at_run_time")
    exec("import sys\ndef quits(completions):\n    sys.exit(0)\n", made.__dict__)
    monkeypatch.setitem(sys.modules, "made_at_run_time", made)
    with pytest.raises(RewardError, match=r"^reward 'quits' \(made_at_run_time:quits\) failed: SystemExit: 0 \|"):
        score_batch(build_rewards(entries("made_at_run_time:quits")), [example()], ["x"])


def test_a_reward_that_fails_in_the_worker_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir, letter_task):
    from vlmrl.training.trainer import train
    from test_reward_functions import run_config

    (tmp_path / "second.py").write_text(
        "import os\nfrom pathlib import Path\n"
        "def second_call_exits(completions, counter):\n"
        "    calls = Path(counter[0])\n"
        "    calls.write_text(calls.read_text() + 'x' if calls.exists() else 'x')\n"
        "    if len(calls.read_text()) >= 2:\n        os._exit(0)\n"
        "    return [1.0 for _ in completions]\n")
    rewards = json.dumps(["format", {"name": f"{tmp_path}/second.py:second_call_exits",
                                     "kwargs": {"counter": [str(tmp_path / "calls")]}}])
    with pytest.raises(VlmrlError, match=r"a reward failed at step 2: reward 'second_call_exits' \(.*second.py:"
                                         r"second_call_exits\) failed in the reward worker: the reward worker stopped "
                                         r".*\(exit code 0\) .*stopped with a checkpoint of step 1"):
        train(run_config(tmp_path / "run", tiny_model_dir, "train.steps=3", f"rewards={rewards}"))
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()


# --------------------------------------------------------------------------- in the trainer's process


@pytest.fixture
def in_main(monkeypatch):
    """Put a function into `__main__` (as a notebook or script defines one) and give its reward."""
    def put(fn, timeout_s=None) -> Reward:
        monkeypatch.setattr(sys.modules["__main__"], fn.__name__, fn, raising=False)
        return resolve(f"__main__:{fn.__name__}", timeout_s=timeout_s)
    return put


def exits(completions):
    sys.exit(0)


def hangs(completions):
    threading.Event().wait()


def spins(completions):
    while True:
        pass


def swallows(completions):
    """A reward whose own `except Exception` would hide an interruption that is an Exception."""
    while True:
        try:
            time.sleep(10)
        except Exception:  # noqa: BLE001
            pass


RELEASE = threading.Event()


def leaves_a_thread(completions):
    threading.Thread(target=RELEASE.wait, name="left-behind").start()
    return [1.0 for _ in completions]


def changes_the_trainer(completions):
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(torch.get_num_threads() + 1)
    os.chdir("/")
    return [1.0 for _ in completions]


def forks(completions):
    if os.fork() == 0:  # the child returns into the trainer's code
        return [1.0 for _ in completions]
    return [0.5 for _ in completions]


@pytest.mark.parametrize("fn, timeout_s, message", [
    (exits, None, r"failed: SystemExit: 0 \| prompt"),
    (hangs, 0.5, r"ran past its 0.5 s limit \(timeout_s\) and was interrupted; it runs in the trainer's process \(a "
                 r"function of __main__\): define it in a module"),
    (spins, 0.5, r"ran past its 0.5 s limit"),
    (swallows, 0.5, r"ran past its 0.5 s limit"),
    (leaves_a_thread, None, r"left a thread running \(left-behind\), which keeps the process from exiting"),
])
def test_a_reward_of_main_that_exits_hangs_or_leaves_a_thread_is_one_line_naming_it(in_main, fn, timeout_s, message):
    reward = in_main(fn, timeout_s)
    RELEASE.clear()
    try:
        with pytest.raises(RewardError, match=rf"^reward '{fn.__name__}' \(__main__:{fn.__name__}\) {message}"):
            score_batch([reward], [example()], ["one"])
    finally:
        RELEASE.set()
    assert threading.current_thread() is threading.main_thread()  # where the time limit interrupts


def test_a_reward_of_main_gets_the_trainer_state_put_back_after_each_call(in_main):
    before = (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads(), os.getcwd())
    assert score_batch([in_main(changes_the_trainer)], [example()], ["x"]) == {"changes_the_trainer": [1.0]}
    assert (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads(), os.getcwd()) == before


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_child_a_reward_of_main_forks_does_not_return_into_the_trainer(in_main):
    pid = os.getpid()
    scores = score_batch([in_main(forks)], [example()], ["x"])
    assert os.getpid() == pid and scores == {"forks": [0.5]}
    child, status = os.wait()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_reward_of_main_that_hangs_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir, letter_task, in_main):
    from vlmrl.training.trainer import train
    from test_reward_functions import run_config

    calls = []

    def second_call_hangs(completions):
        calls.append(1)
        if len(calls) >= 2:
            threading.Event().wait()
        return [1.0 for _ in completions]

    in_main(second_call_hangs)
    rewards = json.dumps([{"name": "__main__:second_call_hangs", "timeout_s": 1}])
    with pytest.raises(VlmrlError, match=r"a reward failed at step 2: reward 'second_call_hangs' \(__main__:"
                                         r"second_call_hangs\) ran past its 1 s limit .*stopped with a checkpoint of "
                                         r"step 1"):
        train(run_config(tmp_path / "run", tiny_model_dir, "train.steps=3", f"rewards={rewards}"))
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()


# --------------------------------------------------------------------------- the time limit as a setting


def test_the_time_limit_is_a_setting_of_your_own_functions_only():
    assert contain.MAX_TIMEOUT_S == MAX_REWARD_TIMEOUT_S
    assert entries({"name": "x.py:f", "timeout_s": 5})[0].timeout_s == 5
    for bad in (0, -1, float("nan"), 1e9):
        with pytest.raises(VlmrlError, match=r"timeout_s must be"):
            entries({"name": "x.py:f", "timeout_s": bad})
    with pytest.raises(VlmrlError, match=r"reward 'format' takes no timeout_s: only a function of your own is timed"):
        build_rewards(entries({"name": "format", "timeout_s": 5}))
    with pytest.raises(VlmrlError, match=r"reward 'http://localhost:1/score' takes no timeout_s: .*a service has its "
                                         r"own kwargs: timeout_s"):
        build_rewards(entries({"name": "http://localhost:1/score", "timeout_s": 5}))


# --------------------------------------------------------------------------- what every reward is given and gives


def test_each_reward_scores_lists_of_its_own():
    """A reward that edits its keywords in place (here: writes the right answer into every completion)
    cannot change what the next one scores, nor the examples the run trains on."""
    def rewrites(completions, prompts, examples, images, answer):
        for completion in completions:
            completion[0]["content"] = "<answer>3</answer>"
        completions.append([{"role": "assistant", "content": "<answer>3</answer>"}])
        prompts[0][0]["content"], answer[0] = "changed", "4"
        examples[0].answer, examples[0].meta["idx"] = "4", 99
        images[0].append("not an image")
        return [0.0 for _ in answer]

    examples = [example(), example()]
    rewrite = Reward("rewrites", rewrites, 1.0, frozenset({"completions", "prompts", "examples", "images", "answer"}))
    scores = score_batch([rewrite, resolve("accuracy")], examples, ["<answer>2</answer>", "<answer>5</answer>"])
    assert scores == {"rewrites": [0.0, 0.0], "accuracy": [0.0, 0.0]}
    assert [(e.answer, e.meta["idx"], e.images) for e in examples] == [("3", 0, []), ("3", 0, [])]


@pytest.mark.parametrize("value", [np.bool_(True), np.float32(1.0), np.int64(1), np.array(1.0), torch.tensor(1.0),
                                   torch.tensor(True), True, 1])
def test_numpy_and_0_d_tensor_values_are_numbers_as_trl_takes_them(value):
    reward = Reward("mine", lambda completions: [value for _ in completions], 1.0, frozenset({"completions"}))
    assert score_batch([reward], [example()], ["x"]) == {"mine": [1.0]}


@pytest.mark.parametrize("value", [10 ** 400, 1e300, -1e16, np.float64(1e300), torch.tensor([1.0]), "1", 1j,
                                   {"total": 1e300}])
def test_a_value_past_what_float32_advantages_can_hold_is_a_reward_error_naming_it(value):
    reward = Reward("huge", lambda completions: [value for _ in completions], 1.0, frozenset({"completions"}), (), "h")
    with pytest.raises(RewardError, match=r"^reward 'huge' \(h\) must give one finite number \(within ±1e\+15\), None "
                                          r"or a dict of such numbers with 'total' per completion; got .* \| prompt"):
        score_batch([reward], [example()], ["x"])


def test_a_weighted_sum_past_the_bound_is_a_reward_error_naming_the_parts():
    big = Reward("big", lambda completions: [1e6 for _ in completions], 1e10, frozenset({"completions"}))
    with pytest.raises(RewardError, match=r"the weighted sum of the rewards of this completion is 1e\+16, past "
                                          r"±1e\+15 \(weight x value: big 1e\+16, format 0\): lower a weight"):
        score_batch([big, resolve("format")], [example()], ["x"])


def test_every_weight_zero_is_refused_unless_a_teacher_gives_the_signal(tmp_path, tiny_model_dir, letter_task):
    from vlmrl.safety.early_checks import check_before_loading
    from test_reward_functions import run_config

    rewards = build_rewards(entries({"name": "format", "weight": 0}, {"name": "accuracy", "weight": 0}))
    with pytest.raises(VlmrlError, match=r"^every reward has weight 0 \(format, accuracy\): the run would train on a "
                                         r"total of 0; give one a weight"):
        check_weights(rewards, teacher=False)
    check_weights(rewards, teacher=True)  # distillation: the teacher is the signal, the rewards are logged
    config = run_config(tmp_path / "run", tiny_model_dir, 'rewards=[{name: format, weight: 0}]')
    with pytest.raises(VlmrlError, match=r"every reward has weight 0 \(format\)"):
        check_before_loading(config, "train")
