"""Alembic environment and versions of the hub database (installed as forkd.migrations)."""
