"""A reward service: a reward function behind an `http(s)://` URL, with the same batched contract.

Each call POSTs one JSON object with the batch (`prompts`, `completions`, `answer` and the data's
columns, one item per completion; images and other values JSON cannot hold are sent as null) and
reads back `{"rewards": [...]}` (or a bare list): one number or null per completion. A call that
fails (connection refused, no whole answer within `timeout_s`, an HTTP error, an answer that is not
that JSON) is tried again after `backoff_s`, doubling (each wait at most MAX_BACKOFF_S), up to
`retries` more times; when the service stays down it raises ServiceDown, and the trainer saves a
checkpoint and stops: a failed call never scores 0.

What a call may not do (docs/rewards.md, "A reward service"):
- take longer than `timeout_s` in all: connecting, sending, and reading the whole answer (a service
  that trickles a byte a second is cut off at the deadline, its connection closed);
- answer from elsewhere: a redirect to another origin (scheme, host, port) is refused, and so is a
  same-origin 301/302/303 (it would turn the POST into a GET); a same-origin 307/308 (the POST
  kept) is followed, at most MAX_REDIRECTS times. A refusal is not retried;
- answer more than MAX_ANSWER_BYTES.

Credentials never travel in the host name nor show anywhere: a URL's `user:password@` is sent as
an HTTP Basic `Authorization` header and taken out of the request's URL; `headers` (a setting) are
sent with every call, each `${NAME}` in a value replaced by the environment variable NAME at the call
(so config.yaml holds `${NAME}`, never the secret). Every message shows the URL through
`vlmrl.urls.redact`. The settings are checked when the config is read (`check_settings`).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable, Mapping

from vlmrl.errors import VlmrlError
from vlmrl.fields import Naming, coerce, shown
from vlmrl.urls import is_redacted, is_secret_name, redact, redact_text, split_userinfo

SETTINGS = {"timeout_s": 30.0, "retries": 3, "backoff_s": 1.0, "headers": {}}
"""A service's settings (its `kwargs` in the config) and their defaults."""
MAX_TIMEOUT_S = 3600.0
"""Longest `timeout_s`: an hour for one call, while the whole step waits for it."""
MAX_RETRIES = 100
"""Most `retries`: a service down after a hundred tries is down."""
MAX_BACKOFF_S = 600.0
"""Longest `backoff_s`, and the longest any one wait between tries grows to by doubling."""
MAX_REDIRECTS = 5
"""Most same-origin 307/308 redirects one call follows."""
MAX_ANSWER_BYTES = 64 * 2 ** 20
"""Largest answer read (64 MiB, a million rewards many times over)."""
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""`${NAME}` in a header value: the environment variable NAME, read at each call."""
SENT = ("prompts", "completions", "answer")
"""The keywords sent besides the data's columns (images, token ids, examples and trajectories are not)."""
NOT_COLUMNS = ("images", "examples", "trajectories", "completion_ids")


class ServiceDown(VlmrlError):
    """The reward service gave no usable answer after every retry (or an answer it may not give)."""


class Refused(Exception):  # noqa: N818 - a refusal, not an error of the caller
    """An answer that another try would not change (a redirect elsewhere): not retried."""


def is_url(spec: str) -> bool:
    """Whether a reward name is a service URL."""
    return isinstance(spec, str) and spec.startswith(("http://", "https://"))


def check_settings(url: str, settings: Mapping[str, Any], what: str = "reward service") -> dict[str, Any]:
    """The service's settings with their defaults, each checked (a one-line VlmrlError naming `what`
    and the setting): timeout_s a number in (0, MAX_TIMEOUT_S], retries an integer in [0, MAX_RETRIES],
    backoff_s a number in [0, MAX_BACKOFF_S], headers a mapping of names to texts; and the URL itself:
    a host, no credential saved redacted (a run's config.yaml), not both a userinfo and an
    `Authorization` header."""
    where = f"{what} {redact(url)}"
    parts = urllib.parse.urlsplit(url)
    try:
        has_host = bool(parts.hostname)
        parts.port  # noqa: B018 - a port that is no number raises here
    except ValueError as error:
        raise VlmrlError(f"{where}: not a URL vlmrl can call ({error})") from None
    if not has_host:
        raise VlmrlError(f"{where}: the URL names no host")
    if is_redacted(url):
        raise VlmrlError(f"{where}: its credentials were saved as *** (a run's config.yaml never holds them); give "
                         "the config that holds them, or pass them through headers from the environment "
                         "(kwargs: {headers: {Authorization: 'Bearer ${TOKEN}'}}, docs/rewards.md)")
    if not isinstance(settings, Mapping):
        raise VlmrlError(f"{where}: kwargs must be a mapping of settings ({', '.join(SETTINGS)}); got {shown(settings)}")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise VlmrlError(f"{where}: unknown setting {', '.join(map(str, unknown))}; settings: {', '.join(SETTINGS)}")
    naming = Naming(label=f"{where}: kwargs.{{key}}")
    options = {**SETTINGS, **settings}
    timeout_s = coerce(float, options["timeout_s"], "timeout_s", naming)
    retries = coerce(int, options["retries"], "retries", naming)
    backoff_s = coerce(float, options["backoff_s"], "backoff_s", naming)
    headers = options["headers"] if options["headers"] is not None else {}
    if not isinstance(headers, Mapping):  # its value is not shown: it may be a secret
        raise VlmrlError(f"{where}: kwargs.headers must be a mapping of header names to texts; got "
                         f"{type(headers).__name__}")
    for name, value in headers.items():
        if not isinstance(name, str) or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
            raise VlmrlError(f"{where}: kwargs.headers: {shown(name)} is not an HTTP header name")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
            raise VlmrlError(f"{where}: kwargs.headers.{name} must be text on one line (its value is not shown)")
    rules = {"timeout_s": (0 < timeout_s <= MAX_TIMEOUT_S, f"in (0, {MAX_TIMEOUT_S:g}] seconds (the whole call)"),
             "retries": (0 <= retries <= MAX_RETRIES, f"an integer in [0, {MAX_RETRIES}]"),
             "backoff_s": (0 <= backoff_s <= MAX_BACKOFF_S, f"in [0, {MAX_BACKOFF_S:g}] seconds")}  # NaN fails
    checked = {"timeout_s": timeout_s, "retries": retries, "backoff_s": backoff_s}
    for key, (ok, rule) in rules.items():
        if not ok:
            raise VlmrlError(f"{where}: kwargs.{key} must be {rule}; got {checked[key]}")
    if "@" in parts.netloc and any(name.lower() == "authorization" for name in headers):
        raise VlmrlError(f"{where}: credentials given twice (the URL's user:password@ and an Authorization header); "
                         "keep one")
    return {"timeout_s": timeout_s, "retries": retries, "backoff_s": backoff_s, "headers": dict(headers)}


def saved_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings as config.yaml saves them: a header value that holds a secret itself (no
    `${NAME}`, under a credential's name such as Authorization or X-Api-Key) saved as ***."""
    headers = settings.get("headers")
    if not isinstance(headers, Mapping):
        return dict(settings)
    return {**settings, "headers": {name: "***" if isinstance(value, str) and is_secret_name(str(name))
                                    and not ENV_REFERENCE.search(value) else value
                                    for name, value in headers.items()}}


def expanded(headers: Mapping[str, str], where: str) -> dict[str, str]:
    """The headers with each `${NAME}` replaced by the environment variable NAME (a one-line
    VlmrlError naming the variable when it is not set, or a value saved as ***)."""
    def value_of(match: re.Match) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise VlmrlError(f"{where}: header value names ${{{name}}}, and the environment variable {name} is not set")
        return os.environ[name]

    expanded = {}
    for name, value in headers.items():
        if value == "***":
            raise VlmrlError(f"{where}: header {name} was saved as *** (a run's config.yaml never holds secrets); give "
                             "the config that holds it, or write it as ${ENVIRONMENT_VARIABLE}")
        expanded[name] = ENV_REFERENCE.sub(value_of, value)
        if any(c in expanded[name] for c in "\r\n\0"):
            raise VlmrlError(f"{where}: header {name} from the environment holds a line break")
    return expanded


def _json_value(value: Any) -> Any:
    """`value` if JSON can hold it as it is (a PIL image, bytes... become null)."""
    return value if isinstance(value, (str, int, float, bool, list, dict, type(None))) else None


def _origin(parts: urllib.parse.SplitResult) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL, the port filled in from the scheme."""
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def _exchange(url: str, body: bytes, headers: Mapping[str, str], deadline: float, timeout_s: float
              ) -> tuple[int, str, str | None, bytes]:
    """One POST to `url`: (status, reason, Location header, body), all of it before `deadline` (a
    time.monotonic()); TimeoutError, with the connection closed, when the deadline comes first."""
    parts = urllib.parse.urlsplit(url)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"timed out: no whole answer within {timeout_s:g} s (timeout_s bounds the whole call)")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=remaining)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            connection.request("POST", path, body=body, headers=dict(headers))
            response = connection.getresponse()
            data = response.read(MAX_ANSWER_BYTES + 1)
            outcome["answer"] = (response.status, response.reason, response.getheader("Location"), data)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=call, name="vlmrl-reward-service", daemon=True)
    worker.start()
    worker.join(remaining)
    try:
        if worker.is_alive():  # the deadline came first: close the socket under the worker, which then ends
            sock = connection.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            raise TimeoutError(f"timed out: no whole answer within {timeout_s:g} s (timeout_s bounds the whole call)")
    finally:
        connection.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["answer"]


def post_json(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> Any:
    """The JSON answer of one POST, redirects handled as the module's docstring says (a refusal is
    `Refused`; a failed call an OSError, ValueError or HTTPException, which another try may mend)."""
    deadline = time.monotonic() + timeout_s
    target = url
    for _ in range(MAX_REDIRECTS + 1):
        status, reason, location, data = _exchange(target, body, headers, deadline, timeout_s)
        if status in (301, 302, 303, 307, 308):
            moved = urllib.parse.urljoin(target, location or "")
            if not location or _origin(urllib.parse.urlsplit(moved)) != _origin(urllib.parse.urlsplit(url)):
                raise Refused(f"answered HTTP {status} redirecting to another origin ({redact(moved) or 'none given'}); "
                               "not followed: the rewards must come from the URL configured")
            if status not in (307, 308):
                raise Refused(f"answered HTTP {status} redirecting to {redact(moved)}, which would turn the POST "
                               "into a GET; not followed: configure that URL")
            target = moved
            continue
        if not 200 <= status < 300:
            raise OSError(f"HTTP Error {status}: {reason}")
        if len(data) > MAX_ANSWER_BYTES:
            raise ValueError(f"the answer is larger than {MAX_ANSWER_BYTES // 2 ** 20} MiB")
        return json.loads(data.decode("utf-8"))
    raise Refused(f"redirected more than {MAX_REDIRECTS} times")


def _post(url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> list:
    """The rewards of one call."""
    answer = post_json(url, body, headers, timeout_s)
    values = answer.get("rewards") if isinstance(answer, dict) else answer
    if not isinstance(values, list):
        raise ValueError(f"the answer holds no list of rewards: {str(answer)[:120]}")
    return values


def with_retries(where: str, call: Callable[[], Any], options: Mapping[str, Any],
                 stop: threading.Event | None = None) -> Any:
    """`call()`'s answer, tried again after a failed call as the module's docstring says (`options`:
    check_settings's); ServiceDown at once on a refusal, or once every try failed, or when `stop` is
    set while it waits to try again (another call of the batch failed: no use going on)."""
    retries, wait, last = options["retries"], options["backoff_s"], ""
    for attempt in range(retries + 1):
        try:
            return call()
        except Refused as refusal:
            raise ServiceDown(f"{where}: {refusal}") from None
        except (OSError, ValueError, http.client.HTTPException) as error:  # timeouts are OSErrors too
            last = redact_error(error)
        if attempt < retries and stop is not None and stop.wait(wait):
            raise ServiceDown(f"{where}: stopped after {attempt + 1} tries, another call failed; last: {last}")
        if attempt < retries and stop is None:
            time.sleep(wait)
        wait = min(2 * wait, MAX_BACKOFF_S)
    raise ServiceDown(f"{where} failed {retries + 1} times (timeout {options['timeout_s']:g} s); last: {last}")


def http_reward(url: str, settings: Mapping[str, Any]) -> Callable[..., list]:
    """The batched reward function of the service at `url`; `settings`: timeout_s, retries, backoff_s,
    headers (check_settings). Its name is the URL redacted."""
    options = check_settings(url, settings)
    where = f"reward service {redact(url)}"
    target, basic = split_userinfo(url)
    fixed = {"Content-Type": "application/json", "Accept": "application/json",
             **({"Authorization": basic} if basic else {})}
    expanded(options["headers"], where)  # a variable that is not set: refused now, before any model loads

    def service(**batch) -> list:
        payload = {k: [_json_value(v) for v in values] for k, values in batch.items()
                   if k in SENT or k not in NOT_COLUMNS}
        body = json.dumps(payload, default=lambda _: None).encode("utf-8")
        headers = {**fixed, **expanded(options["headers"], where)}  # read at each call: a rotated token is used
        return with_retries(where, lambda: _post(target, body, headers, options["timeout_s"]), options)

    service.__name__ = redact(url)
    return service


def redact_error(error: BaseException) -> str:
    """`Type: message` of a failed call, any URL in it redacted."""
    return redact_text(f"{type(error).__name__}: {error}")
