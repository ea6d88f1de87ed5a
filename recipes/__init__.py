"""Runnable recipes, their YAML configs and the `multiengine` CLI."""
