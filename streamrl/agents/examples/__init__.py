"""Environments, tools and tasks of the examples under `examples/` (see docs/agents.md)."""
