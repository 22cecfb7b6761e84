"""Configuration of the HTTP front end."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to listen on (0.0.0.0 for all)."""
    port: int = 8000
    """TCP port."""
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <api_key>`."""
    served_model_name: str | None = None
    """Name in /v1/models and responses; None = the model's own name."""
    log_level: str = "info"
    """debug, info, warning or error."""

    def __post_init__(self) -> None:
        if not (0 < self.port < 65536):
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
