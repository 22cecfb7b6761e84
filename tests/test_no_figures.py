"""No measured figures in code: comments, docstrings and strings (argparse help texts included)
state the reason, and the measurement lives in docs/benchmarks.md beside its command and result
file. A figure in code goes stale the day the code or the machine changes, and nothing checks it.

What counts as a measured figure: a ratio ("1.3x"), a speed ("120 tok/s"), a time ("2.3 ms",
"40 us") or a share ("15%") written with a number. Format strings carry no number ("{ratio:.2f}x",
"{tps:.1f} tok/s"), so they are not flagged. A definition that reads like a figure (a limit, a
default) goes in ALLOWED with the reason it is not a measurement.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "scheduler", "drafter", "verifier", "ops", "training", "configs")

# A number not glued to a name or another number (a digit inside a name such as "v2" or "fp16", or
# the tail of a longer number, does not start one), then the unit.
NUMBER = r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
FIGURE_PATTERNS = {
    "ratio": re.compile(NUMBER + r"x\b"),
    "speed": re.compile(NUMBER + r" ?(?:tok|tokens?)/s\b"),
    "time": re.compile(NUMBER + r" ?(?:ms|µs|us)\b"),
    "share": re.compile(NUMBER + r" ?%"),
}

# file (relative to the repository root) -> {exact snippet: why it is not a measurement}.
ALLOWED: dict[str, dict[str, str]] = {
    "bench/memory_soak.py": {"(the aim: under 1%)": "the threshold the report is judged by"},
    "training/train.py": {"cosine decay to 10% of the peak": "the schedule's floor, a definition"},
    "bench/soak.py": {
        "~20% clients that go away": "the traffic mix the soak sends (its draw's bounds)",
        "goes away (~20%)": "the same share, beside the draw that sets it",
    },
}


@dataclass(frozen=True)
class Hit:
    path: str
    line: int
    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.text!r}"


def scanned_files() -> list[Path]:
    """Every non-test Python file of the packages, and the benchmark scripts."""
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return files + sorted((ROOT / "bench").glob("*.py"))


def prose_tokens(source: str) -> list[tokenize.TokenInfo]:
    """The comments and string literals of a Python source (f-string pieces included)."""
    kinds = {tokenize.COMMENT, tokenize.STRING}
    kinds |= {getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type in kinds]


def is_allowed(rel: str, text: str, match: re.Match[str]) -> bool:
    for snippet in ALLOWED.get(rel, {}):
        start = text.find(snippet)
        while start >= 0:
            if start <= match.start() and match.end() <= start + len(snippet):
                return True
            start = text.find(snippet, start + 1)
    return False


def figures_in(path: Path) -> list[Hit]:
    rel = path.relative_to(ROOT).as_posix()
    hits = []
    for tok in prose_tokens(path.read_text(encoding="utf-8")):
        for kind, pattern in FIGURE_PATTERNS.items():
            for m in pattern.finditer(tok.string):
                if not is_allowed(rel, tok.string, m):
                    line = tok.start[0] + tok.string.count("\n", 0, m.start())
                    hits.append(Hit(rel, line, kind, m.group()))
    return sorted(hits, key=lambda h: h.line)


def test_no_measured_figures_in_code() -> None:
    hits = [hit for path in scanned_files() for hit in figures_in(path)]
    assert not hits, "measured figures in code (move them to docs/benchmarks.md):\n" + "\n".join(
        map(str, hits)
    )


def test_every_allowed_snippet_is_still_there() -> None:
    stale = [
        f"{rel}: {snippet!r}"
        for rel, snippets in ALLOWED.items()
        for snippet in snippets
        if snippet not in (ROOT / rel).read_text(encoding="utf-8")
    ]
    assert not stale, "allow-list entries that match nothing:\n" + "\n".join(stale)


def test_the_patterns_flag_figures_and_spare_formats() -> None:
    def flagged(text: str) -> bool:
        return any(p.search(text) for p in FIGURE_PATTERNS.values())

    for figure in ("1.3x faster", "0.97x", "120 tok/s", "88 tokens/s", "2.3 ms", "40 us", "15%", "1.5 %"):
        assert flagged(figure), figure
    for text in ("{ratio:.2f}x", "{tps:.1f} tok/s", "%.1f%%", "0x1f", "16x16 tiles", "fp16x", "x86", "users"):
        assert not flagged(text), text
