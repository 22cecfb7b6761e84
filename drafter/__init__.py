"""Drafters behind one interface (drafter.base), picked by name from drafter.registry, which
imports an implementation only when it is built, so importing this package (or drafter.config)
stays light."""
