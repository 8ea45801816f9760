"""URLs shown without their secrets: one redaction for every place a URL is printed or saved.

A reward service's URL may carry credentials: a `user:password@` userinfo, or a key in its query
string (`?api_key=...`, `&token=...`, `&sig=...`). Whatever shows or saves a URL (the preflight line,
config.yaml, an error line, the HTML report, a reward's logged name) shows `redact(url)` instead:
the userinfo becomes `***@` and each query value whose name looks like a credential (SECRET_NAMES)
becomes `***`; `redact_text` does the same to every URL inside a longer text. `split_userinfo` takes
the userinfo out of a URL, to be sent as an HTTP Basic `Authorization` header rather than to the
resolver as part of a host name. No vlmrl import: every layer may use it.
"""

from __future__ import annotations

import base64
import re
import urllib.parse

REDACTED = "***"
"""What a secret is shown as."""

SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "pwd", "pass", "sig", "signature", "auth",
                "authorization", "credential", "credentials", "session", "cookie", "bearer", "jwt")
"""A query parameter (or a header) holds a credential when a word of its name (split at `_`, `-`,
`.`) is one of these or ends in key, token or secret: key, api_key, apikey, access_token, X-Api-Key,
client_secret, password, sig, Authorization... (`design` or `page` are not)."""

_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
"""A URL inside a text (up to the next space or quote)."""


def is_secret_name(name: str) -> bool:
    """Whether a query parameter or header called `name` holds a credential."""
    words = [word for word in re.split(r"[^a-z0-9]+", name.lower()) if word]
    return any(word in SECRET_WORDS or word.endswith(("key", "token", "secret")) for word in words)


def redact(url: str) -> str:
    """`url` as it may be shown or saved: `scheme://***@host:port/path?key=***&page=2`; a URL without
    userinfo or credential-like query values comes back unchanged (byte for byte)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # an unparsable URL (a bad IPv6 literal): keep only what precedes its host
        return url.split("://", 1)[0] + "://" + REDACTED if "://" in url else url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = REDACTED + "@" + netloc.rpartition("@")[2]
    query = "&".join(_redacted_pair(pair) for pair in parts.query.split("&")) if parts.query else parts.query
    if netloc == parts.netloc and query == parts.query:
        return url
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redacted_pair(pair: str) -> str:
    """One `name=value` of a query string, its value hidden when its name is a credential's."""
    name, sep, value = pair.partition("=")
    return f"{name}={REDACTED}" if sep and value and is_secret_name(urllib.parse.unquote_plus(name)) else pair


def redact_text(text: str) -> str:
    """`text` with every URL in it redacted (an error message that quotes one)."""
    return _URL.sub(lambda match: redact(match.group(0)), text)


def is_redacted(url: str) -> bool:
    """Whether `url` is one `redact` hid a credential of (read back from a saved config.yaml)."""
    parts = urllib.parse.urlsplit(url)
    values = [value for _, value in urllib.parse.parse_qsl(parts.query)]
    return parts.netloc.rpartition("@")[0] == REDACTED or REDACTED in values


def host(url: str) -> str:
    """`host` or `host:port` of `url`, never its userinfo (the name a reward service is logged under)."""
    netloc = urllib.parse.urlsplit(url).netloc
    return netloc.rpartition("@")[2]


def split_userinfo(url: str) -> tuple[str, str | None]:
    """(`url` without its userinfo, the `Authorization` header value of HTTP Basic auth for that
    userinfo, or None without one); `user:pass` percent-decoded as RFC 3986 writes it."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode("utf-8")
    return (urllib.parse.urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment)),
            "Basic " + base64.b64encode(token).decode("ascii"))
