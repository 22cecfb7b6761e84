"""CLI: defaults come from the component configs, then the config file, then flags."""
import pytest

from server.cli import build_parser, resolve


def test_defaults_file_and_flags_layer():
    model, drafter, sched, server = resolve([])
    assert model.model is None and drafter.drafter == "dspark" and server.port == 8000
    _, drafter, sched, _ = resolve(["--config", "embedded-ngram", "--max-num-seqs", "3"])
    assert drafter.drafter == "ngram" and drafter.block_size == 5 and sched.max_num_seqs == 3
    _, drafter, _, _ = resolve(["--drafter", "none"])
    assert drafter.drafter == "none"


def test_help_lists_every_flag_with_its_default():
    text = build_parser().format_help()
    for flag in ("--model", "--config", "--host", "--port", "--api-key", "--max-num-seqs",
                 "--max-model-len", "--kv-cache-tokens", "--kv-cache-memory-fraction", "--device",
                 "--dtype", "--drafter", "--drafter-path", "--block-size", "--verify-policy",
                 "--reprofile"):
        assert flag in text, flag
    assert "default: 8000" in text


@pytest.mark.parametrize("argv,word", [(["--port", "0"], "port"), (["--drafter", "magic"], "magic"),
                                       (["--verify-policy", "fastest"], "fastest"),
                                       (["--config", "nope"], "nope")])
def test_bad_values_raise_quoting_them(argv, word):
    with pytest.raises(ValueError, match=word):
        resolve(argv)
