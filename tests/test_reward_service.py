"""A reward service's secrets, deadline, redirects and settings (rewards/http.py, vlmrl/urls.py).

A local http.server stands for the service: it records what it was sent (the path, the headers,
the body), and can trickle its answer a byte at a time or redirect. The URL's credentials must
reach the service as an `Authorization` header and be shown nowhere; a call must end by its
deadline; a redirect elsewhere must not be followed; bad settings are refused when the config is read.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from http_servers import LocalServer, Request, json_answer

from vlmrl.config import load_config, save_config
from vlmrl.errors import VlmrlError
from vlmrl.rewards.reward import describe, resolve
from vlmrl.rewards.score import RewardError, score_batch
from vlmrl.tasks.base import Example
from vlmrl.urls import redact, redact_text

pytestmark = pytest.mark.usefixtures("one_thread")

SECRET, KEY = "s3cretpw", "k3yvalue"
"""The password and the query-string key of the services' URLs below: never to be shown or saved."""


def example(answer: str = "12") -> Example:
    return Example(image=None, prompt="How many?", answer=answer, meta={"idx": 0, "split": "train", "columns": {}})


class Service(LocalServer):
    """A reward service on the loopback answering `{"rewards": [value ...]}`; records each request
    (method, path, headers); `status`/`location` make it answer a redirect instead; `down` a 500."""

    def __init__(self, value: float = 1.0, status: int = 200, location: str = ""):
        self.value, self.status, self.location, self.down = value, status, location, False
        super().__init__(self.answer)
        self.url = self.address("/score")

    def answer(self, request: Request):
        if self.down:
            return 500, {}, b""
        if self.status != 200 and request.path == "/score":
            return self.status, {"Location": self.location}, b""
        return json_answer({"rewards": [self.value] * len(request.json.get("answer", [None]))})


@pytest.fixture
def service():
    made = []

    def start(**options) -> Service:
        made.append(Service(**options))
        return made[-1]

    yield start
    for s in made:
        s.close()


# --------------------------------------------------------------------------- redaction


def test_a_url_is_shown_without_its_userinfo_and_its_keys():
    assert redact(f"https://bob:{SECRET}@host.example:8443/score?api_key={KEY}&page=2&sig={KEY}") == \
        "https://***@host.example:8443/score?api_key=***&page=2&sig=***"
    assert redact("http://localhost:8000/score?design=a") == "http://localhost:8000/score?design=a"  # unchanged
    assert redact_text(f"failed: <urlopen http://u:{SECRET}@h/x?token={KEY}> then") == \
        "failed: <urlopen http://***@h/x?token=***> then"


# --------------------------------------------------------------------------- credentials


def test_userinfo_is_sent_as_basic_auth_and_the_reward_is_named_by_its_host(service):
    server = service(value=2.0)
    url = f"http://bob:{SECRET}@127.0.0.1:{server.port}/score?api_key={KEY}"
    reward = resolve(url)
    assert reward.name == f"127.0.0.1:{server.port}"  # the logged label: no userinfo
    assert reward.spec == f"http://***@127.0.0.1:{server.port}/score?api_key=***"
    assert score_batch([reward], [example()], ["a"]) == {f"127.0.0.1:{server.port}": [2.0]}
    method, path, headers = server.requests[0].method, server.requests[0].path, server.requests[0].headers
    assert method == "POST" and path == f"/score?api_key={KEY}"  # the key goes to the service, as configured
    assert headers["Authorization"] == "Basic " + base64.b64encode(f"bob:{SECRET}".encode()).decode()
    assert SECRET not in describe([reward], "sum") and KEY not in describe([reward], "sum")


def test_headers_take_secrets_from_the_environment_at_each_call(service, monkeypatch):
    server = service()
    monkeypatch.setenv("VLMRL_TEST_TOKEN", "first")
    reward = resolve(server.url, kwargs={"headers": {"Authorization": "Bearer ${VLMRL_TEST_TOKEN}", "X-Run": "a"}})
    score_batch([reward], [example()], ["a"])
    monkeypatch.setenv("VLMRL_TEST_TOKEN", "rotated")
    score_batch([reward], [example()], ["a"])
    assert [(h["Authorization"], h["X-Run"]) for h in (r.headers for r in server.requests)] == [("Bearer first", "a"),
                                                                                ("Bearer rotated", "a")]
    monkeypatch.delenv("VLMRL_TEST_TOKEN")
    with pytest.raises(VlmrlError, match=r"names \$\{VLMRL_TEST_TOKEN\}, and the environment variable VLMRL_TEST_TOKEN "
                                         r"is not set"):
        resolve(server.url, kwargs={"headers": {"Authorization": "Bearer ${VLMRL_TEST_TOKEN}"}})


def test_a_service_that_fails_names_its_url_redacted(service):
    server = service()
    server.down = True
    reward = resolve(f"http://bob:{SECRET}@127.0.0.1:{server.port}/score?token={KEY}",
                     kwargs={"retries": 0})
    with pytest.raises(RewardError) as failure:
        score_batch([reward], [example()], ["a"])
    message = str(failure.value)
    assert "ServiceDown" in message and "http://***@127.0.0.1" in message and "token=***" in message
    assert SECRET not in message and KEY not in message and "\n" not in message


def test_the_saved_config_holds_no_secret_and_a_resume_with_it_says_what_is_missing(tmp_path, monkeypatch):
    url = f"https://bob:{SECRET}@rewards.example/score?api_key={KEY}"
    rewards = json.dumps([{"name": url, "kwargs": {"headers": {"X-Api-Key": "literal-secret", "X-Token": "${TOKEN}"}}},
                          {"name": "https://other.example/score", "kwargs": {"headers": {"Authorization": "${T}"}}}])
    config = load_config(None, [f"rewards={rewards}"])
    save_config(config, tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert SECRET not in saved and KEY not in saved and "literal-secret" not in saved
    assert "https://***@rewards.example/score?api_key=***" in saved and "${TOKEN}" in saved
    assert SECRET not in repr(config.rewards) and "literal-secret" not in repr(config.rewards)  # a notebook's display
    with pytest.raises(VlmrlError, match=r"reward service https://\*\*\*@rewards.example/score\?api_key=\*\*\*: its "
                                         r"credentials were saved as \*\*\* .*give the config that holds them"):
        load_config(tmp_path / "config.yaml")


def test_a_run_shows_and_saves_no_secret_and_resumes_with_the_config_that_holds_it(
        service, tmp_path, tiny_model_dir, letter_task, capsys):
    from vlmrl.report.page import write_report
    from vlmrl.training.trainer import train

    server = service(value=1.0)
    url = f"http://bob:{SECRET}@127.0.0.1:{server.port}/score?api_key={KEY}"
    overrides = [f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:SolutionTask",
                 f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=2", "rollout.group_size=2",
                 "rollout.max_new_tokens=4", "rollout.generation_batch_size=2", "train.micro_batch_size=4",
                 "algorithm.beta=0", "train.log_rollouts_every=1", "train.trackers=[]", "eval.every=0",
                 f"rewards={json.dumps(['format', {'name': url, 'kwargs': {'retries': 0}}])}"]
    run = train(load_config(None, [*overrides, "train.steps=1"]))
    server.down = True
    with pytest.raises(VlmrlError) as stop:  # resumed with the config that holds the secret: it gets past the checks
        train(load_config(None, [*overrides, "train.steps=2", "resume=true"]))
    assert "ServiceDown" in str(stop.value) and SECRET not in str(stop.value)
    write_report(run)
    out = capsys.readouterr()
    shown = [out.out, out.err, str(stop.value)] + [p.read_text(errors="replace") for p in Path(run).rglob("*")
                                                   if p.is_file() and p.suffix in (".yaml", ".jsonl", ".json", ".html")]
    assert f"127.0.0.1:{server.port}/score" in out.out  # the preflight's rewards line, redacted
    assert not [text[:80] for text in shown if SECRET in text or KEY in text]
    assert all(r.headers["Authorization"].startswith("Basic ") for r in server.requests)


# --------------------------------------------------------------------------- deadline and redirects


def trickler(answer: bytes, every_s: float) -> tuple[socket.socket, threading.Event]:
    """A server that answers each connection with `answer`, one byte every `every_s` seconds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                connection.recv(65536)
                for byte in answer:
                    if stop.is_set():
                        break
                    try:
                        connection.sendall(bytes([byte]))
                    except OSError:
                        break
                    time.sleep(every_s)

    threading.Thread(target=serve, daemon=True).start()
    return listener, stop


def test_a_service_that_trickles_its_answer_is_cut_off_at_the_deadline():
    body = b'{"rewards": [1.0]}'
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body  # ~60 bytes: ~6 s at 10 per s
    listener, stop = trickler(answer, every_s=0.1)
    try:
        reward = resolve(f"http://127.0.0.1:{listener.getsockname()[1]}/score", kwargs={"retries": 0, "timeout_s": 1})
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"ServiceDown: .* failed 1 times \(timeout 1 s\); last: TimeoutError: "
                                              r"timed out: no whole answer within 1 s"):
            score_batch([reward], [example()], ["a"])
        assert time.monotonic() - start < 2.5  # every read got a byte in time: only a total deadline ends it
    finally:
        stop.set()
        listener.close()


def test_a_redirect_to_another_origin_is_not_followed(service):
    elsewhere = service(value=42.0)
    for status in (302, 307):
        server = service(status=status, location=elsewhere.url)
        reward = resolve(server.url, kwargs={"retries": 3, "backoff_s": 0})
        with pytest.raises(RewardError, match=rf"answered HTTP {status} redirecting to another origin "
                                              rf"\(http://127.0.0.1:{elsewhere.port}/score\); not followed"):
            score_batch([reward], [example()], ["a"])
        assert len(server.requests) == 1  # not retried: the same answer would come back
    assert elsewhere.requests == []


def test_a_same_origin_redirect_keeps_the_post_or_is_refused(service):
    moved = service(value=5.0, status=308, location="/v2")
    assert score_batch([resolve(moved.url)], [example()], ["a"]) == {f"127.0.0.1:{moved.port}": [5.0]}
    assert [(r.method, r.path) for r in moved.requests] == [("POST", "/score"), ("POST", "/v2")]
    found = service(status=302, location="/v2")
    with pytest.raises(RewardError, match=r"answered HTTP 302 redirecting to http://127.0.0.1:\d+/v2, which would turn "
                                          r"the POST into a GET; not followed"):
        score_batch([resolve(found.url, kwargs={"retries": 0})], [example()], ["a"])


# --------------------------------------------------------------------------- settings, when the config is read


@pytest.mark.parametrize("settings, message", [
    ({"timeout_s": "abc"}, r"kwargs.timeout_s must be a number; got 'abc'"),
    ({"timeout_s": 1e30}, r"kwargs.timeout_s must be in \(0, 3600\] seconds \(the whole call\); got 1e\+30"),
    ({"timeout_s": 0}, r"kwargs.timeout_s must be in \(0, 3600\]"),
    ({"retries": 2.7}, r"kwargs.retries must be an integer; got 2.7"),
    ({"retries": 1000}, r"kwargs.retries must be an integer in \[0, 100\]; got 1000"),
    ({"retries": True}, r"kwargs.retries must be an integer; got true"),
    ({"backoff_s": float("nan")}, r"kwargs.backoff_s must be in \[0, 600\] seconds; got nan"),
    ({"backoff_s": 1e9}, r"kwargs.backoff_s must be in \[0, 600\] seconds"),
    ({"headers": "Bearer xyz"}, r"kwargs.headers must be a mapping of header names to texts; got str"),
    ({"tries": 2}, r"unknown setting tries; settings: timeout_s, retries, backoff_s, headers"),
])
def test_service_settings_are_refused_when_the_config_is_read(settings, message):
    rewards = json.dumps([{"name": "http://127.0.0.1:9/score", "kwargs": settings}]).replace("NaN", ".nan")
    with pytest.raises(VlmrlError, match=r"^reward service http://127.0.0.1:9/score: " + message) as refusal:
        load_config(None, [f"rewards={rewards}"])
    assert "xyz" not in str(refusal.value)
