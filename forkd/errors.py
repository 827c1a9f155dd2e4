"""The root error of forkd and the families below it.

Every error carries a message that says what was wrong and what to do about it.
The CLI maps these classes to exit codes; nothing else should catch broad
exceptions.
"""


class ForkdError(Exception):
    """Root of every error forkd raises on purpose."""

    exit_code = 1


class InvalidInput(ForkdError):
    """A name, tag, file or argument supplied by the user or a peer is unacceptable."""

    exit_code = 2


class NotFound(ForkdError):
    """A tag, blob or manifest that was asked for does not exist."""

    exit_code = 3


class IntegrityError(ForkdError):
    """Stored or received bytes do not match their digest, size or declared structure."""

    exit_code = 4


class ChainError(ForkdError):
    """A chain of layers is broken: missing parent, cycle, or deeper than the cap."""

    exit_code = 5


class Conflict(ForkdError):
    """The operation would break something that depends on its target (e.g. rmi of a parent)."""

    exit_code = 6
