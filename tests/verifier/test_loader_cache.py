"""The GGUF conversion cache: written atomically, and a damaged copy is detected and rebuilt
(never trusted)."""

import transformers

from dspark_serve.verifier import loader
from tests.helpers import tiny_model


class Tok:
    """Stands in for an HF tokenizer: only what the cache writer uses."""

    def save_pretrained(self, d):
        (d / "tokenizer_config.json").write_text("{}")


def test_conversion_problem_spots_damage(tmp_path):
    dest = tmp_path / "m"
    loader._save_plain(tiny_model("llama"), Tok(), dest)
    assert loader.conversion_problem(dest) is None
    assert not list(tmp_path.glob("*.tmp"))
    st = dest / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[:-100])  # truncated
    assert "bytes" in loader.conversion_problem(dest)
    st.write_bytes(data[:5])
    assert loader.conversion_problem(dest) is not None
    st.write_bytes(data)
    (dest / "config.json").write_text('{"model_type": ')
    assert "config.json" in loader.conversion_problem(dest)
    assert loader.conversion_problem(tmp_path / "absent") == "missing"


def test_damaged_conversion_is_rebuilt(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    conversions = []

    def convert(_dir, gguf_file=None, dtype=None):
        conversions.append(gguf_file)
        return tiny_model("llama")

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda p, gguf_file=None, dtype=None: convert(p, gguf_file) if gguf_file else tiny_model("llama"),
    )
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tok())
    monkeypatch.setattr(loader, "check_gguf", lambda path: None)  # a stand-in file: caching only
    cache = tmp_path / "cache"
    loader._load_gguf(gguf, cache)
    assert len(conversions) == 1
    (cached,) = [p for p in cache.iterdir() if p.is_dir()]
    loader._load_gguf(gguf, cache)
    assert len(conversions) == 1  # reused
    st = cached / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])  # a kill mid-copy, say
    loader._load_gguf(gguf, cache)
    assert len(conversions) == 2 and loader.conversion_problem(cached) is None
