"""Recipes shipped with forkd (TOML files, see docs/recipes.md)."""
