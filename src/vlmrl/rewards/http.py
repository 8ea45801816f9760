"""A reward service: a reward function behind an `http(s)://` URL, with the same batched contract.

Each call POSTs one JSON object with the batch (`prompts`, `completions`, `answer` and the data's
columns, one item per completion; images and other values JSON cannot hold are sent as null) and
reads back `{"rewards": [...]}` (or a bare list): one number or null per completion. A call that
fails (connection refused, a timeout after `timeout_s`, an HTTP error, an answer that is not that
JSON) is tried again after `backoff_s`, doubling, up to `retries` more times; when the service stays
down it raises ServiceDown, and the trainer saves a checkpoint and stops: a failed call never scores 0.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Mapping

from vlmrl.errors import VlmrlError

SETTINGS = {"timeout_s": 30.0, "retries": 3, "backoff_s": 1.0}
"""A service's settings (its `kwargs` in the config) and their defaults."""
SENT = ("prompts", "completions", "answer")
"""The keywords sent besides the data's columns (images, token ids, examples and trajectories are not)."""
NOT_COLUMNS = ("images", "examples", "trajectories", "completion_ids")


class ServiceDown(VlmrlError):
    """The reward service gave no usable answer after every retry."""


def is_url(spec: str) -> bool:
    """Whether a reward name is a service URL."""
    return isinstance(spec, str) and spec.startswith(("http://", "https://"))


def _json_value(value: Any) -> Any:
    """`value` if JSON can hold it as it is (a PIL image, bytes... become null)."""
    return value if isinstance(value, (str, int, float, bool, list, dict, type(None))) else None


def _post(url: str, body: bytes, timeout_s: float) -> list:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - the user's own URL
        answer = json.loads(response.read().decode("utf-8"))
    values = answer.get("rewards") if isinstance(answer, dict) else answer
    if not isinstance(values, list):
        raise ValueError(f"the answer holds no list of rewards: {str(answer)[:120]}")
    return values


def http_reward(url: str, settings: Mapping[str, Any]) -> Callable[..., list]:
    """The batched reward function of the service at `url`; `settings`: timeout_s, retries, backoff_s."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise VlmrlError(f"reward service {url}: unknown setting {', '.join(unknown)}; settings: {', '.join(SETTINGS)}")
    options = {**SETTINGS, **settings}
    timeout_s, retries, backoff_s = float(options["timeout_s"]), int(options["retries"]), float(options["backoff_s"])
    if not (timeout_s > 0 and retries >= 0 and backoff_s >= 0):
        raise VlmrlError(f"reward service {url}: timeout_s must be > 0, retries and backoff_s >= 0; got {options}")

    def service(**batch) -> list:
        payload = {k: [_json_value(v) for v in values] for k, values in batch.items()
                   if k in SENT or k not in NOT_COLUMNS}
        body = json.dumps(payload, default=lambda _: None).encode("utf-8")
        wait, last = backoff_s, ""
        for attempt in range(retries + 1):
            try:
                return _post(url, body, timeout_s)
            except (OSError, ValueError, urllib.error.URLError) as error:  # timeouts are OSErrors too
                last = f"{type(error).__name__}: {error}"
            if attempt < retries:
                time.sleep(wait)
                wait *= 2
        raise ServiceDown(f"reward service {url} failed {retries + 1} times (timeout {timeout_s:g} s); last: {last}")

    service.__name__ = url
    return service
