"""Byte sizes for people: one formatter for the CLI and the catalog."""

from __future__ import annotations


def human_bytes(n: int | float | None, missing: str = "-") -> str:
    """``1536`` → ``1.5 KiB``; ``None`` → ``missing``."""
    if n is None:
        return missing
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
