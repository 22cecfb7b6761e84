"""A request's JSON schema checked and built into an llguidance matcher, without torch.

Both the in-process compiler (`verifier/grammar.py`) and the compile worker
(`verifier/grammar_worker.py`, a separate process that can be killed at the time limit) run
these same steps, so a schema the worker passed builds the same way in the server:

1. `prepare`: size, JSON text, an object, a finite value exists (`no_finite_value`), then the
   llguidance grammar text; a Lark grammar (text starting `%llguidance`, the forced tool calls'
   grammars) has each JSON schema it embeds (`%json {...}`) checked the same way;
2. `build_matcher`: the matcher under parser limits, its first mask (llguidance builds its
   lexer lazily: the first mask is most of the cost of a hard schema), then a short probe walk
   of allowed tokens, where grammars whose forced continuation explodes (a required property
   that refers back to its own definition) fail at once instead of inside an engine step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions


class GrammarError(ValueError):
    """A schema this server refuses (invalid, too large, too slow to compile, unusable)."""


@dataclass(frozen=True)
class GrammarConfig:
    """Bounds on structured output.

    max_schema_bytes: the largest JSON schema accepted (its compact JSON text, in bytes).
    max_compile_seconds: the longest a schema may take to compile, give its first mask and
        pass the probe walk; the compile worker is killed at this limit.
    probe_tokens: how many allowed tokens the probe walk consumes after the first mask.
    compile_workers: processes that check schemas before the server builds them (0: build in
        the server's own process only, the time limit then checked after the build).
    cache_size: compiled grammars kept by schema text (a repeated schema is a cheap copy).
    json_whitespace: the blanks allowed between two JSON tokens: "bounded" (a space, or a line
        break and up to 20 spaces or tabs: the model writes its own layout, compact, spaced or
        indented, and cannot loop on blanks) or "compact" (none).
    """

    max_schema_bytes: int = 32 * 1024
    max_compile_seconds: float = 2.0
    probe_tokens: int = 8
    compile_workers: int = 2
    cache_size: int = 128
    json_whitespace: str = "bounded"

    def __post_init__(self) -> None:
        if self.max_schema_bytes <= 0:
            raise ValueError(f"max_schema_bytes must be > 0, got {self.max_schema_bytes!r}")
        if not (self.max_compile_seconds > 0):
            raise ValueError(f"max_compile_seconds must be > 0, got {self.max_compile_seconds!r}")
        if self.probe_tokens < 0:
            raise ValueError(f"probe_tokens must be >= 0, got {self.probe_tokens!r}")
        if not (0 <= self.compile_workers <= 64):
            raise ValueError(f"compile_workers must be in [0, 64], got {self.compile_workers!r}")
        if self.cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {self.cache_size!r}")
        if self.json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be bounded or compact, got {self.json_whitespace!r}")

    @property
    def json_options(self) -> JsonCompileOptions:
        """llguidance's JSON compile options for this layout."""
        return {"whitespace_pattern": JSON_WHITESPACE[self.json_whitespace]}


# The blanks allowed between two JSON tokens (`GrammarConfig.json_whitespace`). "bounded" lets a
# model write its own layout: forcing compact JSON on a model that indents makes both its drafts
# and its own first choice fail the grammar at every key, so every such row needs a full mask;
# each gap is bounded (as llama.cpp's JSON grammars bound it), so no model loops on blanks.
JSON_WHITESPACE = {"bounded": r"( |\n[ \t]{0,20})?", "compact": ""}
ANY_OBJECT = '{"type": "object"}'


LARK_HEADER = "%llguidance"
LARK_PREFIX = LARK_HEADER + " {}\n"  # what a Lark grammar of this server starts with


def schema_text(kind: str, schema: str | None) -> str:
    """The text a grammar kind is built from: "json_object" (any JSON object), "json_schema"
    (`schema`) or "lark" (`schema`, a Lark grammar starting with `%llguidance`)."""
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema" and schema is not None:
        return schema
    if kind == "lark" and schema is not None:
        if not schema.startswith(LARK_HEADER):
            raise GrammarError(f"a Lark grammar must start with {LARK_HEADER}")
        return schema
    raise GrammarError(f"unknown grammar kind {kind!r}")


def prepare(text: str, config: GrammarConfig) -> str:
    """A JSON schema's text -> llguidance grammar text, after the checks that need no
    tokenizer (raises GrammarError naming the problem)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > config.max_schema_bytes:
        raise GrammarError(f"the JSON schema is {size} bytes; the limit is {config.max_schema_bytes}")
    import llguidance

    if text.startswith(LARK_HEADER):
        for parsed in embedded_schemas(text):
            check_schema(parsed)
        try:
            return str(llguidance.LLMatcher.grammar_from_lark(with_json_options(text, config.json_options)))
        except (ValueError, TypeError, RecursionError) as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from exc
    try:
        parsed = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from exc
    check_schema(parsed)
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(parsed, overrides=config.json_options))
    except (ValueError, TypeError, RecursionError) as exc:
        raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from exc


def check_schema(parsed: Any) -> None:
    """A JSON schema is an object that admits a finite value (GrammarError otherwise)."""
    if not isinstance(parsed, dict):
        raise GrammarError("the JSON schema must be an object")
    problem = no_finite_value(parsed)
    if problem is not None:
        raise GrammarError(f"the JSON schema admits no finite value: {problem}")


def embedded_schemas(lark: str) -> list[Any]:
    """The JSON schemas a Lark grammar embeds (`%json {...}`), decoded."""
    return [value for _, _, value in _embedded(lark)]


def with_json_options(lark: str, options: JsonCompileOptions) -> str:
    """The Lark grammar with `options` as each embedded schema's llguidance options."""
    parts, last = [], 0
    for start, end, value in _embedded(lark):
        if isinstance(value, dict):
            parts += [lark[last:start], json.dumps({**value, "x-guidance": dict(options)})]
            last = end
    return "".join([*parts, lark[last:]])


def _embedded(lark: str) -> list[tuple[int, int, Any]]:
    """(start, end, decoded value) of each `%json {...}` schema in a Lark grammar."""
    out, decoder, at = [], json.JSONDecoder(), lark.find("%json")
    while at >= 0:
        start = lark.find("{", at)
        try:
            value, end = decoder.raw_decode(lark, start)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from exc
        out.append((start, end, value))
        at = lark.find("%json", end)
    return out


def limits() -> llguidance.LLParserLimits:
    """llguidance's own resource limits (its defaults), with errors that do not echo the
    grammar and parser state (they reach clients)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error without llguidance's non-verbose marker."""
    return str(matcher.get_error()).replace("<non-verbose/>", "").strip()


def build_matcher(
    tokenizer: llguidance.LLTokenizer, grammar: str, eos_ids: Iterable[int], config: GrammarConfig
) -> llguidance.LLMatcher:
    """The matcher at its start state, its first mask computed and a probe walk passed."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise GrammarError(f"the JSON schema cannot be compiled: {matcher_error(matcher)}")
    matcher.compute_logit_bias()  # the first mask: the lexer is built here
    if matcher.is_error():
        raise GrammarError(f"the JSON schema cannot be used: {matcher_error(matcher)}")
    probe(matcher, frozenset(int(t) for t in eos_ids), config.probe_tokens)
    return matcher


def probe(matcher: llguidance.LLMatcher, eos_ids: frozenset[int], steps: int) -> None:
    """Consume up to `steps` allowed tokens (the lowest allowed id that is not EOS at each
    step) on a copy of the matcher; raises GrammarError where the copy fails on the way. (A
    copy, not a rollback: llguidance cannot roll back over some special tokens.)"""
    walker = matcher.deep_copy()
    for _ in range(steps):
        if walker.is_stopped():
            break
        raw = walker.compute_logit_bias()
        token = next((i for i, b in enumerate(raw) if b and i not in eos_ids), None)
        if token is None or walker.is_error():
            break
        if not walker.consume_token(token):
            break
    if walker.is_error():
        raise GrammarError(f"the JSON schema cannot be used: {matcher_error(walker)}")


# -- a finite value exists --------------------------------------------------------------------
_SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})


def no_finite_value(schema: Mapping[str, Any]) -> str | None:
    """Why `schema` admits no finite JSON value, when its local `$ref`s make every value
    infinite (a required property, or a non-empty array's items, that refers back to the
    definition it is in); None when a finite value exists or the question is out of reach.

    A least fixed point over the definitions `$ref` names: a definition is satisfiable once it
    is with what is already known satisfiable. Keywords this does not model count as
    satisfiable, so a schema is refused only when it certainly has no finite value."""
    targets = {ref: t for ref in _local_refs(schema, 0) if (t := _resolve(schema, ref)) is not None}
    sat: dict[str, bool] = {}
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if not sat.get(ref) and _finite(target, targets, sat, 0):
                sat[ref] = changed = True
    if _finite(schema, targets, sat, 0):
        return None
    cyclic = sorted(ref for ref in targets if not sat.get(ref))
    where = f" ({', '.join(cyclic[:3])} requires itself)" if cyclic else ""
    return "every value of it would contain itself" + where


def _local_refs(s: Any, depth: int) -> set[str]:
    """Every local `$ref` string under s."""
    out: set[str] = set()
    if depth > 64:
        return out
    if isinstance(s, Mapping):
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out.add(ref)
        for v in s.values():
            out |= _local_refs(v, depth + 1)
    elif isinstance(s, list):
        for v in s:
            out |= _local_refs(v, depth + 1)
    return out


def _finite(s: Any, targets: Mapping[str, Any], sat: Mapping[str, bool], depth: int) -> bool:
    """s has a finite value, a local `$ref` counting as satisfiable when `sat` says so."""
    if depth > 64 or not isinstance(s, Mapping):
        return s is not False

    def sub(x: Any) -> bool:
        return _finite(x, targets, sat, depth + 1)

    ok = True
    ref = s.get("$ref")
    if isinstance(ref, str) and ref in targets:
        ok = sat.get(ref, False)
    if isinstance(s.get("allOf"), list):
        ok = ok and all(sub(x) for x in s["allOf"])
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list) and s[key]:
            ok = ok and any(sub(x) for x in s[key])
    types = s.get("type")
    names = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if "enum" in s or "const" in s or names is None or names & _SCALARS:
        return ok
    options = []
    if "object" in names:
        props = s["properties"] if isinstance(s.get("properties"), Mapping) else {}
        extra = s.get("additionalProperties", True)
        required = s["required"] if isinstance(s.get("required"), list) else []
        options.append(all(sub(props.get(n, extra)) for n in required if isinstance(n, str)))
    if "array" in names:
        n = s.get("minItems", 0)
        prefix = s["prefixItems"] if isinstance(s.get("prefixItems"), list) else []
        items = s.get("items", True)
        first = (
            [prefix[i] if i < len(prefix) else items for i in range(min(n, len(prefix) + 1))]
            if (isinstance(n, int) and n > 0)
            else []
        )
        options.append(all(sub(x) for x in first))
    return ok and any(options)


def _resolve(root: Mapping[str, Any], ref: str) -> Any:
    """The value a local JSON pointer (`#`, `#/$defs/a`, ...) names in root, or None."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def tokenizer_from_json(tokenizer_json: str, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """An llguidance tokenizer from a Hugging Face tokenizer's JSON (what a worker builds)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, eos_token=eos_ids or None)


def hf_tokenizer_json(hf_tokenizer: Any) -> str:
    """A fast Hugging Face tokenizer's JSON, padding and truncation off (as llguidance.hf)."""
    from copy import copy

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast Hugging Face tokenizer")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())
