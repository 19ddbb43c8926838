"""What the gateway's settings accept beyond numbers, for `GatewaySettings.validate`: the names of the
routing policies and of the chat parsers, the form of a stage's address (`Endpoint`) and of an
`--allowed-hosts` entry. The lowest module of the gateway: it imports none of the others, and the
modules that use these names take them from here (`routing.POLICIES`, `tool_parsers.PARSERS`, whose
names a test checks against `TOOL_CALL_PARSERS`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

ROUTING_POLICIES = ("round_robin", "least_load", "prefix_affinity")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")  # auto: from the chat template
REASONING_PARSERS = ("auto", "think", "none")
DNS_SCHEME = "dns:///"


@dataclass(frozen=True)
class Endpoint:
    """One entry of a stage's endpoints: a fixed `host:port` (one replica; gRPC resolves the host
    itself), or `dns:///host:port`, a name that stands for every address it resolves to (a headless
    Kubernetes Service, `docker compose --scale`), one replica each, re-resolved as they come and go."""

    target: str
    host: str
    port: int
    dns: bool

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Raises ValueError unless `text` is `host:port` or `dns:///host:port` (IPv6 in brackets)."""
        dns = text.startswith(DNS_SCHEME)
        rest = text[len(DNS_SCHEME) :] if dns else text
        host, sep, port = rest.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r} is not host:port or dns:///host:port")
        return cls(text, host, int(port), dns)


def check_allowed_hosts(configured: Iterable[str]) -> None:
    """Raises ValueError naming the first `--allowed-hosts` entry that is not a host name, an IP
    address (IPv6 bare or in brackets) or "*": one with a port (`api.example:8000`) or a scheme would
    never match, since a Host header is matched by its name alone, whatever its port."""
    for entry in configured:
        text = entry.strip()
        if not text or text == "*" or _is_ipv6(text):
            continue
        name = host_name(text)
        if name is None or name != text.lower().removeprefix("[").removesuffix("]"):
            hint = f"; give {name!r}: any port of that host is allowed" if name else ""
            raise ValueError(
                f"allowed_hosts: {text!r} is not a host name (the allow-list matches the Host header's "
                f"name, whatever its port){hint}"
            )


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def host_name(host: str | None) -> str | None:
    """The host name of a `Host` header value, lower case, without port or brackets; None if unusable."""
    if not host:
        return None
    try:
        name = urlsplit("//" + host.strip()).hostname
    except ValueError:
        return None
    return name or None
