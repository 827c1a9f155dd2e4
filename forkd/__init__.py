"""forkd: fork copy-on-write microVMs from warm snapshots; share snapshots as packs.

The package root holds the core shared by the hub and the engine: digests,
names, the pack format (``forkd.pack``) and the local content-addressed store
(``forkd.store``).
"""

__version__ = "0.1.0"
