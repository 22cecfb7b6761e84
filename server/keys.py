"""API keys: one or several, each with a name. No torch here.

`ServerConfig.api_key` holds one key, or several one per line (what `api_key_file` holds): a
line is a key, or a name, a space and the key; blank lines and lines starting with `#` are
skipped. A key without a name is named `key<line>` (a lone key: `default`). The name is what the
server shows of a key: fair slots count a key's requests together, and the per-key metrics are
labelled by it; the key itself is never logged or exported.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # never "(none)", the metrics' label for no key


@dataclass(frozen=True)
class ApiKey:
    name: str
    secret: bytes


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server accepts. `match` compares a token with every key in constant time."""

    keys: tuple[ApiKey, ...]

    @classmethod
    def parse(cls, text: str) -> ApiKeys:
        """The keys in `text`; a ValueError names the line (never the key) that is wrong."""
        lines = [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)]
        lines = [(i, line) for i, line in lines if line and not line.startswith("#")]
        keys: list[ApiKey] = []
        for i, line in lines:
            fields = line.split()
            if len(fields) > 2:
                got = f"got {len(fields)} fields"
                raise ValueError(f"api key line {i}: expected a key, or a name and a key, {got}")
            if len(fields) == 1:
                name = "default" if len(lines) == 1 else f"key{i}"
            elif not NAME.fullmatch(fields[0]):
                raise ValueError(f"api key line {i}: a name is 1-64 of A-Z a-z 0-9 _ . -, got {fields[0]!r}")
            else:
                name = fields[0]
            keys.append(ApiKey(name, fields[-1].encode()))
        if not keys:
            raise ValueError("no api key given (only blank or comment lines)")
        names = [k.name for k in keys]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"api key names must be distinct, {', '.join(twice)} repeated")
        if len({k.secret for k in keys}) < len(keys):
            raise ValueError("the same api key is given twice")
        return cls(tuple(keys))

    def match(self, token: bytes) -> str | None:
        """The name of the key `token` is, or None; every key is compared (constant time)."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(token, key.secret):
                found = key.name
        return found

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.keys)


# Where the guard leaves the name of the key a request carries (the ASGI scope's "state").
KEY_NAME_STATE = "dspark_api_key_name"


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the name of its API key (empty on a server without keys) and its
    client address (a trusted proxy's X-Forwarded-For client where one forwarded it)."""

    key_name: str
    address: str

    @property
    def tenant(self) -> str:
        """Whose share of slots its requests count against: its key's, or without keys its
        address's (`SchedulerConfig.fair_slots`)."""
        return f"key:{self.key_name}" if self.key_name else f"address:{self.address}"


def caller(scope: Mapping[str, Any]) -> Caller:
    """The caller of the request whose ASGI scope this is."""
    client = scope.get("client")
    name = scope.get("state", {}).get(KEY_NAME_STATE, "")
    return Caller(str(name), str(client[0]) if client else "")
