"""OpenAI request/response schemas (the subset this server implements)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class DsparkOptions(BaseModel):
    """This server's own request extension (`"dspark": {...}` in the body; `extra_body` with
    the official client)."""

    model_config = ConfigDict(extra="forbid")

    provenance: bool = False
    """Add to every response / streamed chunk `"dspark": {"tokens": [...]}`: for each new token
    its id, text, kind (draft / correction / bonus / plain) and draft position."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logprobs: bool | int | None = None
    ignore_eos: bool = False
    user: str | None = None
    dspark: DsparkOptions | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
