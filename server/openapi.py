"""The OpenAPI document (/openapi.json): the routes, the request models' schemas, and those
schemas narrowed to what the server accepts, so a schema-driven client or fuzzer sends valid
requests when it means to. No torch here.

The narrowing restates the request model's limits (`protocol.py`, the owner of each) in
JSON Schema terms, together with what only the running engine knows: the served model's name,
the context length, the vocabulary. Anything outside still gets a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dspark_serve.server.protocol import (
    BIAS_LIMIT,
    MAX_CHOICES,
    MAX_STOPS,
    MAX_TOP_LOGPROBS,
    PENALTY_LIMIT,
    TOKEN_ID_KEY,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
)
from dspark_serve.server.responses import ResponsesRequest
from dspark_serve.server.state import AppState

_NULL = {"type": "null"}


def install_openapi(app: FastAPI, state: AppState) -> None:
    """Serve `openapi_document` (built once, on its first request) as the app's document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, state)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def openapi_document(app: FastAPI, state: AppState) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (ChatCompletionRequest, CompletionRequest, ResponsesRequest, ErrorResponse):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        comps[model.__name__] = js
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        narrow_request_schema(
            comps[name]["properties"], state.served_model_name, state.engine.max_model_len, state.vocab_size
        )
    comps["ResponsesRequest"]["properties"]["model"] = {
        "anyOf": [{"type": "string", "enum": [state.served_model_name]}, _NULL],
        "default": None,
    }
    for op in doc["paths"].get("/v1/models/{model_id}", {}).values():
        for prm in op.get("parameters", []):
            prm["schema"] = {"type": "string", "enum": [state.served_model_name]}
    if state.config.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in doc["paths"].items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return doc


def narrow_request_schema(props: dict[str, Any], model: str, max_len: int, vocab: int | None) -> None:
    """A request model's properties documented as what is accepted, not merely what parses:
    the values checked by rules the JSON schema of the model does not carry (n, penalties,
    logprobs, stop, model, token ids)."""
    props["model"] = {"anyOf": [{"type": "string", "enum": [model]}, _NULL], "default": None}
    props["n"] = {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "default": 1}
    for k in ("presence_penalty", "frequency_penalty"):
        props[k] = {"type": "number", "minimum": -PENALTY_LIMIT, "maximum": PENALTY_LIMIT, "default": 0}
    _narrow_logprobs(props)
    word = {"type": "string", "minLength": 1}
    words = {"type": "array", "items": word, "maxItems": MAX_STOPS}
    props["stop"] = {"anyOf": [word, words, _NULL], "default": None}
    for k in ("max_tokens", "max_completion_tokens"):
        if k in props:
            props[k] = {
                "anyOf": [{"type": "integer", "minimum": 1, "maximum": max_len - 1}, _NULL],
                "default": props[k].get("default"),
            }
    _narrow_token_ids(props, vocab)


def _narrow_logprobs(props: dict[str, Any]) -> None:
    count = {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}
    if "top_logprobs" in props:  # chat: logprobs is a flag, top_logprobs the count
        props["logprobs"] = {"anyOf": [{"type": "boolean"}, _NULL], "default": None}
        props["top_logprobs"] = {"anyOf": [count, _NULL], "default": None}
    else:
        props["logprobs"] = {"anyOf": [count, _NULL], "default": None}


def _narrow_token_ids(props: dict[str, Any], vocab: int | None) -> None:
    """logit_bias keys, and a completions prompt given as token ids, within the vocabulary."""
    key: dict[str, Any] = {"pattern": TOKEN_ID_KEY}
    if vocab is not None:
        key = {"allOf": [key, {"pattern": below_pattern(vocab)}]}
    bias = {"type": "number", "minimum": -BIAS_LIMIT, "maximum": BIAS_LIMIT}
    props["logit_bias"] = {
        "anyOf": [{"type": "object", "propertyNames": key, "additionalProperties": bias}, _NULL],
        "default": None,
    }
    if "prompt" in props:
        ids = {"type": "integer", "minimum": 0}
        if vocab is not None:
            ids["maximum"] = vocab - 1
        props["prompt"] = {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                {"type": "array", "items": ids, "minItems": 1},
            ]
        }


def below_pattern(n: int) -> str:
    """A regular expression matching the decimal integers in [0, n) (leading zeros allowed),
    for a schema to say which token ids a key may name. n >= 1."""
    top = str(n - 1)
    k = len(top)
    alts = [f"[0-{top}]"] if k == 1 else ["[0-9]"]
    alts += [f"[1-9][0-9]{{{length - 1}}}" for length in range(2, k)]
    for i in range(k if k > 1 else 0):
        lo, hi = (1 if i == 0 else 0), int(top[i]) - 1
        if hi >= lo:
            rest = k - i - 1
            alts.append(top[:i] + f"[{lo}-{hi}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    if k > 1:
        alts.append(top)
    return f"^0*({'|'.join(alts)})$"
