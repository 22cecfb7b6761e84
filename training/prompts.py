"""Training prompts made here, from nothing any benchmark holds: the drafter learns the target's
own answers, so its prompts need the benchmarks' kinds of work (arithmetic word problems, code,
explanations and writing), not their questions.

Three sources, all local and seeded:
  - code: functions of Python's standard library, as the task of writing, explaining, testing,
    reviewing or reimplementing them (their names, signatures, docstrings and sources);
  - math: word problems and exercises from templates with random numbers, names and items
    (arithmetic, percentages, rates, ratios, equations, number theory, counting, geometry);
  - chat: writing and explaining tasks over a list of everyday and academic topics;
  - json: structured-output and tool-call tasks over the same topics (what a constrained
    request asks for).

`make_prompts` drops every candidate that equals a held-out prompt (the vendored benchmark and
dev sets: `data/prompts/*.jsonl.gz`) or shares a run of `SHINGLE_WORDS` words with one, so a
prompt that happens to quote a benchmark never reaches the training data; `tests/training/
test_prompts.py` checks the committed set against those sets by hash.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import inspect
import json
import random
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# A shared run of this many words (lowercased, punctuation dropped) counts as a copy.
SHINGLE_WORDS = 12

STDLIB_MODULES = (
    "string", "textwrap", "json", "csv", "heapq", "bisect", "itertools", "functools", "collections",
    "statistics", "math", "fractions", "decimal", "datetime", "calendar", "re", "difflib", "shlex",
    "html", "urllib.parse", "pathlib", "posixpath", "glob", "fnmatch", "random", "operator", "copy",
    "pprint", "base64", "binascii", "hashlib", "zlib", "gzip", "tarfile", "zipfile", "email.utils",
    "ipaddress", "uuid", "secrets", "struct", "enum", "dataclasses", "inspect", "ast", "tokenize",
    "keyword", "argparse", "logging", "configparser", "sqlite3", "queue", "sched", "shutil",
    "tempfile", "filecmp", "locale", "gettext", "codecs", "unicodedata", "colorsys", "graphlib",
    "contextlib", "abc", "numbers", "cmath", "weakref", "types", "reprlib", "wave", "quopri",
    "mimetypes", "http.cookies", "xml.dom.minidom", "xml.etree.ElementTree", "plistlib", "netrc",
    "optparse", "getopt", "timeit", "trace", "tracemalloc", "zoneinfo", "selectors", "ssl",
)  # fmt: skip

NAMES = (
    "Ana", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
    "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf",
)  # fmt: skip
ITEMS = (
    ("apple", "apples"), ("notebook", "notebooks"), ("ticket", "tickets"), ("plant", "plants"),
    ("sticker", "stickers"), ("muffin", "muffins"), ("marble", "marbles"), ("candle", "candles"),
    ("shirt", "shirts"), ("bottle of juice", "bottles of juice"), ("pencil", "pencils"),
    ("toy car", "toy cars"), ("jar of honey", "jars of honey"), ("bag of rice", "bags of rice"),
)  # fmt: skip
TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "compound interest", "the immune system",
    "the French Revolution", "the Roman Empire", "plate tectonics", "climate change", "volcanoes",
    "machine learning", "quantum computing", "blockchains", "the internet", "electric cars",
    "solar power", "wind turbines", "recycling", "composting", "sourdough bread", "coffee brewing",
    "learning a new language", "public speaking", "time management", "remote work", "job interviews",
    "personal budgeting", "the stock market", "inflation", "supply and demand", "meditation",
    "sleep hygiene", "marathon training", "healthy breakfasts", "houseplants", "beekeeping",
    "bird migration", "coral reefs", "rainforests", "deserts", "the Moon landing", "Mars rovers",
    "the periodic table", "DNA", "vaccines", "antibiotics", "the human heart", "memory and learning",
    "chess openings", "jazz", "impressionist painting", "the printing press", "the steam engine",
    "ancient Egypt", "the Silk Road", "the Renaissance", "democracy", "human rights",
    "urban gardening", "tiny houses", "public transport", "bicycles in cities", "video game design",
    "open-source software", "password security", "email etiquette", "writing a resume",
    "starting a small business", "customer service", "team meetings", "giving feedback",
    "negotiation", "critical thinking", "the scientific method", "statistics in daily life",
    "probability", "prime numbers", "fractals", "the Fibonacci sequence", "cryptography",
    "databases", "cloud computing", "version control", "unit testing", "code reviews",
    "recursion", "sorting algorithms", "hash tables", "the history of computers", "robots",
    "self-driving cars", "3D printing", "the ocean tides", "earthquakes", "hurricanes",
    "snowflakes", "rainbows", "the seasons", "sunsets", "camping", "hiking safety", "first aid",
    "cooking pasta", "baking cookies", "fermentation", "tea ceremonies", "board games",
    "photography", "film editing", "podcasting", "journaling", "minimalism", "volunteering",
    "friendship", "moving to a new city", "adopting a dog", "caring for cats", "aquariums",
    "dinosaurs", "fossils", "glaciers", "the Northern Lights", "space telescopes",
)  # fmt: skip
CHAT_TASKS = (
    "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.",
    "Give me five practical tips about {t}.",
    "What are the main pros and cons of {t}?",
    "Write a persuasive paragraph about why people should care about {t}.",
    "Summarize what someone should know about {t} in a few sentences.",
    "Write a friendly email inviting a colleague to a lunch talk on {t}.",
    "Create a three-question multiple-choice quiz about {t}, with answers.",
    "Compare {t} and {u}: what do they have in common and how do they differ?",
    "Write a short story in which {t} plays an important role.",
    "What are some common misconceptions about {t}?",
    "Draft an outline for a blog post about {t}.",
    "Describe {t} in one paragraph, then list three key facts.",
    "I am giving a five-minute presentation on {t}. Suggest a structure and an opening line.",
    "Write a dialogue between a curious student and a teacher about {t}.",
    "What questions would you ask an expert on {t}? List six.",
    "Explain {t} using an analogy from everyday life.",
    "Write a product description for a fictional app that helps people with {t}.",
    "What would change in the world if nobody knew anything about {t}?",
    "Write a tweet-length fun fact about {t}, then a longer explanation of it.",
    "Give a step-by-step beginner's plan for learning about {t} in one month.",
    "Write a haiku about {t} and explain the imagery.",
    "Tell me the story of how people first came to understand {t}, as you would tell it to a friend.",
    "Write a short, polite reply declining an invitation to a workshop on {t}.",
)
CODE_TASKS = (
    "Write a Python function `{name}{sig}` that {doc}",
    "In Python, how do I use `{qual}`? Explain what it does and show a short example.",
    "Implement `{name}{sig}` in Python without importing `{module}`. It should: {doc}",
    "What does `{qual}` return, and when would you use it instead of writing the code yourself?",
    "Write pytest unit tests for `{qual}`, covering normal use and edge cases.",
)
SOURCE_TASKS = (
    "Explain this Python code step by step:\n\n```python\n{src}\n```",
    "Write pytest unit tests for this function:\n\n```python\n{src}\n```",
    "Review this Python function: point out anything unclear or fragile and suggest improvements.\n\n"
    "```python\n{src}\n```",
    "Add type hints and a clear docstring to this function, keeping its behaviour:\n\n```python\n{src}\n```",
    "Rewrite this function in JavaScript with the same behaviour:\n\n```python\n{src}\n```",
    "What is the time complexity of this function? Explain briefly.\n\n```python\n{src}\n```",
)
MATH_SUFFIXES = (
    "",
    " Show your reasoning step by step.",
    " Explain briefly.",
    " Give the final answer at the end.",
)


def normalize(text: str) -> str:
    """Lowercased words only: what the copy checks compare."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def text_hash(text: str) -> str:
    return hashlib.sha256(normalize(text).encode()).hexdigest()


def shingle_hashes(text: str, n: int = SHINGLE_WORDS) -> set[int]:
    """Hashes of every run of n words (a text shorter than n words: the whole text)."""
    words = normalize(text).split()
    runs = [words] if len(words) < n else [words[i : i + n] for i in range(len(words) - n + 1)]
    return {
        int.from_bytes(hashlib.blake2b(" ".join(r).encode(), digest_size=8).digest(), "big") for r in runs
    }


class HeldOut:
    """The prompts training must not see: their hashes and their word-run hashes."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.hashes: set[str] = set()
        self.shingles: set[int] = set()
        for t in texts:
            self.hashes.add(text_hash(t))
            self.shingles |= shingle_hashes(t)

    def copies(self, text: str) -> bool:
        """Whether `text` equals a held-out prompt or shares a run of words with one."""
        return text_hash(text) in self.hashes or not self.shingles.isdisjoint(shingle_hashes(text))


def read_turns(path: Path) -> list[str]:
    """Every user turn of a {"turns": [...]} JSONL file (gzipped or not)."""
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    out: list[str] = []
    for line in text.split("\n"):  # not splitlines: a prompt may hold U+2028
        if line.strip():
            out += [t for t in json.loads(line)["turns"] if isinstance(t, str)]
    return out


# -- math -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Draw:
    """What one exercise draws: a person, an item and three small numbers."""

    name: str
    pron: str
    one: str
    many: str
    a: int
    b: int
    c: int

    @classmethod
    def of(cls, rng: random.Random) -> _Draw:
        one, many = rng.choice(ITEMS)
        pron = rng.choice(("she", "he", "they"))
        return cls(
            rng.choice(NAMES), pron, one, many, rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 12)
        )


def _change(r: random.Random, d: _Draw) -> str:
    price, bill = r.randint(1, 9), r.choice((50, 100))
    return (
        f"{d.name} buys {d.c} {d.many} at ${price} each and pays with a ${bill} bill. "
        f"How much change does {d.pron} get?"
    )


def _train(r: random.Random, d: _Draw) -> str:
    h1, h2 = r.randint(2, 6), r.randint(2, 9)
    km = d.a * 10 * h1
    return f"A train covers {km} km in {h1} hours. At the same speed, how far does it go in {h2} hours?"


def _linear(r: random.Random, d: _Draw) -> str:
    x = r.randint(-12, 15)
    return f"Solve for x: {d.a}x + {d.b} = {d.a * x + d.b}."


def _sum_difference(r: random.Random, d: _Draw) -> str:
    x, y = r.randint(10, 90), r.randint(1, 9)
    return f"The sum of two numbers is {x + y} and their difference is {x - y}. What are the two numbers?"


def _rectangle(r: random.Random, d: _Draw) -> str:
    w, length = r.randint(2, 20), r.randint(21, 40)
    return (
        f"A rectangle has a perimeter of {2 * (w + length)} cm and a length of {length} cm. What is its area?"
    )


def _pages(r: random.Random, d: _Draw) -> str:
    return (
        f"{d.name} reads {d.a} pages on Monday, twice as many on Tuesday, and {min(d.b, 2 * d.a - 1)} fewer "
        f"than on Tuesday on Wednesday. How many pages does {d.pron} read in the three days?"
    )


def _discount(r: random.Random, d: _Draw) -> str:
    off, tax = r.choice((10, 20, 25, 30)), r.choice((5, 8, 10))
    return (
        f"A jacket costs ${r.randint(4, 30) * 10}. The shop takes {off}% off and then adds {tax}% sales tax. "
        f"What is the final price?"
    )


def _workers(r: random.Random, d: _Draw) -> str:
    w = r.randint(2, 12)
    hours = w * r.randint(2, 6)
    return (
        f"{w} workers paint a fence in {hours} hours. How long would {w * 2} workers take at the same rate?"
    )


def _system(r: random.Random, d: _Draw) -> str:
    x, y, p, q = r.randint(-6, 9), r.randint(-6, 9), r.randint(1, 7), r.randint(1, 7)
    return (
        f"Solve the system of equations: {d.a}x + {d.b}y = {d.a * x + d.b * y} and "
        f"{p}x - {q}y = {p * x - q * y}."
    )


def _average(r: random.Random, d: _Draw) -> str:
    k, m = r.randint(4, 10), r.randint(10, 60)
    return (
        f"The average of {k} numbers is {m}. When one of them, {r.randint(1, 2 * m)}, is removed, "
        f"what is the average of the rest?"
    )


def _recipe(r: random.Random, d: _Draw) -> str:
    more = d.c * 6 * r.randint(2, 5) // 2
    return f"A recipe uses {d.c} cups of flour for {d.c * 6} {d.many}. How many cups do {more} {d.many} need?"


def _choose(r: random.Random, d: _Draw) -> str:
    n = r.randint(5, 14)
    return f"In how many ways can {r.randint(2, n - 1)} {d.many} be chosen from {n} different {d.many}?"


def _gcd(r: random.Random, d: _Draw) -> str:
    g = r.randint(2, 15)
    return f"Find the greatest common divisor of {g * d.a} and {g * d.b}."


def _fraction(r: random.Random, d: _Draw) -> str:
    g = r.randint(2, 12)
    return f"Simplify the fraction {g * d.a}/{g * d.b}."


def _power_mod(r: random.Random, d: _Draw) -> str:
    base, exp, m = r.randint(2, 9), r.randint(5, 40), r.randint(3, 13)
    return f"What is the remainder when {base}^{exp} is divided by {m}?"


def _dice(r: random.Random, d: _Draw) -> str:
    return (
        f"Two fair six-sided dice are rolled. What is the probability that their sum is {r.randint(2, 12)}?"
    )


MATH_TEMPLATES: tuple[Callable[[random.Random, _Draw], str], ...] = (
    _change, _train, _linear, _sum_difference, _rectangle, _pages, _discount, _workers, _system,
    _average, _recipe, _choose, _gcd, _fraction, _power_mod, _dice,
    lambda r, d: f"What is {r.choice((5, 10, 15, 20, 25, 30, 40, 75))}% of {r.randint(2, 90) * 20}?",
    lambda r, d: f"How many positive divisors does {r.randint(12, 400)} have?",
    lambda r, d: f"Find the sum 1 + 2 + 3 + ... + {r.randint(10, 500)}.",
    lambda r, d: f"If f(x) = {d.c}x^2 - {d.b}x + {d.a}, what is f({r.randint(-5, 9)})?",
    lambda r, d: f"Convert {r.randint(20, 999)} from base 10 to base {r.choice((2, 3, 5, 8, 16))}.",
    lambda r, d: f"What is the least common multiple of {d.a}, {d.b} and {d.c}?",
)  # fmt: skip
"""Exercises whose numbers are drawn so the answer is a clean one."""


def math_prompts(rng: random.Random) -> Iterator[str]:
    while True:
        yield rng.choice(MATH_TEMPLATES)(rng, _Draw.of(rng)) + rng.choice(MATH_SUFFIXES)


# -- code -------------------------------------------------------------------------------------
def _first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split())
    end = text.find(". ")
    sentence = text if end < 0 else text[: end + 1]
    return sentence if sentence.endswith(".") else sentence + "."


def stdlib_functions() -> list[tuple[str, str, str, str, str]]:
    """(module, name, signature, first docstring sentence, source or "") of the public functions
    of `STDLIB_MODULES` that have a docstring, in a fixed order."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in STDLIB_MODULES:
            try:
                mod = importlib.import_module(modname)
            except ImportError:
                continue
            for name, fn in sorted(vars(mod).items()):
                if (
                    name.startswith("_")
                    or not callable(fn)
                    or getattr(fn, "__module__", None) != mod.__name__
                ):
                    continue
                doc = inspect.getdoc(fn)
                if not doc or len(doc) < 20:
                    continue
                try:
                    sig = str(inspect.signature(fn))
                except (TypeError, ValueError):
                    sig = "(...)"
                try:
                    src = inspect.getsource(fn) if inspect.isfunction(fn) else ""
                except (OSError, TypeError):
                    src = ""
                lines = src.strip().splitlines()
                out.append(
                    (modname, name, sig, _first_sentence(doc), src.strip() if 3 <= len(lines) <= 40 else "")
                )
    return out


def code_prompts(rng: random.Random) -> Iterator[str]:
    funcs = stdlib_functions()
    while True:
        module, name, sig, doc, src = rng.choice(funcs)
        if src and rng.random() < 0.45:
            yield rng.choice(SOURCE_TASKS).format(src=src)
        else:
            doc_lc = doc[0].lower() + doc[1:]
            yield rng.choice(CODE_TASKS).format(
                name=name, sig=sig, doc=doc_lc, qual=f"{module}.{name}", module=module
            )


# -- chat -------------------------------------------------------------------------------------
def chat_prompts(rng: random.Random) -> Iterator[str]:
    while True:
        t, u = rng.sample(TOPICS, 2)
        yield rng.choice(CHAT_TASKS).format(t=t, u=u)


# -- JSON ----------------------------------------------------------------------------------------
CITIES = (
    "Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Hanoi", "Accra", "Denver", "Porto",
    "Seoul", "Cairo", "Dublin", "Quito", "Perth", "Riga", "Tunis", "Austin", "Kyoto", "Bergen",
)  # fmt: skip
JSON_TASKS = (
    'Describe {t} as a JSON object with the keys "title" (a string), "summary" (one sentence) and '
    '"key_points" (an array of three strings). Reply with the JSON only.',
    'Return a JSON array of three quiz questions about {t}; each item has "question", "options" (four '
    'strings) and "answer" (the index of the right option).',
    'Write a JSON object for a fictional book about {t} with "title", "author", "year" (a number), '
    '"genres" (an array of strings) and "rating" (a number from 1 to 5).',
    'Give a lesson plan about {t} as JSON: {{"topic": ..., "duration_minutes": ..., "steps": [{{"name": '
    '..., "minutes": ...}}]}}. Output valid JSON only.',
    'Extract the facts of this sentence as JSON with the keys "who", "what", "where" and "when": '
    '"{name} gave a talk on {t} in {city} last {day}."',
    "You can call the function search_articles(query: string, max_results: integer). Write the call "
    'that finds five articles about {t}, as a JSON object {{"name": ..., "arguments": {{...}}}}.',
    'You can call get_weather(city: string, unit: "celsius" or "fahrenheit"). {name} asks: "Will I need '
    'an umbrella in {city} tomorrow?" Answer with the function call as JSON: {{"name": ..., "arguments": '
    "{{...}}}}.",
    'Create a JSON object describing an event about {t} in {city}: "name", "date" (YYYY-MM-DD), '
    '"speakers" (an array of names) and "free" (true or false).',
    'List three tasks for a project on {t} as a JSON array of objects with "id" (a number), "task" '
    'and "done" (a boolean).',
    'Convert this to JSON with the keys "name", "city" and "interests" (an array): {name} lives in '
    "{city} and likes {t} and {u}.",
)
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def json_prompts(rng: random.Random) -> Iterator[str]:
    """Structured-output and tool-call tasks: what constrained requests ask the target for."""
    while True:
        t, u = rng.sample(TOPICS, 2)
        yield rng.choice(JSON_TASKS).format(
            t=t, u=u, name=rng.choice(NAMES), city=rng.choice(CITIES), day=rng.choice(DAYS)
        )


SOURCES: dict[str, Callable[[random.Random], Iterator[str]]] = {
    "code": code_prompts,
    "math": math_prompts,
    "chat": chat_prompts,
    "json": json_prompts,
}


def make_prompts(counts: dict[str, int], held_out: HeldOut, seed: int = 0) -> list[dict[str, object]]:
    """`counts[domain]` distinct prompts of each source that copy nothing held out, in a seeded
    order: [{"turns": [prompt], "domain": domain}, ...]. A source that runs out of new prompts
    (after 50 draws in a row that add nothing) gives what it has."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, object]] = []
    for domain, count in counts.items():
        source, got, misses = SOURCES[domain](random.Random(rng.random())), 0, 0
        while got < count and misses < 50:
            p = next(source)
            h = text_hash(p)
            if h in seen or held_out.copies(p):
                misses += 1
                continue
            seen.add(h)
            out.append({"turns": [p], "domain": domain})
            got, misses = got + 1, 0
    rng.shuffle(out)
    return out


def write_prompts(rows: list[dict[str, object]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime 0 in the gzip header: the same rows give the same bytes
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for r in rows:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
