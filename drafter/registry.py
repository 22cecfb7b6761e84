"""The drafter registry: every drafter by name, built on demand.

The built-in drafters are listed here by module and factory; a module is imported only when
one of its drafters is built. Reading the names (the CLI, `DrafterConfig`) therefore never
imports torch, and the implementations import `drafter.base` without a cycle. Code outside
the package (a benchmark's drafter) adds its own with `register_drafter`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark_serve.drafter.base import Drafter

DrafterFactory = Callable[..., "Drafter"]


@dataclass(frozen=True)
class DrafterSpec:
    """One registered drafter.

    name: the registry name (`--drafter`, `DrafterConfig.drafter`).
    summary: one line for the CLI help.
    uses_checkpoint: True when it is built from a DeepSpec checkpoint directory (`path`).
    factory: "module:function" for a built-in (imported when first built), or the factory.
    """

    name: str
    summary: str
    uses_checkpoint: bool
    factory: str | DrafterFactory

    def load(self) -> DrafterFactory:
        if callable(self.factory):
            return self.factory
        module, _, attr = self.factory.partition(":")
        factory: DrafterFactory = getattr(importlib.import_module(module), attr)
        return factory


_REGISTRY: dict[str, DrafterSpec] = {
    s.name: s
    for s in (
        DrafterSpec(
            "ngram",
            "prompt lookup (continues a repeated n-gram of the context; no weights)",
            False,
            "dspark_serve.drafter.ngram:build_ngram",
        ),
        DrafterSpec(
            "dflash",
            "the DSpark checkpoint without its Markov and confidence heads (the DFlash ablation)",
            True,
            "dspark_serve.drafter.dspark:build_dflash",
        ),
        DrafterSpec(
            "dspark",
            "parallel block drafter with a Markov head and per-position confidences",
            True,
            "dspark_serve.drafter.dspark:build_dspark",
        ),
        DrafterSpec(
            "dspark+ngram",
            "dspark and ngram, chosen per request and step by their recent acceptance",
            True,
            "dspark_serve.drafter.combined:build_dspark_ngram",
        ),
    )
}


def register_drafter(
    name: str, summary: str = "", uses_checkpoint: bool = False
) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register a drafter defined outside this package (the built-ins are listed above)."""

    def deco(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = DrafterSpec(
            name, summary or (factory.__doc__ or name).strip().splitlines()[0], uses_checkpoint, factory
        )
        return factory

    return deco


def drafter_names() -> list[str]:
    return sorted(_REGISTRY)


def drafter_spec(name: str) -> DrafterSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; choose one of {drafter_names()}")
    return _REGISTRY[name]


def build_drafter(name: str, **kwargs: Any) -> Drafter:
    """Build a drafter by registry name (see `drafter_names()`)."""
    return drafter_spec(name).load()(**kwargs)
