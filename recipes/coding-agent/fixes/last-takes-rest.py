"""Split an amount of money, in cents, into shares."""


def split(total_cents: int, parts: int) -> list[int]:
    """Shares of ``total_cents`` for ``parts`` people: they sum to the total and differ
    by at most one cent. ``parts`` must be positive (ValueError otherwise)."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    share, rest = divmod(total_cents, parts)
    return [share] * (parts - 1) + [share + rest]
