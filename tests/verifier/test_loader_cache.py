"""A .gguf file is read in place: the model equals transformers' own conversion of the file,
nothing but the tokenizer is cached, and a damaged tokenizer copy is converted again (never
trusted)."""

import logging

import numpy as np
import pytest
import torch
import transformers

from dspark_serve.verifier import loader
from dspark_serve.verifier.gguf_model import gguf_config_dict, model_from_gguf
from dspark_serve.verifier.gguf_reader import GgufReader


@pytest.fixture(scope="module")
def embedded():
    return loader.embedded_gguf_path()


def test_the_reader_reads_what_gguf_reads(embedded):
    import gguf

    mine, theirs = GgufReader(embedded), gguf.GGUFReader(embedded, "r")
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(mine.tensors, theirs.tensors):
        assert (a.tensor_type, a.data_offset, a.n_bytes) == (
            b.tensor_type,
            int(b.data_offset),
            int(b.n_bytes),
        )
        assert a.shape == tuple(int(x) for x in b.shape) and np.array_equal(a.data, b.data)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        values = [field.contents(i) for i in range(len(field.data))] if field.data else []
        got = mine.metadata[key]
        if isinstance(got, (list, np.ndarray)):
            assert list(got) == field.contents(), key
        else:
            assert got == values[0], key


def test_the_model_read_in_place_equals_transformers_conversion(embedded):
    ours = model_from_gguf(GgufReader(embedded))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        embedded.parent, gguf_file=embedded.name, dtype=torch.float32
    ).eval()
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    skip = {"_name_or_path", "quantization_config"}
    ca, cb = ours.config.to_dict(), ref.config.to_dict()
    assert {k: v for k, v in ca.items() if k not in skip} == {k: v for k, v in cb.items() if k not in skip}
    assert gguf_config_dict(GgufReader(embedded))["tie_word_embeddings"] is True
    ids = torch.tensor([[1, 2, 3, 400, 500]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_only_the_tokenizer_is_cached_and_a_damaged_copy_is_converted_again(embedded, tmp_path, caplog):
    cache = tmp_path / "cache"
    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(*a, **k):
        calls.append(k.get("gguf_file"))
        return real(*a, **k)

    mp = pytest.MonkeyPatch()
    mp.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    try:
        tok = loader.gguf_tokenizer(embedded, cache)
        (cached,) = (cache / "tokenizers").iterdir()
        assert calls == [embedded.name] and not list((cache / "tokenizers").glob("*.tmp"))
        again = loader.gguf_tokenizer(embedded, cache)
        assert calls == [embedded.name, None]  # read from the cache
        text = "Hello, world! def f(x): return x"
        assert again.encode(text) == tok.encode(text) and again.chat_template == tok.chat_template
        for f in cached.iterdir():
            f.write_text("{")  # damaged
        with caplog.at_level(logging.WARNING):
            third = loader.gguf_tokenizer(embedded, cache)
        assert calls[-1] == embedded.name and third.encode(text) == tok.encode(text)
        assert any("damaged" in r.getMessage() for r in caplog.records)
    finally:
        mp.undo()
    # nothing but the tokenizer: no converted weights anywhere in the cache
    assert not [p for p in cache.rglob("*.safetensors")]


def test_the_c_row_decoder_and_gguf_dequantize_give_the_same_weights(embedded, monkeypatch):
    from transformers import AutoConfig

    from dspark_serve.ops.cpu_kernels import load_kernels
    from dspark_serve.verifier import gguf_model

    if load_kernels() is None:
        pytest.skip("no C compiler here: only gguf's dequantizers serve")
    reader = GgufReader(embedded)
    cfg = gguf_config_dict(reader)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    by_c = gguf_model.gguf_weights(reader, config)
    monkeypatch.setattr(gguf_model, "loaded_kernels", lambda: None)
    by_numpy = gguf_model.gguf_weights(reader, config)
    assert by_c.keys() == by_numpy.keys() and all(torch.equal(by_c[k], by_numpy[k]) for k in by_c)
