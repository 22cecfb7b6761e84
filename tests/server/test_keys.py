"""API keys with names (`server/keys.py`): a key file of several keys, the name a request's key
has reaching the engine as its tenant (fair slots) and its metrics' label, and without keys the
client address, a trusted proxy's X-Forwarded-For believed and nobody else's."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from dspark_serve.server.app import build_app
from dspark_serve.server.config import ServerConfig
from dspark_serve.server.keys import ApiKeys
from dspark_serve.server.serve import uvicorn_config
from tests.server.test_app import FakeEngine, assert_error, chat, client
from tests.server.test_e2e import free_port

KEY_FILE = """
# the team's keys
alice sk-alice-1
bob   sk-bob-2
sk-unnamed-3
"""


def test_a_key_file_names_its_keys():
    keys = ApiKeys.parse(KEY_FILE)
    assert keys.names == ("alice", "bob", "key5")  # an unnamed key is named by its line
    assert keys.match(b"sk-bob-2") == "bob" and keys.match(b"sk-unnamed-3") == "key5"
    assert keys.match(b"sk-bob-") is None and keys.match(b"") is None
    assert ApiKeys.parse("just-one-key\n").names == ("default",)


@pytest.mark.parametrize(
    "text,words",
    [
        ("alice k1 extra\n", "line 1: expected a key, or a name and a key, got 3 fields"),
        ("al/ice k1\n", "'al/ice'"),
        ("alice k1\nalice k2\n", "alice repeated"),
        ("alice k1\nbob k1\n", "the same api key is given twice"),
        ("# nothing\n\n", "no api key"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_line_never_the_key(text, words):
    with pytest.raises(ValueError, match=words) as err:
        ServerConfig(api_key=text)
    assert "k1" not in str(err.value) and "k2" not in str(err.value)


def test_the_key_file_is_read_at_start_up(tmp_path):
    from dspark_serve.server.cli import resolve_api_key

    f = tmp_path / "keys"
    f.write_text(KEY_FILE)
    cfg = resolve_api_key(ServerConfig(api_key_file=str(f)), {})
    assert ApiKeys.parse(cfg.api_key or "").names == ("alice", "bob", "key5")
    f.write_text("alice k1\nalice k2\n")
    with pytest.raises(ValueError, match="alice repeated"):
        resolve_api_key(ServerConfig(api_key_file=str(f)), {})


def test_a_request_carries_its_key_name_to_the_engine():
    eng = FakeEngine()
    c = client(eng, api_key=KEY_FILE)
    assert chat(c, headers={"Authorization": "Bearer sk-bob-2"}).status_code == 200
    assert eng.last_params is not None
    assert (eng.last_params.key_name, eng.last_params.tenant) == ("bob", "key:bob")
    assert chat(c, headers={"Authorization": "Bearer sk-alice-1"}, n=2).status_code == 200
    assert (eng.last_params.key_name, eng.last_params.tenant) == ("alice", "key:alice")
    assert eng.last_params.owner  # its two choices are one owner within alice's share
    assert_error(chat(c, headers={"Authorization": "Bearer sk-carol"}), 401)

    keyless = FakeEngine()
    assert chat(client(keyless)).status_code == 200
    assert keyless.last_params is not None
    assert (keyless.last_params.key_name, keyless.last_params.tenant) == ("", "address:testclient")


@pytest.fixture(scope="module")
def proxied_server():
    """A server whose one trusted proxy is 127.0.0.1; a FakeEngine records what it is given."""
    eng = FakeEngine()
    cfg = ServerConfig(port=free_port(), trusted_proxies="127.0.0.1", log_level="error")
    srv = uvicorn.Server(uvicorn_config(build_app(eng, cfg, CollectorRegistry()), cfg))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    yield cfg, eng
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize(
    "source,tenant",
    [("127.0.0.1", "address:203.0.113.7"), ("127.0.0.2", "address:127.0.0.2")],
    ids=["trusted-proxy", "untrusted"],
)
def test_only_a_trusted_proxy_names_the_client(proxied_server, source, tenant):
    """A trusted proxy's X-Forwarded-For names the client whose share a request counts against;
    the same header from anybody else is ignored (a client cannot pose as many)."""
    cfg, eng = proxied_server
    with httpx.Client(
        transport=httpx.HTTPTransport(local_address=source), base_url=f"http://127.0.0.1:{cfg.port}"
    ) as c:
        r = chat(c, headers={"X-Forwarded-For": "203.0.113.7"})
    assert r.status_code == 200
    assert eng.last_params.tenant == tenant
