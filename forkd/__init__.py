"""forkd: fork copy-on-write microVMs from warm snapshots; share snapshots as packs.

The package root holds the core shared by the hub and the engine: digests,
names, the pack format (``forkd.pack``) and the local content-addressed store
(``forkd.store``).
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``from forkd import Sandbox, Controller`` without importing the engine for every command."""
    if name in ("Sandbox", "Controller", "CommandResult", "EvalError"):
        from forkd.controller import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'forkd' has no attribute {name!r}")
