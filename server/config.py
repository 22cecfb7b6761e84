"""Configuration of the HTTP front end."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from dspark_serve.server.keys import ApiKeys
from dspark_serve.server.reasoning import REASONING_PARSER_NAMES
from dspark_serve.server.tool_formats import PARSER_NAMES, VENDORED_TEMPLATES


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to listen on (0.0.0.0 for all)."""
    port: int = 8000
    """TCP port."""
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <key>`: this key, or several one per line,
    each optionally after a name and a space (`server/keys.py`; the name labels the key's metrics
    and its fair share of slots). Prefer the DSPARK_API_KEY environment variable or
    `api_key_file` (a flag is visible in the process list)."""
    api_key_file: str | None = None
    """A file holding the API key, or several one per line as `api_key` (`name key` lines; `#`
    comments), read at start-up."""
    served_model_name: str | None = None
    """Name in /v1/models and responses; None = the model's own name."""
    log_level: str = "info"
    """debug, info, warning or error."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body accepted; a bigger one is answered 413 without being parsed."""
    max_json_depth: int = 32
    """Deepest nesting of arrays/objects accepted in a request body (deeper: 400)."""
    header_timeout: float = 10.0
    """Seconds a client has to send a request's headers (from connecting, or from the end of
    the last response on a kept-alive connection); a slower one is answered 408 and dropped."""
    body_timeout: float = 30.0
    """Seconds a client has to send a request's whole body once its headers are in; a slower
    one is answered 408 and dropped."""
    max_connections: int = 1000
    """Open client connections at most; one more is answered 503 and closed at once (past it,
    `health_reserve` more are kept for /health and /metrics alone)."""
    max_client_connections: int = 64
    """Open connections from one client address at most (the trusted proxies' excepted); one
    more is answered 503 and closed at once, so one address cannot fill `max_connections`."""
    max_client_pending: int = 8
    """Connections from one client address that have not yet sent a request's headers, at
    most (the trusted proxies' excepted); one more is answered 503 and closed."""
    pending_grace: float = 0.5
    """Seconds a new connection may go without a request's headers before it counts against
    `max_client_pending` (a burst of connections from one address is not refused while the
    server reads their first requests)."""
    first_byte_timeout: float = 3.0
    """Seconds a new connection has to send its first byte; a silent one is closed (the header
    deadline then runs to `header_timeout`)."""
    health_reserve: int = 16
    """Connections accepted past `max_connections` that may only ask GET /health or /metrics (an
    orchestrator's probe still answered while the pool is full); anything else there is 503."""
    trusted_proxies: str = ""
    """Comma-separated client addresses (a load balancer, an ingress) exempt from the
    per-client connection limits: they carry many clients' connections. Their X-Forwarded-For
    names the client a request is from (its fair share of slots without API keys); nobody
    else's is believed."""
    tokenize_concurrency: int = 2
    """Requests whose bodies are parsed and prompts tokenized at the same time; more wait their
    turn (a burst of huge prompts holds this many threads, not one per request)."""
    intake_queue_bytes: int = 16 * 2**20
    """Declared bytes of large bodies (over 64 KiB) in the server at once, being received or
    waiting their turn; a body that would pass it is answered 429 (Retry-After) unread and its
    connection closed (the line always takes one body when empty)."""
    intake_rate_busy: int = 24 * 2**20
    """Bytes a second at which large bodies are received, all together, while the engine has
    requests in flight (0: unpaced); an idle engine receives them at full speed."""
    tool_call_parser: str = "auto"
    """How the model writes tool calls: json, hermes, llama3_json or mistral (vLLM's names);
    auto picks by the chat template and model family (json where the template renders no tools)."""
    reasoning_parser: str = "auto"
    """How the model marks its reasoning, returned as `reasoning_content`: qwen3 or deepseek_r1
    (vLLM's names); auto picks by the model family, none leaves it in the content."""
    chat_template: str | None = None
    """A chat template in place of the model's: a Jinja file, or a shipped one by name (hermes,
    llama3_json, mistral)."""
    shutdown_timeout: float = 30.0
    """On SIGTERM (or `drain`): seconds in-flight requests may still run before their streams
    are ended with an error event and finish_reason `abort`."""

    @property
    def proxy_addresses(self) -> frozenset[str]:
        """`trusted_proxies` as a set of addresses."""
        return frozenset(a.strip() for a in self.trusted_proxies.split(",") if a.strip())

    def _check_connection_limits(self) -> None:
        counts = ("max_connections", "max_client_connections", "max_client_pending", "tokenize_concurrency")
        for name in counts:
            value = getattr(self, name)
            if not (1 <= value <= 1_000_000):
                raise ValueError(f"{name} must be in [1, 1000000], got {value!r}")
        if self.intake_queue_bytes < 1:
            raise ValueError(f"intake_queue_bytes must be >= 1, got {self.intake_queue_bytes!r}")
        if self.intake_rate_busy < 0:
            raise ValueError(f"intake_rate_busy must be >= 0 (0: unpaced), got {self.intake_rate_busy!r}")
        if not (0 <= self.health_reserve <= 10_000):
            raise ValueError(f"health_reserve must be in [0, 10000], got {self.health_reserve!r}")
        for address in self.proxy_addresses:
            try:
                ipaddress.ip_address(address)
            except ValueError:
                raise ValueError(f"trusted_proxies holds {address!r}, which is no IP address") from None

    def __post_init__(self) -> None:
        if not (0 < self.port < 65536):
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.api_key is not None:
            ApiKeys.parse(self.api_key)  # a ValueError naming the line that is wrong
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError(f"give api_key or api_key_file, not both (api_key_file={self.api_key_file!r})")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes!r}")
        if not (2 <= self.max_json_depth <= 256):
            raise ValueError(f"max_json_depth must be in [2, 256], got {self.max_json_depth!r}")
        for name in ("header_timeout", "body_timeout", "first_byte_timeout", "pending_grace"):
            value = getattr(self, name)
            if not (0 < value <= 3600):
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {value!r}")
        self._check_connection_limits()
        if self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(PARSER_NAMES)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in REASONING_PARSER_NAMES:
            names = ", ".join(REASONING_PARSER_NAMES)
            raise ValueError(f"reasoning_parser must be one of {names}, got {self.reasoning_parser!r}")
        if self.chat_template is not None and not (
            self.chat_template in VENDORED_TEMPLATES or Path(self.chat_template).is_file()
        ):
            names = ", ".join(VENDORED_TEMPLATES)
            raise ValueError(f"chat_template must be a file or one of {names}, got {self.chat_template!r}")
        if not (0 <= self.shutdown_timeout <= 3600):
            raise ValueError(f"shutdown_timeout must be in [0, 3600] seconds, got {self.shutdown_timeout!r}")
