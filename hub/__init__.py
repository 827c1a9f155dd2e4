"""The hub: an OCI Distribution registry and catalog for snapshot packs."""
