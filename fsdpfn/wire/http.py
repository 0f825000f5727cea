"""The HTTP helpers both ends use: a small JSON-over-HTTP client (stdlib only) whose every failure is a WeightSyncError naming the
server, the endpoint, and what happened; and a thread runner with a deadline."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from fsdpfn.errors import WeightSyncError

__all__ = ["call", "Call", "is_http_url", "check_urls"]

# receivers are addressed directly: environment proxies are never used
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def is_http_url(value) -> bool:
    """A str ``http://host[:port][/path]`` or ``https://...``: a host, and a port (if any) that
    is a number in 1..65535."""
    from urllib.parse import urlsplit

    if not isinstance(value, str) or value != value.strip() or any(c.isspace() for c in value):
        return False
    try:
        parts = urlsplit(value)
        port = parts.port  # ValueError: not a number, or out of 0..65535
    except ValueError:
        return False
    # a query or fragment would end up before the endpoint's path appended to the URL
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0 \
        and not parts.query and not parts.fragment and "?" not in value and "#" not in value


def check_urls(urls) -> list[str]:
    """``urls`` (one URL or a list) as a list without trailing slashes, each an http(s) URL
    with a host, a numeric port if any, no query, and each named once; else ConfigError."""
    from fsdpfn.errors import ConfigError

    if not isinstance(urls, (str, list, tuple)):
        raise ConfigError(f"urls: must be one or more 'http://host:port' strings, got {urls!r}")
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"urls: must be one or more 'http://host:port' strings, got {urls!r}")
    for url in urls:
        if not is_http_url(url):
            raise ConfigError(f"urls: must be one or more 'http://host:port' strings (http "
                              f"or https, a host, a port if any in 1..65535, no query or "
                              f"spaces), got {url!r}" + (f" in {urls!r}" if len(urls) > 1 else ""))
    urls = [u.rstrip("/") for u in urls]
    repeated = sorted({u for u in urls if urls.count(u) > 1})
    if repeated:
        raise ConfigError(f"urls: must name each server once (one request or update per "
                          f"server), got {repeated[0]!r} "
                          f"{urls.count(repeated[0])} times")
    return urls


def call(url: str, path: str, payload: dict | None = None, *, timeout: float) -> dict:
    """GET (payload None) or POST JSON; returns the JSON answer or raises WeightSyncError."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data,
                                 headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    where = f"server {url}: {path}"
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        message = exc.read().decode(errors="replace")
        try:
            body = json.loads(message)
            if isinstance(body, dict):
                message = body.get("message") or body.get("error_message") or message
        except ValueError:
            pass
        raise WeightSyncError(f"{where} answered HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise WeightSyncError(f"{where} failed: {type(reason).__name__}: {reason} (timeout "
                              f"{timeout:g} s; is the server running?)") from None
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        raise WeightSyncError(f"{where} answered non-JSON: {body[:200]!r}") from None
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"{where} reported failure: "
                              f"{answer.get('message') or answer.get('error_message')}")
    return answer


class Call:
    """``fn()`` in a daemon thread; ``result(deadline)`` returns it or raises WeightSyncError
    (its own error, or a timeout naming ``what``)."""

    def __init__(self, fn: Callable[[], Any], what: str):
        self.what = what
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                        name=f"fsdpfn-push {what}")
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, deadline: float) -> Any:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise WeightSyncError(f"{self.what}: no answer before the deadline (timeout_s)")
        if self._error is not None:
            if isinstance(self._error, WeightSyncError):
                raise self._error
            raise WeightSyncError(f"{self.what}: {type(self._error).__name__}: {self._error}")
        return self._value
