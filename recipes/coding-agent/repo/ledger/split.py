"""Split an amount of money, in cents, into shares."""


def split(total_cents: int, parts: int) -> list[int]:
    """Shares of ``total_cents`` for ``parts`` people: they sum to the total and differ
    by at most one cent. ``parts`` must be positive (ValueError otherwise)."""
    share = total_cents // parts
    return [share] * parts
