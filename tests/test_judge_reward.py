"""A judge model as a reward (rewards/judge.py), against a local OpenAI-compatible server that really
generates: tests/http_servers.py's JudgeServer, greedy decoding of a tiny random Llama.

The whole path: the template filled for each completion and sent as a chat request of the right
shape (the system turn, the images as data URLs, the model, max_tokens, temperature 0, the key as a
Bearer header), each reply read by the user's rule (a regex's group, a number clamped into a range, a
map of words), an unreadable reply scored as said and counted, the score paid with its weight and
label in a run; the requests of a batch in flight together and never more than `concurrency`; the
service's retries and deadline; the API key never in the run folder, an error or the output.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from http_servers import CHAT, JudgeServer, LocalServer, json_answer
from PIL import Image

from vlmrl.config import load_config, save_config
from vlmrl.errors import VlmrlError
from vlmrl.rewards.judge import parse_score
from vlmrl.rewards.reward import build_rewards, describe, resolve
from vlmrl.rewards.score import RewardError, score_batch
from vlmrl.tasks.base import Example

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "sk-test-9f3c1e7a5b"
"""The API key the judge server wants: never to be written or shown."""
TEMPLATE = "Question: {question}\nGold answer: {answer}\nAnswer to grade: {completion}\nGive a score from 0 to 9."
COMPLETIONS = ["3", "<answer>4</answer>", "I count 7 shapes", "five", "The answer is 12", "no idea",
               "2 circles and 1 square", "<think>x</think><answer>9</answer>"]


@pytest.fixture(scope="module")
def judge_server():
    server = JudgeServer(key=KEY)
    yield server
    server.close()


@pytest.fixture
def judge(judge_server, monkeypatch):
    """The module's server, its records and waits fresh; OPENAI_API_KEY set to its key."""
    judge_server.requests.clear()
    judge_server.seen.clear()
    judge_server.hold_s, judge_server.peak = 0.0, 0
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    return judge_server


def settings(server: LocalServer | None, **more) -> dict:
    """A judge's settings for `server` (None: a port nothing listens on)."""
    url = server.address("/v1") if server is not None else "http://127.0.0.1:9/v1"
    return {"url": url, "model": "tiny-judge", "template": TEMPLATE, "max_tokens": 4,
            "api_key_env": "OPENAI_API_KEY", "system": "You grade answers.", "score": {"regex": r"(\d)"}, **more}


def example(idx: int = 0, answer: str = "4") -> Example:
    image = Image.new("RGB", (24 + 8 * idx, 16), (200, 40 * idx % 256, 30))
    return Example(image=image, prompt=f"How many shapes? ({idx})", answer=answer,
                   meta={"idx": idx, "split": "train", "columns": {}})


def last_digit(reply: str) -> float | None:
    """The rule of `settings` (a regex's last match), read by hand."""
    found = [c for c in reply if c.isdigit()]
    return float(found[-1]) if found else None


# --------------------------------------------------------------------------- the whole path


def test_a_judge_fills_the_template_asks_the_model_and_pays_the_score_its_reply_holds(judge):
    reward = resolve("judge", weight=0.5, label="judged", kwargs=settings(judge, temperature=0.0))
    examples = [example(i // 2) for i in range(len(COMPLETIONS))]  # two completions a prompt: a group shares it
    components = score_batch([reward], examples, COMPLETIONS)
    assert len(judge.requests) == len(COMPLETIONS)  # one request a completion (all different)
    sent = {json.loads(r.body)["messages"][1]["content"]: r for r in judge.requests}
    replies = {text: reply for text, _, reply in judge.seen}
    expected = []
    for ex, completion in zip(examples, COMPLETIONS):
        text = (f"Question: {ex.prompt}\nGold answer: 4\nAnswer to grade: {completion}\n"
                "Give a score from 0 to 9.")  # the template, filled
        request = sent[text]
        assert request.path == CHAT and request.headers["Authorization"] == f"Bearer {KEY}"
        assert json.loads(request.body) == {"model": "tiny-judge", "max_tokens": 4, "temperature": 0.0, "messages": [
            {"role": "system", "content": "You grade answers."}, {"role": "user", "content": text}]}
        expected.append(last_digit(replies[text]))
    assert len(set(replies.values())) > 2  # the tiny model's replies depend on what it is asked
    read = [e for e in expected if e is not None]
    assert len(set(read)) > 1, replies  # and so do the scores
    assert components == {"judged": [0.0 if e is None else e for e in expected],
                          "judged/unparsable": [float(e is None) for e in expected]}
    assert describe([reward], "sum") == f"judged x0.5 (judge http://127.0.0.1:{judge.port}/v1); total = weighted sum"


def test_a_judge_that_takes_images_gets_each_examples_image_as_a_data_url(judge):
    reward = resolve("judge", kwargs=settings(judge, images=True, system=""))
    examples = [example(1), example(1), example(2)]
    score_batch([reward], examples, ["a", "b", "c"])
    for request in judge.requests:
        (part, text), = [json.loads(request.body)["messages"][0]["content"]]  # no system turn: the user's alone
        assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
        assert text["type"] == "text" and text["text"].startswith("Question: How many shapes?")
    assert sorted(image.size for _, images, _ in judge.seen for image in images) == [(32, 16), (32, 16), (40, 16)]


def replies_by_completion(server: JudgeServer) -> dict[str, str]:
    """The reply to each completion graded (read from the filled template the server got)."""
    return {text.split("Answer to grade: ", 1)[1].rsplit("\nGive a score", 1)[0]: reply for text, _, reply in server.seen}


def test_a_rule_of_words_and_an_unreadable_reply_scored_as_said_and_counted(judge):
    examples, completions = [example(i) for i in range(4)], COMPLETIONS[:4]
    score_batch([resolve("judge", kwargs=settings(judge))], examples, completions)
    digits = [last_digit(replies_by_completion(judge)[c]) for c in completions]
    first = next(d for d in digits if d is not None)
    words = {str(int(first)): 1.0}  # the first digit read pays 1; every other reply is unreadable
    reward = resolve("judge", kwargs=settings(judge, score={"regex": r"(\d)", "words": words}, unparsable=-1))
    with pytest.warns(UserWarning, match=r"the score rule read no score in \d of 4 replies \(scored -1, counted as "
                                         r"<label>/unparsable\); the first: "):
        components = score_batch([reward], examples, completions)
    paid = [1.0 if d == first else -1.0 for d in digits]
    assert components == {"judge": paid, "judge/unparsable": [float(p == -1.0) for p in paid]}
    assert -1.0 in paid  # the tiny model's replies differ: some are not in the map


@pytest.mark.parametrize("reply, rule, score", [
    ("Score: 7/10", {"regex": r"Score: (\d+)", "range": [0, 10]}, 7.0),
    ("I think 3. Final score: 12", {"range": [0, 10]}, 10.0),  # the last number, clamped
    ("Score: -4", {"regex": r"Score: (-?\d+)", "range": [0, 10]}, 0.0),
    ("Verdict: Yes.", {"regex": r"Verdict: (\w+\.?)", "words": {"yes": 1, "no": 0}}, 1.0),
    ("Verdict: maybe", {"regex": r"Verdict: (\w+)", "words": {"yes": 1, "no": 0}}, None),
    ("no number here", {}, None),
])
def test_the_score_rule_reads_the_last_match_and_clamps_or_maps_it(reply, rule, score):
    from vlmrl.rewards.judge import check_rule

    assert parse_score(reply, check_rule(rule, "judge")) == score


# --------------------------------------------------------------------------- concurrency, retries, deadline


def test_a_batchs_requests_go_out_together_never_more_than_concurrency_and_identical_ones_once(judge):
    judge.hold_s = 0.3
    completions = [f"answer {i}" for i in range(9)]
    start = time.monotonic()
    score_batch([resolve("judge", kwargs=settings(judge, concurrency=3))], [example()] * 9, completions)
    took = time.monotonic() - start
    assert judge.peak == 3 and len(judge.requests) == 9
    assert 0.85 < took < 9 * 0.3  # three waves of 0.3 s, not nine
    judge.requests.clear()
    score_batch([resolve("judge", kwargs=settings(judge, concurrency=16))], [example()] * 4, ["x", "x", "y", "x"])
    assert len(judge.requests) == 2  # the same request is asked once and its score paid to each


def test_a_judge_is_retried_then_stops_the_batch_when_it_stays_down(judge, monkeypatch):
    flaky = LocalServer(lambda request: (500, {}, b"") if len(flaky.requests) == 1 else judge.chat(request))
    try:
        components = score_batch([resolve("judge", kwargs=settings(flaky, retries=1, backoff_s=0.01))],
                                 [example()], ["3"])
        assert len(flaky.requests) == 2 and set(components) == {"judge", "judge/unparsable"}
    finally:
        flaky.close()
    slow = LocalServer(lambda request: (time.sleep(1.0), judge.chat(request))[1])
    start = time.monotonic()
    try:
        with pytest.raises(RewardError, match=r"ServiceDown: judge http://127.0.0.1:\d+/v1 failed 2 times \(timeout "
                                              r"0.3 s\); last: TimeoutError"):
            score_batch([resolve("judge", kwargs=settings(slow, retries=1, backoff_s=0.01, timeout_s=0.3))],
                        [example()], ["3"])
    finally:
        slow.close()
    assert time.monotonic() - start < 1.5


def test_when_one_request_stays_down_the_others_stop_trying(judge):
    def answer(request):  # "bad" fails at once, the others fail after 0.3 s: still retrying when "bad" gives up
        time.sleep(0 if "Answer to grade: bad" in request.json["messages"][1]["content"] else 0.3)
        return 500, {}, b""

    down = LocalServer(answer)
    try:
        with pytest.raises(RewardError, match=r"judge http://127.0.0.1:\d+/v1 failed 6 times"):
            score_batch([resolve("judge", kwargs=settings(down, retries=5, backoff_s=0.02, concurrency=4))],
                        [example()] * 4, ["bad", "b", "c", "d"])
        time.sleep(0.4)  # the requests in flight end
        sent = len(down.requests)
        time.sleep(1.0)
        assert len(down.requests) == sent < 6 + 3 * 6  # no try after the batch failed
    finally:
        down.close()


# --------------------------------------------------------------------------- the key


def test_the_key_is_sent_from_the_environment_and_never_shown_in_an_error(judge, monkeypatch):
    echo = LocalServer(lambda request: json_answer({"error": {"message": f"bad key {request.headers['Authorization']}"}}))
    try:
        reward = resolve("judge", kwargs=settings(echo, retries=0))
        with pytest.raises(RewardError) as failure:  # a 200 that is no chat completion, quoting the key
            score_batch([reward], [example()], ["3"])
    finally:
        echo.close()
    assert echo.requests[0].headers["Authorization"] == f"Bearer {KEY}"
    assert "not a chat completion" in str(failure.value) and "bad key Bearer ***" in str(failure.value)
    assert KEY not in str(failure.value) and KEY not in repr(failure.value.__cause__)
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(VlmrlError, match=r"^judge http://127.0.0.1:\d+/v1: kwargs.api_key_env names OPENAI_API_KEY, "
                                         r"and the environment variable OPENAI_API_KEY is not set$"):
        resolve("judge", kwargs=settings(judge))


def test_a_run_pays_the_judge_and_writes_its_key_nowhere(judge, tmp_path, tiny_model_dir, letter_task, capsys):
    from vlmrl.report.page import write_report
    from vlmrl.report.tracking import read_metrics
    from vlmrl.training.trainer import train

    rewards = json.dumps(["format", {"name": "judge", "label": "graded", "weight": 2,
                                     "kwargs": settings(judge, images=True, concurrency=2)}])
    run = train(load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
        f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=4", "rollout.generation_batch_size=4", "train.micro_batch_size=4", "algorithm.beta=0",
        "train.log_rollouts_every=1", "train.trackers=[]", "eval.every=0", "train.steps=1", f"rewards={rewards}"]))
    write_report(run)
    row, = read_metrics(run / "metrics.jsonl")
    rollouts = [json.loads(line) for line in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    replies = replies_by_completion(judge)
    assert len(judge.requests) == len(replies) == len({r["completion"] for r in rollouts})  # once per completion
    for rollout in rollouts:  # each completion paid what the reply to its own request holds
        paid = last_digit(replies[rollout["completion"]])
        assert rollout["rewards"]["graded"] == (0.0 if paid is None else paid)
        assert rollout["rewards"]["graded/unparsable"] == float(paid is None)
    assert row["reward/graded"] == pytest.approx(sum(r["rewards"]["graded"] for r in rollouts) / 4)
    assert all(r.headers["Authorization"] == f"Bearer {KEY}" for r in judge.requests)
    assert all(len(images) == 1 and images[0].size == (56, 56) for _, images, _ in judge.seen)  # the task's images
    saved = (run / "config.yaml").read_text()
    assert "api_key_env: OPENAI_API_KEY" in saved and "Give a score from 0 to 9." in saved
    out = capsys.readouterr()
    assert f"graded x2 (judge http://127.0.0.1:{judge.port}/v1)" in out.out  # the preflight's rewards line
    written = [out.out, out.err] + [p.read_bytes().decode(errors="replace") for p in Path(run).rglob("*") if p.is_file()]
    assert not [text[:80] for text in written if KEY in text]


# --------------------------------------------------------------------------- settings, when the config is read


@pytest.mark.parametrize("change, message", [
    ({"template": None}, r"kwargs.template is required"),
    ({"url": "ftp://127.0.0.1:9/v1"}, r"kwargs.url must be an http\(s\):// URL"),
    ({"tries": 2}, r"unknown setting tries; settings: url, model, template"),
    ({"template": "Grade {question}"}, r"kwargs.template has no \{completion\}"),
    ({"template": "{completion} vs {gold}"}, r"kwargs.template names \{gold\}; a template fills \{question\}, "
                                             r"\{answer\}, \{completion\}"),
    ({"score": {"regex": r"\d+"}}, r"kwargs.score.regex must be text with exactly one group"),
    ({"score": {"regex": "("}}, r"kwargs.score.regex does not compile"),
    ({"score": {"range": [0, 1], "words": {"yes": 1}}}, r"kwargs.score: give range .* or words .*, not both"),
    ({"score": {"range": [5, 1]}}, r"kwargs.score.range must be \[low, high\]"),
    ({"score": {"words": {"yes": "high"}}}, r"kwargs.score.words must map reply words to finite numbers"),
    ({"concurrency": 0}, r"kwargs.concurrency must be an integer in \[1, 256\]; got 0"),
    ({"unparsable": float("nan")}, r"kwargs.unparsable must be a finite number"),
    ({"timeout_s": 0}, r"kwargs.timeout_s must be in \(0, 3600\]"),
    ({"api_key_env": "MY KEY"}, r"kwargs.api_key_env must name an environment variable"),
    ({"headers": {"Authorization": "Bearer ${T}"}}, r"credentials given twice \(api_key_env and an Authorization"),
])
def test_judge_settings_are_refused_when_the_config_is_read(change, message):
    kwargs = {**settings(None), **change}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    rewards = json.dumps([{"name": "judge", "kwargs": kwargs}]).replace("NaN", ".nan")
    with pytest.raises(VlmrlError, match=r"^judge \w+://127.0.0.1:9/v1: " + message):
        load_config(None, [f"rewards={rewards}"])


def test_a_judges_url_is_saved_redacted_and_a_timeout_outside_kwargs_is_refused(tmp_path):
    url = "https://bob:pw123@judge.example/v1?api_key=k3y"
    rewards = json.dumps([{"name": "judge", "kwargs": {"url": url, "model": "m", "template": "{completion}",
                                                        "headers": {"X-Api-Key": "literal-secret"}}}])
    config = load_config(None, [f"rewards={rewards}"])
    save_config(config, tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert "pw123" not in saved and "k3y" not in saved and "literal-secret" not in saved
    assert "https://***@judge.example/v1?api_key=***" in saved
    assert "pw123" not in repr(config.rewards) and "literal-secret" not in repr(config.rewards)
    with pytest.raises(VlmrlError, match=r"^judge https://\*\*\*@judge.example/v1\?api_key=\*\*\*: its credentials "
                                         r"were saved as \*\*\*"):
        load_config(tmp_path / "config.yaml")
    with pytest.raises(VlmrlError, match=r"reward 'judge' takes no timeout_s"):
        build_rewards([type("E", (), {"name": "judge", "weight": 1.0, "kwargs": {}, "label": "", "timeout_s": 5})()])


def test_the_docs_example_of_a_judge_is_a_config_vlmrl_reads(monkeypatch):
    import yaml

    text = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    section = text.split("## A judge model as a reward", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    config = load_config(None, [f"rewards={json.dumps(yaml.safe_load(block)['rewards'])}"])
    judge_entry, = [r for r in config.rewards if r.name == "judge"]
    assert judge_entry.kwargs["api_key_env"] == "OPENAI_API_KEY" and "{completion}" in judge_entry.kwargs["template"]


def test_the_benchmark_scores_a_batch_in_waves_of_its_concurrency():
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from judge_reward import measure, sleeping_judge

    server = LocalServer(sleeping_judge(0.1))
    try:
        args = argparse.Namespace(completions=8, group=4, images=False, repeats=1)
        (one, one_peak), (eight, eight_peak) = measure(server, 1, args), measure(server, 8, args)
    finally:
        server.close()
    assert (one_peak, eight_peak) == (1, 8) and one >= 0.8 and eight < 0.5 * one
