"""The `forkd` command line."""
