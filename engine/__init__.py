"""The host engine: build warm snapshots, fork copy-on-write QEMU microVMs, branch them."""
