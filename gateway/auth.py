"""Optional API keys. None configured means every API is open.

Keys come from `api_keys` (comma-separated) and `api_keys_file` (one key per line; blank lines and
lines starting with '#' are skipped). A presented key is compared with every configured key in
constant time, so the time taken says nothing about how much of a key matched, or which.
"""

from __future__ import annotations

import hmac
from pathlib import Path

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
        if not presented:
            return False
        candidate = presented.encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(candidate, key)
        return matched

    def check_bearer(self, header: str | None) -> bool:
        """Checks an `Authorization: Bearer KEY` header value (the scheme is case-insensitive)."""
        if not self._keys:
            return True
        if not header:
            return False
        scheme, _, token = header.strip().partition(" ")
        return scheme.lower() == "bearer" and self.check(token.strip())
