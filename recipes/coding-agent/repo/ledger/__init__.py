"""ledger: split a bill into fair shares (the coding-agent recipe's sample project)."""

from ledger.split import split

__all__ = ["split"]
