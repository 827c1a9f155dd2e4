"""Names, validated before any use: the one set of validators for untrusted names.

Grammar (the OCI Distribution spec's): a repository name is one or more
path components ``[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*`` joined by ``/``, at most
255 characters; a tag is ``[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}``. A local
reference is ``NAME[:TAG]`` with ``latest`` as the default tag. The hub's
namespaces (users and organisations) are one name component; user and team
names are 1-64 of ``[a-z0-9_-]``, starting and ending with a letter or digit.

Every pattern matches the WHOLE text, ASCII only: the patterns are anchored with
``\\A``/``\\Z`` (``$`` would accept a trailing newline) and ``matches`` also
refuses any non-ASCII text (look-alike letters, zero-width or line-separator
characters). ``..``, absolute paths, NUL bytes, whitespace, upper case names and
over-long input are refused before they reach a file system path, a header or a
database.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from forkd.errors import InvalidInput

# A fragment for composing patterns; the compiled patterns below are anchored.
NAME_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_ACCOUNT = r"[a-z0-9](?:[a-z0-9_-]{0,62}[a-z0-9])?"


def whole(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled to match a whole ASCII text (``match`` behaves as ``fullmatch``)."""
    return re.compile(rf"\A(?:{pattern})\Z", re.ASCII)


NAME_RE = whole(rf"{NAME_COMPONENT}(?:/{NAME_COMPONENT})*")
NAMESPACE_RE = whole(NAME_COMPONENT)
TAG_RE = whole(r"[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}")
USER_RE = whole(_ACCOUNT)
TEAM_RE = whole(_ACCOUNT)
# A robot made for a namespace is named ``NAMESPACE+NAME``: ``+`` is in no user, namespace
# or team name, so robots an organisation's admins make never take a name a person or a
# namespace could have (the hub's shared pool of names: hub/accounts.py ``claim_name``).
ROBOT_SEPARATOR = "+"
ROBOT_RE = whole(rf"({NAME_COMPONENT})\+({_ACCOUNT})")
# Any account's name as stored: a person's (or an operator's robot's), or such a robot's.
ACCOUNT_RE = whole(rf"(?:{NAME_COMPONENT}\+)?{_ACCOUNT}")
ACCOUNT_MAX = 64  # users.name
MAX_NAME = 255
DEFAULT_TAG = "latest"


def matches(pattern: re.Pattern[str], text: object) -> bool:
    """True when ``text`` is an ASCII string that ``pattern`` matches from start to end."""
    return isinstance(text, str) and text.isascii() and pattern.fullmatch(text) is not None


SHOWN_CHARS = 80  # characters of an untrusted value quoted in a message


def cut_note(kept: int, total: int) -> str:
    """What a cut text says of itself: how much of it is kept. The one format of every
    cut untrusted text (an error's quoted value, an audit record's target)."""
    return f"(its first {kept} of {total} characters)"


def shown(text: object, chars: int = SHOWN_CHARS) -> str:
    """An untrusted value, quoted for an error message, shortened to ``chars`` characters
    and then saying so: a cut value quoted as if whole (an id of 300 characters shown as
    its first 80) would send its reader after a value nobody sent."""
    value = str(text)
    if len(value) <= chars:
        return repr(value)
    return f"{value[:chars]!r} {cut_note(chars, len(value))}"


def clipped(text: str, chars: int = SHOWN_CHARS) -> str:
    """``text`` unquoted (a field's name in a message), cut as ``shown`` cuts and saying so."""
    if len(text) <= chars:
        return text
    return f"{text[:chars]}… {cut_note(chars, len(text))}"


def shortened(text: str, chars: int) -> str:
    """``text`` cut as ``clipped`` cuts, but at most ``chars`` characters in all, saying
    included: a record of what a caller chose (an audit target) keeps a hard bound, and
    its reader still sees that it was cut and how long it was."""
    if len(text) <= chars:
        return text
    keep = max(chars - len(f"… {cut_note(chars, len(text))}"), 0)
    return f"{text[:keep]}… {cut_note(keep, len(text))}"


def validate_name(name: str) -> str:
    if not matches(NAME_RE, name) or len(name) > MAX_NAME:
        raise InvalidInput(
            f"invalid repository name {shown(name)}: use lowercase letters, digits and "
            "'.', '_', '-' separators, components joined by '/', at most 255 characters"
        )
    return name


def validate_tag(tag: str) -> str:
    if not matches(TAG_RE, tag):
        raise InvalidInput(
            f"invalid tag {shown(tag)}: use letters, digits, '_', '.', '-' "
            "(not starting with '.' or '-'), at most 128 characters"
        )
    return tag


def validate_namespace(name: str) -> str:
    if not matches(NAMESPACE_RE, name) or len(name) > MAX_NAME:
        raise InvalidInput(
            f"invalid namespace {shown(name)}: one repository-name component "
            "(lowercase letters, digits, '.', '_', '-')"
        )
    return name


def validate_username(name: str) -> str:
    if not matches(USER_RE, name) or "__" in name:
        raise InvalidInput(
            f"invalid user name {shown(name)}: use 1-64 lowercase letters, digits, '-' or "
            "'_' (not '__'), starting and ending with a letter or digit"
        )
    return name


def is_account_name(name: object) -> bool:
    """Whether ``name`` is a name an account (a person or a robot) may have: for lookups of
    names a client sends (a sign-in, a member to add), before any database read."""
    return (
        matches(ACCOUNT_RE, name)
        and isinstance(name, str)
        and len(name) <= ACCOUNT_MAX
        and "__" not in name.rpartition(ROBOT_SEPARATOR)[2]
    )


def validate_account(name: str) -> str:
    """InvalidInput unless ``name`` is a name an account may have (``is_account_name``)."""
    if not is_account_name(name):
        raise InvalidInput(
            f"invalid account name {shown(name)}: a user's name (1-64 lowercase letters, "
            "digits, '-' or '_') or a robot's (NAMESPACE+NAME, at most 64 characters)"
        )
    return name


def validate_robot(name: str, namespace: str) -> str:
    """InvalidInput unless ``name`` is ``namespace+NAME``, a name a robot made for
    ``namespace`` may take (NAME as a user's name; at most 64 characters in all)."""
    m = ROBOT_RE.match(name)
    if m is None or m.group(1) != namespace or len(name) > ACCOUNT_MAX or "__" in m.group(2):
        room = ACCOUNT_MAX - len(namespace) - 1
        if room < 1:
            raise InvalidInput(
                f"{shown(namespace)} is too long a namespace name to name robots after "
                f"(a robot's name is {shown(namespace)}+NAME, at most {ACCOUNT_MAX} "
                "characters): ask a site admin to make the robot"
            )
        raise InvalidInput(
            f"invalid robot name {shown(name)}: a robot made for {shown(namespace)} is "
            f"named {namespace}+NAME, NAME being 1-{room} lowercase letters, digits, '-' "
            "or '_' (not '__'), starting and ending with a letter or digit"
        )
    return name


def validate_team(name: str) -> str:
    if not matches(TEAM_RE, name):
        raise InvalidInput(
            f"invalid team name {shown(name)}: use 1-64 lowercase letters, digits, '-' or "
            "'_', starting and ending with a letter or digit"
        )
    return name


@dataclass(frozen=True, order=True)
class Ref:
    """A validated local reference ``name:tag``."""

    name: str
    tag: str

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}"


def parse_ref(text: str) -> Ref:
    """Parse ``NAME[:TAG]``; the tag defaults to ``latest``."""
    if not isinstance(text, str) or "\x00" in text or len(text) > MAX_NAME + 129:
        raise InvalidInput(f"invalid reference {shown(text)}: too long or contains NUL")
    name, sep, tag = text.rpartition(":")
    if not sep or "/" in tag:
        name, tag = text, DEFAULT_TAG
    return Ref(validate_name(name), validate_tag(tag))


MAX_SHOWN = 4000  # characters of untrusted text an inert() message keeps by default
# What a terminal obeys or reorders: C0 controls but newline and tab (ESC starts every
# CSI/OSC/DCS sequence, CR rewrites a line), DEL, C1 controls (U+009B is a one-character
# CSI, U+009D an OSC), the bidi marks, embeddings, overrides and isolates, the line and
# paragraph separators, and lone surrogates (which a UTF-8 terminal write cannot encode).
_CONTROL_CHARS = (
    "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
    "\u2066-\u2069\ud800-\udfff"
)
_CONTROL = re.compile(f"[{_CONTROL_CHARS}]")


# ``_CONTROL`` and newline and tab too: what a text shown as one line (a token's name in a
# listing, a pack's description) must not hold.
_NOT_IN_A_LINE = re.compile(f"[\\t\\n{_CONTROL_CHARS}]")


def validate_line(text: str, what: str) -> str:
    """``text`` a client stores for others to read as one line (an API token's name, a
    pack's description): InvalidInput when it holds a character a terminal or a reader
    acts on (``_CONTROL``: ESC of a CSI/OSC sequence, CR, a bidi override) or a line
    break or tab (a forged line in a listing such as ``forkd hub token list``). Printable
    text of any script passes."""
    found = _NOT_IN_A_LINE.search(text)
    if found is not None:
        raise InvalidInput(
            f"{what} may not contain control, line-break or bidi characters "
            f"(found {_escaped(found)} at {found.start()}): use printable text on one line"
        )
    return text


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def inert(text: object, limit: int = MAX_SHOWN) -> str:
    """Untrusted text (a guest's error, console, file name or output) made safe to put in a
    message, a log line or a terminal: every character a terminal would act on is shown
    as its escape (``\\x1b``, ``\\u202e``), so an ESC/CSI/OSC sequence, a carriage return or
    a bidi override is visible text, not an instruction; newlines and tabs stay. Over
    ``limit`` characters its middle is cut (the start and the end are what explain a
    failure). Applying it again changes nothing."""
    return _cut(_CONTROL.sub(_escaped, str(text).replace("\r\n", "\n")), limit)


def one_line(text: object, limit: int = SHOWN_CHARS * 2) -> str:
    """Untrusted text shown as one line or one cell of a listing (a sandbox's snapshot in
    ``forkd ls``, a token's name): ``inert``, and a line break or tab shown as its escape
    too, so it cannot start a forged line or shift the columns. Cut in its middle past
    ``limit`` characters, saying so."""
    # every line break is an escape by now: the only ones left are the cut's own note's
    return _cut(_NOT_IN_A_LINE.sub(_escaped, str(text)), limit).replace("\n", " ")


class InertStream:
    """``inert`` for a text that arrives in pieces (a command's output, streamed), with no
    cut: a CR that ends a piece is held until the next piece says whether an LF follows
    (CRLF is a line's end; a lone CR, which would send the cursor back over a line, is
    shown as its escape). ``end`` gives what is still held once the stream ended."""

    def __init__(self) -> None:
        self._cr = False

    def feed(self, text: str) -> str:
        if self._cr:
            text, self._cr = "\r" + text, False
        if text.endswith("\r"):
            text, self._cr = text[:-1], True
        return _CONTROL.sub(_escaped, text.replace("\r\n", "\n"))

    def end(self) -> str:
        held, self._cr = self._cr, False
        return "\\x0d" if held else ""


def _cut(shown_text: str, limit: int) -> str:
    """``shown_text`` with its middle cut past ``limit`` characters, saying how much."""
    if len(shown_text) <= limit:
        return shown_text
    room = max(0, limit - len(_CUT.format(len(shown_text))))  # the result fits in limit
    head = room // 2
    cut = _CUT.format(len(shown_text) - room)
    return shown_text[:head] + cut + shown_text[len(shown_text) - (room - head) :]


_CUT = "\n[... {} characters cut ...]\n"
