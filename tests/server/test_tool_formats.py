"""Each tool format end to end on the embedded vocabulary with the format's markers added: its
shipped chat template renders tools, earlier calls and results; its forced-call grammar takes
exactly the calls the model would write (and the parser reads them back); the format is
detected from the template; and a server on a tiny model streams a forced call in the hermes
format through the official client."""

from __future__ import annotations

import copy
import json

import pytest

from dspark_serve.scheduler.client import ChatTemplate
from dspark_serve.server.params import chat_messages, template_tools, tool_mode
from dspark_serve.server.protocol import ChatCompletionRequest
from dspark_serve.server.tool_formats import (
    HERMES,
    JSON,
    LLAMA3_JSON,
    MISTRAL,
    TOOL_FORMATS,
    VENDORED_TEMPLATES,
    chat_setup,
    detect,
    forced_grammar,
    vendored_template,
)
from dspark_serve.server.tool_parser import parse_reply
from dspark_serve.server.tools import Function

MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
FUNCTIONS = [Function("get_weather", "The weather", WEATHER), Function("noop", None, {"type": "object"})]
TOOLS = [{"type": "function", "function": {"name": f.name, "parameters": f.parameters}} for f in FUNCTIONS]


@pytest.fixture(scope="module")
def tokenizer():
    from dspark_serve.verifier.loader import load_target

    tok = copy.deepcopy(load_target(None).tokenizer)
    tok.add_tokens(MARKERS)  # the formats' markers, single tokens as in the models that use them
    return tok


def written(fmt, calls) -> str:
    """Calls as the format's model writes them (compact JSON, as the grammar forces it)."""
    objs = [json.dumps(fmt.call_object(n, a), separators=(",", ":")) for n, a in calls]
    if fmt is HERMES:
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if fmt is LLAMA3_JSON:
        return "; ".join(objs)
    if fmt is MISTRAL:
        return "[" + ",".join(objs) + "]"
    return objs[0] if len(objs) == 1 else "[" + ",".join(objs) + "]"


def test_the_format_is_detected_from_the_template_then_the_family():
    for name in VENDORED_TEMPLATES:
        assert detect(vendored_template(name), None) is TOOL_FORMATS[TEMPLATE_FORMAT.get(name, name)]
    assert detect("{{ messages }}", "qwen3") is JSON  # a template that renders no tools
    assert detect("{% if tools %}{{ tools }}{% endif %}", "qwen3") is HERMES
    assert detect("{% if tools %}{{ tools }}{% endif %}", "mistral") is MISTRAL
    assert detect(None, "llama") is JSON
    model = ChatTemplate("{{ messages }}", "llama", {})
    assert chat_setup("auto", "hermes", model).tools is HERMES  # the template in use decides
    assert (
        chat_setup("mistral", None, model).tools is MISTRAL and chat_setup("auto", None, model).tools is JSON
    )


TEMPLATE_FORMAT = {"qwen3": "hermes"}  # a shipped template named for its family, not its tool format


@pytest.mark.parametrize("name", ["json", *VENDORED_TEMPLATES])
def test_the_template_renders_tools_earlier_calls_and_results(tokenizer, name):
    setup = chat_setup(
        name if name in TOOL_FORMATS else "auto",
        None if name == "json" else name,
        ChatTemplate(tokenizer.chat_template, "llama", tokenizer.get_added_vocab()),
    )
    fmt = setup.tools
    assert fmt.name == TEMPLATE_FORMAT.get(name, name)
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": TOOLS,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Rome?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "abcDEF123",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "abcDEF123", "content": "Sunny, 24 C"},
            ],
        }
    )
    mode = tool_mode(req, setup)
    ids = tokenizer.apply_chat_template(
        chat_messages(req, fmt, mode),
        tools=template_tools(mode),
        chat_template=setup.template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    text = tokenizer.decode(ids)
    assert "Be brief." in text and "Weather in Rome?" in text and "Sunny, 24 C" in text
    assert '"get_weather"' in text and '"enum": ["Paris", "Rome"]' in text  # the tools, described
    call = fmt.call_object("get_weather", {"city": "Rome", "days": 2})
    if fmt is HERMES:
        assert f"<tool_call>\n{json.dumps(call)}\n</tool_call>" in text
    elif fmt is MISTRAL:
        mistral_call = {**call, "id": "abcDEF123"}
        assert f"[TOOL_CALLS] [{json.dumps(mistral_call)}]" in text
        assert '"call_id": "abcDEF123"' in text
    else:
        assert json.dumps(call) in text
    assert text.index("Weather in Rome?") < text.index('"Rome", "days": 2}') < text.index("Sunny, 24 C")


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("fmt", list(TOOL_FORMATS.values()), ids=list(TOOL_FORMATS))
def test_the_forced_grammar_takes_the_formats_calls_and_no_others(tokenizer, fmt, parallel):
    from dspark_serve.verifier.grammar import GrammarCompiler, GrammarConfig

    compiler = GrammarCompiler.for_hf(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], GrammarConfig(compile_workers=0)
    )
    spec = forced_grammar(fmt, FUNCTIONS, parallel, tokenizer.get_added_vocab())

    def takes(text: str) -> tuple[bool, bool]:  # (every token valid, the grammar may end there)
        g = compiler.compile(spec.kind, spec.schema)
        toks = tokenizer.encode(text, add_special_tokens=False)
        n = g.valid_prefix(toks)
        if n == len(toks):
            g.commit(toks)
        return n == len(toks), n == len(toks) and g.accepting

    one = [("get_weather", {"city": "Paris", "days": 3})]
    two = [*one, ("noop", {})]
    assert takes(written(fmt, one)) == (True, True)
    assert takes(written(fmt, two))[1] is parallel
    assert not takes(written(fmt, [("get_weather", {"city": "Oslo", "days": 1})]))[0]
    assert not takes(written(fmt, [("unknown", {})]))[0]
    reply = parse_reply(fmt, written(fmt, two if parallel else one), {"get_weather", "noop"}, parallel)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == (two if parallel else one)


@pytest.mark.slow
def test_a_server_on_a_hermes_template_streams_a_forced_call_through_the_official_client(tokenizer):
    """A tiny random model behind the embedded vocabulary plus the hermes markers, served with
    the shipped hermes template (the format detected from it), prompt lookup drafting: a named
    tool_choice forces a call the grammar writes in the hermes format; it streams as the call's
    name, then its arguments, and equals the whole reply's call."""

    from dspark_serve.drafter.ngram import build_ngram
    from tests.helpers import tiny_model
    from tests.server.test_e2e import MODEL, tiny_server

    server = tiny_server(
        tokenizer, tiny_model("llama", vocab=len(tokenizer)), build_ngram(block_size=3), "hermes"
    )
    try:
        c = server.client()
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris for two days?"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
        whole = c.chat.completions.create(**kw)
        (call,) = whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        assert args["city"] in ("Paris", "Rome") and args["days"] in (1, 2, 3)
        chunks = list(c.chat.completions.create(**kw, stream=True))
        parts = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
        assert parts[0].id and parts[0].function.name == "get_weather" and len(parts) >= 3
        assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
        assert [
            ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
        ] == ["tool_calls"]
    finally:
        server.close()


def test_the_qwen3_template_thinks_unless_told_not_to(tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    template = vendored_template("qwen3")

    def prompt(**kwargs) -> str:
        ids = tokenizer.apply_chat_template(
            msgs,
            chat_template=template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
        return tokenizer.decode(ids)

    assert prompt().endswith("<|im_start|>assistant\n")  # the reply opens its own think block
    assert prompt(enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    model = ChatTemplate(None, "llama", {})
    assert chat_setup("auto", "qwen3", model, "auto").reasoning is not None  # the template thinks
    assert chat_setup("auto", "hermes", model, "auto").reasoning is None
    assert chat_setup("auto", "qwen3", model, "none").reasoning is None


@pytest.mark.slow
def test_a_schema_applies_after_the_reasoning_ends_under_speculation():
    """A tiny random model behind the embedded vocabulary plus `<think>` tokens, the shipped
    qwen3 template (reasoning detected from it), prompt lookup drafting: with a response_format,
    the grammar lets the reply think first and constrains what follows `</think>`. The logit
    bias makes the model open a think block and, as soon as the grammar lets it, close it (a
    random model would think forever): the content is then valid JSON, the reasoning split off,
    streamed as whole."""

    from dspark_serve.drafter.ngram import build_ngram
    from dspark_serve.verifier.loader import load_target
    from tests.helpers import tiny_model
    from tests.server.test_e2e import MODEL, tiny_server

    tok = copy.deepcopy(load_target(None).tokenizer)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")

    server = tiny_server(tok, tiny_model("llama", vocab=len(tok)), build_ngram(block_size=3), "qwen3")
    try:
        c = server.client()
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
            logit_bias={str(think): 60, str(end): 30},
            temperature=0,
            max_tokens=80,
        )
        whole = c.chat.completions.create(**kw, extra_body={"dspark": {"provenance": True}})
        msg = whole.choices[0].message
        assert whole.choices[0].finish_reason == "stop", msg
        ids = [t["id"] for t in whole.model_extra["dspark"]["tokens"]]
        assert ids[0] == think and end in ids  # it did think: the grammar let it, then took over
        value = json.loads(msg.content)  # no think tags in the content: they went to the reasoning
        assert value["city"] in ("Paris", "Rome") and value["days"] in (1, 2, 3)
        assert "reasoning_content" in msg.model_extra and "<think>" not in msg.content
        chunks = list(c.chat.completions.create(**kw, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert json.loads(text) == value
        reasoning = "".join(
            (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            for ch in chunks
            if ch.choices
        )
        assert reasoning == (msg.model_extra["reasoning_content"] or "")
    finally:
        server.close()
