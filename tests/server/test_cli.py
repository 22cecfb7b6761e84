"""CLI: defaults come from the component configs, then the config file, then flags."""

import pytest

from dspark_serve.server.cli import build_parser, resolve


def test_defaults_file_and_flags_layer():
    model, drafter, sched, server = resolve([])
    assert model.model is None and drafter.drafter == "dspark+ngram" and server.port == 8000
    _, drafter, sched, _ = resolve(["--config", "embedded-ngram", "--max-num-seqs", "3"])
    assert drafter.drafter == "ngram" and drafter.block_size == 5 and sched.max_num_seqs == 3
    _, drafter, _, _ = resolve(["--drafter", "none"])
    assert drafter.drafter == "none"


def test_help_lists_every_flag_with_its_default():
    text = build_parser().format_help()
    for flag in (
        "--model",
        "--config",
        "--host",
        "--port",
        "--api-key",
        "--max-num-seqs",
        "--max-model-len",
        "--kv-cache-tokens",
        "--kv-cache-memory-fraction",
        "--device",
        "--dtype",
        "--drafter",
        "--drafter-path",
        "--block-size",
        "--verify-policy",
        "--reprofile",
    ):
        assert flag in text, flag
    assert "default: 8000" in text


@pytest.mark.parametrize(
    "argv,word",
    [
        (["--port", "0"], "port"),
        (["--drafter", "magic"], "magic"),
        (["--verify-policy", "fastest"], "fastest"),
        (["--config", "nope"], "nope"),
        (["--max-client-pending", "0"], "max_client_pending"),
        (["--tokenize-concurrency", "-3"], "-3"),
        (["--health-reserve", "20000"], "20000"),
        (["--first-byte-timeout", "0"], "first_byte_timeout"),
        (["--trusted-proxies", "10.0.0.1,lb.local"], "lb.local"),
        (["--intake-queue-bytes", "0"], "intake_queue_bytes"),
        (["--intake-rate-busy", "-1"], "-1"),
    ],
)
def test_bad_values_raise_quoting_them(argv, word):
    with pytest.raises(ValueError, match=word):
        resolve(argv)


def _help_of(parser, dest):
    return next(a.help for a in parser._actions if a.dest == dest)


def test_choices_and_help_come_from_the_registries_and_the_config_fields():
    import dataclasses

    from dspark_serve.drafter.registry import drafter_names, drafter_spec
    from dspark_serve.scheduler.policy import policy_usages
    from dspark_serve.server.cli import COMPONENTS, field_docs

    parser = build_parser()
    dests = {a.dest for a in parser._actions} - {"help", "config"}
    assert dests == {f.name for c in COMPONENTS for f in dataclasses.fields(c)}
    for comp in COMPONENTS:
        docs = field_docs(comp)
        for f in dataclasses.fields(comp):
            assert docs.get(f.name), f"{comp.__name__}.{f.name} has no docstring"
            assert _help_of(parser, f.name).startswith(docs[f.name].replace("%", "%%")), f.name
    drafter_help = _help_of(parser, "drafter")
    assert "none" in drafter_help
    for name in drafter_names():
        assert f"{name} ({drafter_spec(name).summary})" in drafter_help
    policy_help = _help_of(parser, "verify_policy")
    for usage in ["auto", *policy_usages()]:
        assert usage in policy_help


def test_a_newly_registered_drafter_or_policy_shows_up_and_is_accepted(monkeypatch):
    from dspark_serve.drafter import registry as dreg
    from dspark_serve.scheduler import policy as pol

    monkeypatch.setitem(dreg._REGISTRY, "echo", dreg.DrafterSpec("echo", "repeats the anchor", False, "x:y"))
    monkeypatch.setitem(pol._REGISTRY, "greedy7", lambda arg: pol.StaticPolicy(k=7))
    monkeypatch.setitem(pol._USAGE, "greedy7", "greedy7:N")
    parser = build_parser()
    assert "echo (repeats the anchor)" in _help_of(parser, "drafter")
    assert "greedy7:N" in _help_of(parser, "verify_policy")
    _, drafter, sched, _ = resolve(["--drafter", "echo", "--verify-policy", "greedy7"])
    assert drafter.drafter == "echo" and sched.verify_policy == "greedy7"


def test_every_shipped_config_loads():
    from dspark_serve.server.cli import CONFIG_DIR

    names = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
    assert "embedded" in names and len(names) >= 5
    for name in names:
        resolve(["--config", name])


@pytest.mark.parametrize(
    "text,words",
    [
        ('[model]\ndrafter = "ngram"\n', ["bad.toml", "[model]", "'drafter'", "[drafter]"]),
        ("[scheduler]\nport = 9000\n", ["bad.toml", "[scheduler]", "'port'", "[server]"]),
        ("[model]\nmax_model_len = 512\n[sampler]\ntemperature = 0.5\n", ["bad.toml", "[sampler]"]),
        ("max_num_seqs = 4\n", ["bad.toml", "'max_num_seqs'", "outside any section", "[scheduler]"]),
        ("[drafter]\nblock_sise = 4\n", ["bad.toml", "[drafter]", "'block_sise'"]),
        ("[server\nport = 1\n", ["bad.toml"]),
    ],
)
def test_config_file_keys_are_checked_per_section(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        resolve(["--config", str(path)])
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_config_file_keys_in_their_sections_are_applied(tmp_path):
    path = tmp_path / "good.toml"
    path.write_text(
        '[model]\nmax_model_len = 512\n[drafter]\ndrafter = "ngram"\nblock_size = 3\n'
        '[scheduler]\nverify_policy = "static:2"\n[server]\nport = 9001\n'
    )
    model, drafter, sched, server = resolve(["--config", str(path), "--port", "9002"])
    assert (model.max_model_len, drafter.drafter, drafter.block_size, sched.verify_policy, server.port) == (
        512,
        "ngram",
        3,
        "static:2",
        9002,
    )
