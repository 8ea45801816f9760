"""A judge model as a reward: an OpenAI-compatible chat endpoint grades each completion.

The reward named `judge` (docs/rewards.md, "A judge model as a reward") fills the user's prompt
`template` for each completion (`{question}`, `{answer}`: the gold one, `{completion}`), sends it as
one chat request to `url` (`/v1/chat/completions` of `vllm serve` or of any provider; with `images:
true` the example's images go first in the user turn, each an `image_url` holding a PNG data URL),
and reads a score from the reply's text by the `score` rule: the last match of `regex` (its one
group), looked up in `words` (a reply word -> a score) or read as a number and clamped into `range`.
A reply the rule cannot read scores `unparsable` and is counted: each completion's value is
`{"total": score, "unparsable": 0 or 1}`, logged as `reward/judge` and `reward/judge/unparsable`.

A batch's requests go out together, at most `concurrency` at a time over all the judge's calls
under way (identical requests once),
each with the reward service's deadline, retries, refusals and URL redaction (http.py): a judge
that stays down stops the run with a checkpoint, never scores 0. The API key is read from the
environment variable `api_key_env` at each call and sent as `Authorization: Bearer ...`; only the
variable's name is in the config, and the key's value is taken out of every message this module
raises or prints.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import math
import os
import re
import threading
import warnings
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, Mapping

from vlmrl.errors import VlmrlError
from vlmrl.fields import Naming, coerce, shown
from vlmrl.rewards.builtin import completion_text
from vlmrl.rewards.http import SETTINGS as SERVICE_SETTINGS
from vlmrl.rewards.http import Refused, check_settings, expanded, is_url, post_json, saved_settings, with_retries
from vlmrl.urls import REDACTED, redact, split_userinfo

JUDGE = "judge"
"""The reward name of a judge."""
SETTINGS = {"url": "", "model": "", "template": "", "system": "", "score": {}, "unparsable": 0.0, "images": False,
            "max_tokens": 256, "temperature": 0.0, "concurrency": 16, "api_key_env": "", **SERVICE_SETTINGS}
"""A judge's settings (its `kwargs`) and their defaults; url, model and template have none."""
REQUIRED = ("url", "model", "template")
PLACEHOLDERS = ("question", "answer", "completion")
"""What a template may name in braces: the prompt's text, the gold answer, the completion's text."""
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
NUMBER = r"([-+]?\d+(?:\.\d+)?)"
"""The default `score.regex`: the reply's last number."""
RULE_KEYS = ("regex", "range", "words")
MAX_CONCURRENCY = 256
MAX_TOKENS = 1 << 20
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CHAT_PATH = "/chat/completions"


def is_judge(spec: Any) -> bool:
    """Whether a reward name is the judge's."""
    return spec == JUDGE


def endpoint(url: str) -> str:
    """The chat endpoint of `url`: itself when its path ends in /chat/completions, else that appended
    (a base URL such as http://localhost:8000/v1, as the OpenAI clients take it)."""
    head, sep, query = url.partition("?")
    return url if head.rstrip("/").endswith(CHAT_PATH) else head.rstrip("/") + CHAT_PATH + sep + query


def _where(settings: Mapping[str, Any]) -> str:
    url = settings.get("url") if isinstance(settings, Mapping) else None
    return f"judge {redact(url)}" if isinstance(url, str) and url else JUDGE


def check_judge(settings: Any) -> dict[str, Any]:
    """The judge's settings with their defaults, each checked (a one-line VlmrlError naming the setting,
    never showing a header's value): the service settings as http.check_settings checks them, and
    url, model, template, system, score, unparsable, images, max_tokens, temperature, concurrency and
    api_key_env."""
    where = _where(settings)
    if not isinstance(settings, Mapping):
        raise VlmrlError(f"{where}: kwargs must be a mapping of settings ({', '.join(SETTINGS)}); got {shown(settings)}")
    unknown = sorted(map(str, set(settings) - set(SETTINGS)))
    missing = [key for key in REQUIRED if not settings.get(key)]
    if unknown or missing:
        said = f"unknown setting {', '.join(unknown)}" if unknown else f"kwargs.{missing[0]} is required"
        raise VlmrlError(f"{where}: {said}; settings: {', '.join(SETTINGS)} (url, model and template required)")
    options = {**SETTINGS, **settings}
    naming = Naming(label=f"{where}: kwargs.{{key}}")
    url = coerce(str, options["url"], "url", naming)
    if not is_url(url):
        raise VlmrlError(f"{where}: kwargs.url must be an http(s):// URL (http://localhost:8000/v1)")
    service = check_settings(url, {key: options[key] for key in SERVICE_SETTINGS}, "judge")
    checked = {"url": url, **service,
               **{key: coerce(str, options[key], key, naming) for key in ("model", "template", "system", "api_key_env")},
               **{key: coerce(kind, options[key], key, naming) for key, kind in
                  (("unparsable", float), ("images", bool), ("max_tokens", int), ("temperature", float),
                   ("concurrency", int))}}
    _check_numbers(checked, where)
    _check_template(checked["template"], where)
    checked["score"] = check_rule(options["score"], where)
    if checked["api_key_env"] and not ENV_NAME.fullmatch(checked["api_key_env"]):
        raise VlmrlError(f"{where}: kwargs.api_key_env must name an environment variable (OPENAI_API_KEY); "
                         f"got {shown(checked['api_key_env'])}")
    if checked["api_key_env"] and any(name.lower() == "authorization" for name in checked["headers"]):
        raise VlmrlError(f"{where}: credentials given twice (api_key_env and an Authorization header); keep one")
    return checked


def _check_numbers(checked: Mapping[str, Any], where: str) -> None:
    rules = {"unparsable": (abs(checked["unparsable"]) <= 1e15, "a finite number within ±1e15"),  # NaN fails
             "max_tokens": (1 <= checked["max_tokens"] <= MAX_TOKENS, f"an integer in [1, {MAX_TOKENS}]"),
             "temperature": (0 <= checked["temperature"] <= 2, "in [0, 2] (OpenAI's range)"),
             "concurrency": (1 <= checked["concurrency"] <= MAX_CONCURRENCY, f"an integer in [1, {MAX_CONCURRENCY}]")}
    for key, (ok, rule) in rules.items():
        if not ok:
            raise VlmrlError(f"{where}: kwargs.{key} must be {rule}; got {checked[key]}")


def _check_template(template: str, where: str) -> None:
    named = PLACEHOLDER.findall(template)
    unknown = sorted(set(named) - set(PLACEHOLDERS))
    if unknown:
        raise VlmrlError(f"{where}: kwargs.template names {{{unknown[0]}}}; a template fills "
                         f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    if "completion" not in named:
        raise VlmrlError(f"{where}: kwargs.template has no {{completion}}: the judge would not see what it grades")


def check_rule(rule: Any, where: str) -> dict[str, Any]:
    """The score rule checked: {regex: a pattern with one group (default: the last number),
    range: [low, high] or None, words: {word: score} or None}; `range` and `words` not both."""
    if rule is None:
        rule = {}
    if not isinstance(rule, Mapping) or set(rule) - set(RULE_KEYS):
        raise VlmrlError(f"{where}: kwargs.score must be a mapping of {', '.join(RULE_KEYS)}; got {shown(rule)}")
    pattern = rule.get("regex") or NUMBER
    try:
        groups = re.compile(pattern).groups if isinstance(pattern, str) else -1
    except re.error as error:
        raise VlmrlError(f"{where}: kwargs.score.regex does not compile ({error})") from None
    if groups != 1:
        raise VlmrlError(f"{where}: kwargs.score.regex must be text with exactly one group (the score); "
                         f"got {shown(pattern)}")
    bounds, words = rule.get("range"), rule.get("words")
    if bounds is not None and words is not None:
        raise VlmrlError(f"{where}: kwargs.score: give range (a number clamped) or words (a word -> a score), not both")
    if bounds is not None and not (isinstance(bounds, (list, tuple)) and len(bounds) == 2
                                   and all(_finite(b) for b in bounds) and bounds[0] < bounds[1]):
        raise VlmrlError(f"{where}: kwargs.score.range must be [low, high], two finite numbers, low < high; "
                         f"got {shown(bounds)}")
    if words is not None and not (isinstance(words, Mapping) and words and all(
            isinstance(k, str) and _finite(v) for k, v in words.items())):
        raise VlmrlError(f"{where}: kwargs.score.words must map reply words to finite numbers; got {shown(words)}")
    return {"regex": pattern, "range": [float(b) for b in bounds] if bounds is not None else None,
            "words": {_word(k): float(v) for k, v in words.items()} if words is not None else None}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= 1e15


def _word(text: str) -> str:
    """A reply word as `words` compares it: spaces and end punctuation off, lower case."""
    return text.strip().rstrip(".!").strip().lower()


def parse_score(reply: str, rule: Mapping[str, Any]) -> float | None:
    """The score the rule reads in `reply` (the last match of its regex), None when it reads none."""
    found = re.findall(rule["regex"], reply)
    if not found:
        return None
    text = found[-1]
    if rule["words"] is not None:
        return rule["words"].get(_word(text))
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    low, high = rule["range"] if rule["range"] is not None else (-1e15, 1e15)
    return min(max(number, low), high)


def saved_judge(settings: Any) -> Any:
    """The settings as config.yaml saves them: the URL redacted, a header that holds a secret itself as ***
    (api_key_env holds only a variable's name)."""
    if not isinstance(settings, Mapping):
        return settings
    saved = saved_settings(settings)
    return {**saved, "url": redact(saved["url"])} if isinstance(saved.get("url"), str) else saved


def fill(template: str, values: Mapping[str, str]) -> str:
    """`template` with each `{placeholder}` replaced by its value (other braces kept as written)."""
    return PLACEHOLDER.sub(lambda match: values.get(match.group(1), match.group(0)), template)


def data_url(image) -> str:
    """A PIL image as an `image_url` data URL (PNG, base64; a mode PNG cannot hold, CMYK, as RGB)."""
    if image.mode not in ("1", "L", "LA", "P", "RGB", "RGBA"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _question(prompt: Any) -> str:
    """The text of a prompt given as a conversation (its last user turn) or as text."""
    if isinstance(prompt, str):
        return prompt
    users = [turn for turn in prompt or [] if isinstance(turn, Mapping) and turn.get("role") == "user"]
    return completion_text(users) if users else ""


def _content(answer: Any) -> str:
    """The reply's text in a chat completion (ValueError when the answer is not one)."""
    try:
        message = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"the answer is not a chat completion (no choices[0].message): {str(answer)[:120]}") from None
    return completion_text([message]) if isinstance(message, Mapping) and message.get("content") else ""


class Judge:
    """The batched reward function of one judge (check_judge's settings): fn(prompts, completions,
    answer, images) -> one {"total", "unparsable"} per completion."""

    def __init__(self, settings: Mapping[str, Any]):
        self.options = check_judge(settings)
        self.where = _where(self.options)
        self.target, basic = split_userinfo(endpoint(self.options["url"]))
        self.fixed = {"Content-Type": "application/json", "Accept": "application/json",
                      **({"Authorization": basic} if basic else {})}
        self.headers()  # a variable that is not set: refused now, before any model loads
        self.warned = False
        self.slots = threading.BoundedSemaphore(self.options["concurrency"])  # over all its calls at once
        self.__name__ = JUDGE

    def key(self) -> str:
        """The API key from the environment ("" without api_key_env); read at each call."""
        name = self.options["api_key_env"]
        if name and not os.environ.get(name):
            raise VlmrlError(f"{self.where}: kwargs.api_key_env names {name}, and the environment variable {name} "
                             "is not set")
        return os.environ[name] if name else ""

    def headers(self) -> dict[str, str]:
        key = self.key()
        return {**self.fixed, **expanded(self.options["headers"], self.where),
                **({"Authorization": f"Bearer {key}"} if key else {})}

    def request(self, question: str, gold: str, completion: str, images: list) -> bytes:
        """The JSON body of one chat request."""
        text = fill(self.options["template"], {"question": question, "answer": gold, "completion": completion})
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        user = [*parts, {"type": "text", "text": text}] if parts else text
        system = [{"role": "system", "content": self.options["system"]}] if self.options["system"] else []
        return json.dumps({"model": self.options["model"], "messages": [*system, {"role": "user", "content": user}],
                           "max_tokens": self.options["max_tokens"], "temperature": self.options["temperature"]},
                          ensure_ascii=False).encode("utf-8")

    def __call__(self, prompts: list, completions: list, answer: list, images: list | None = None) -> list[dict]:
        shown_images = images if self.options["images"] and images is not None else [[] for _ in completions]
        encoded: dict[int, str] = {}  # a group's completions share their images: each encoded once
        for image in (image for group in shown_images for image in group or []):
            if id(image) not in encoded:
                encoded[id(image)] = data_url(image)
        bodies = [self.request(_question(p), "" if a is None else str(a), completion_text(c),
                               [encoded[id(image)] for image in group or []])
                  for p, c, a, group in zip(prompts, completions, answer, shown_images)]
        try:
            replies = self.ask(list(dict.fromkeys(bodies)), self.headers())  # identical requests once
        except VlmrlError as error:  # ServiceDown, or the key's variable unset: the key's value never shown
            raise type(error)(self.hidden(str(error))) from None
        scores = [parse_score(replies[body], self.options["score"]) for body in bodies]
        self.warn([replies[b] for b, s in zip(bodies, scores) if s is None], len(bodies))
        return [{"total": self.options["unparsable"] if s is None else s, "unparsable": float(s is None)}
                for s in scores]

    def ask(self, bodies: list[bytes], headers: dict[str, str]) -> dict[bytes, str]:
        """Each body's reply, at most `concurrency` requests at a time; ServiceDown as soon as one request
        failed every try: the requests not sent are cancelled, and those in flight end by their deadline
        without another try."""
        stop = threading.Event()

        def attempt(body: bytes) -> str:
            with self.slots:  # calls of several generate calls at once share the bound (background scoring)
                if stop.is_set():
                    raise Refused("not sent: another request of the batch failed")
                return _content(post_json(self.target, body, headers, self.options["timeout_s"]))

        pool = ThreadPoolExecutor(max_workers=min(self.options["concurrency"], len(bodies)) or 1,
                                  thread_name_prefix="vlmrl-judge")
        try:
            futures = {pool.submit(with_retries, self.where, functools.partial(attempt, body), self.options, stop): body
                       for body in bodies}
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [future.exception() for future in done if future.exception() is not None]
            if failed:
                raise failed[0]
            return {futures[future]: future.result() for future in futures}
        finally:
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)

    def hidden(self, text: str) -> str:
        """`text` without the API key's value (an error that quotes what a server echoed)."""
        key = os.environ.get(self.options["api_key_env"], "") if self.options["api_key_env"] else ""
        return text.replace(key, REDACTED) if key else text

    def warn(self, unread: list[str], total: int) -> None:
        """Say once per run that replies went unread, with the first of them (counted in reward/<label>/unparsable)."""
        if unread and not self.warned:
            self.warned = True
            warnings.warn(self.hidden(f"{self.where}: the score rule read no score in {len(unread)} of {total} replies "
                                      f"(scored {self.options['unparsable']:g}, counted as <label>/unparsable); the "
                                      f"first: {unread[0][:200]!r}"), stacklevel=2)


def judge_reward(settings: Mapping[str, Any]) -> tuple[Callable[..., list], frozenset[str]]:
    """The judge's batched reward function and the keywords it takes (the images only when it sends them)."""
    judge = Judge(settings)
    takes = {"prompts", "completions", "answer"} | ({"images"} if judge.options["images"] else set())
    return judge, frozenset(takes)

