"""Lazy fork: children of a snapshot whose memory and disk arrive on first access.

``chunks`` (the chain's chunks, local or from the hub, verified), ``layout`` (an image's
pages → chunk pieces, from the flattened maps), ``memfs`` (the memory image as a FUSE
file), ``prefetch`` (the rest of the chain in recorded access order), ``fork`` (the
``forkd fork --lazy`` path). docs/engine.md, "Lazy fork".
"""
