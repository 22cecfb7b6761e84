"""The rules a request's size and token ids must keep, owned here and applied both at the HTTP
edge (`server/params.py`, before anything is queued) and by the engine's admission
(`admission.py`, for every caller of the engine). Torch-free: the server imports it."""

from __future__ import annotations

from collections.abc import Iterable


class LimitError(ValueError):
    """A limit the request breaks: the message, the parameter it names and an error code."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_token_ids(ids: Iterable[object], vocab: int | None, what: str, param: str) -> None:
    """Every id an int in [0, vocab) (only non-negative while the vocabulary is unknown)."""
    for t in ids:
        if type(t) is not int or t < 0 or (vocab is not None and t >= vocab):
            where = f"[0, {vocab})" if vocab is not None else "(negative)"
            raise LimitError(f"{what} token id {t!r} is out of range {where}", param)


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """The prompt and the completion must fit the model's context."""
    total = prompt_len + max_tokens
    if total > max_model_len:
        raise LimitError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). Please "
            f"reduce the length of the prompt or completion.",
            "max_tokens",
            "context_length_exceeded",
        )


# A token's text is at most `max_chars_per_token` characters of the tokenizer's vocabulary; the
# margin covers normalizers that compose characters (two code points read as one) before the
# split, so the bound below never refuses a prompt that would fit.
CHARS_MARGIN = 2


def check_prompt_chars(chars: int, max_chars_per_token: int, max_model_len: int, param: str) -> None:
    """Refuse a prompt from its length in characters, before it is tokenized, when even its
    fewest possible tokens (each the longest the vocabulary has) cannot fit the context: a
    huge body is rejected in the time it takes to count it, not to tokenize it."""
    fewest = chars // (CHARS_MARGIN * max(1, max_chars_per_token))
    if fewest >= max_model_len:
        raise LimitError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"of {chars} characters is at least {fewest} tokens. Please reduce the length of the prompt.",
            param,
            "context_length_exceeded",
        )
