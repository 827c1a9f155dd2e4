"""The pack format: OCI artifacts describing diff-snapshot layers (see docs/pack-format.md)."""
