"""Drafters. Importing the package registers every built-in drafter by name."""
from drafter import dspark, ngram  # noqa: F401  (registration side effects)
from drafter.base import build_drafter, drafter_names, register_drafter

__all__ = ["build_drafter", "drafter_names", "register_drafter"]
