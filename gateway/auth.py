"""Optional API keys, and the WebSocket's Origin policy. No key configured means every API is open.

Keys come from `api_keys` (comma-separated) and `api_keys_file` (one key per line; blank lines and
lines starting with '#' are skipped). A presented key is compared with every configured key in
constant time, so the time taken says nothing about how much of a key matched, or which.

A browser lets any page open a WebSocket to any address, sending the page's origin in `Origin`:
with keys off, any site the user visits could drive a gateway on localhost (cross-site WebSocket
hijacking). `origin_allowed` decides which origins may open `/v1/ws`.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from gateway.choices import host_name
from gateway.settings import GatewaySettings


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> ApiKeys:
        """Raises OSError when `api_keys_file` cannot be read."""
        keys = [k.strip() for k in settings.api_keys]
        if settings.api_keys_file:
            lines = Path(settings.api_keys_file).read_text(encoding="utf-8").splitlines()
            keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, presented: str | None) -> bool:
        """True when keys are off, or `presented` is one of them."""
        if not self._keys:
            return True
        candidate = (presented or "").encode()
        matches = [hmac.compare_digest(candidate, key) for key in self._keys]  # every key compared
        return bool(presented) and any(matches)

    def check_bearer(self, header: str | None) -> bool:
        """Checks an `Authorization: Bearer KEY` header value (the scheme is case-insensitive)."""
        scheme, _, token = (header or "").strip().partition(" ")
        return not self._keys or (scheme.lower() == "bearer" and self.check(token.strip()))


_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_allowed(origin: str | None, host: str | None, allowed: Iterable[str]) -> bool:
    """Whether a WebSocket handshake or an HTTP API request with this `Origin` header may proceed.

    No Origin (a client that is not a browser): yes. `"*"` among `allowed`: any origin. Otherwise the
    origin must be the gateway's own (its host and port those of the request's `Host` header, a Host
    without a port meaning the origin scheme's default port), or one of `allowed`, compared by scheme,
    host and port ("https://app.example" is "https://app.example:443"). "null" (a sandboxed or file
    page) and anything that is not an http(s) origin are refused.
    """
    if origin is None:
        return True
    entries = list(allowed)
    if "*" in entries:
        return True
    parsed = _origin(origin)
    if parsed is None:
        return False
    return parsed in {_origin(entry) for entry in entries} or (host is not None and _same_host(parsed, host))


def _origin(value: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin such as "https://example.com:8443", or None if not one."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname, _DEFAULT_PORTS[scheme] if port is None else port


def _same_host(origin: tuple[str, str, int], host: str) -> bool:
    """Whether `origin` names the host and port of a `Host` header value."""
    try:
        parts = urlsplit("//" + host.strip())
        port = parts.port
    except ValueError:
        return False
    scheme, origin_host, origin_port = origin
    expected_port = _DEFAULT_PORTS[scheme] if port is None else port
    return parts.hostname == origin_host and origin_port == expected_port


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def allowed_hosts(configured: Iterable[str], bound_host: str) -> frozenset[str]:
    """The host names a request's `Host` header may give (lower case; `"*"`: any). Configured
    (`--allowed-hosts`): those. Else the loopback names and the host the gateway is bound to; a gateway
    bound to every interface answers to any name (it is meant to be reached from the network)."""
    entries = [entry.strip().lower() for entry in configured if entry.strip()]
    if entries:
        return frozenset(entry.strip("[]") for entry in entries)
    if bound_host.strip("[]") in WILDCARD_BINDS:
        return frozenset({"*"})
    return frozenset({*LOOPBACK_HOSTS, bound_host.strip("[]").lower()})


def host_allowed(host: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's `Host` header (name or address, any port) is in `allowed`: a browser page
    whose name was rebound to this gateway's address (DNS rebinding) sends its own name, which is not."""
    if "*" in allowed:
        return True
    name = host_name(host)
    return name is not None and name in allowed
