"""`python -m forkd.cli` runs the `forkd` command (used to start background services)."""

from forkd.cli.main import main

main()
