"""An adapter's name: how it may be written, and which names it may not look like. Requests
pick an adapter by `model`, so a name that reads as the served model's (another case, a
Cyrillic "о" for the Latin "o") would route one team member's requests for the base to
someone's adapter; names are compared after case folding, NFKC and Unicode's confusables
(the `confusables` package's reading of UTS #39)."""
from __future__ import annotations

import unicodedata
from collections.abc import Iterable

from confusables import is_confusable

from pagedllm.errors import AdapterError

MAX_NAME_CHARS = 128


def check_name(name: str) -> None:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        raise AdapterError(f"an adapter's name must be 1-{MAX_NAME_CHARS} characters, got "
                           f"{name!r}")
    if any(c.isspace() or not c.isprintable() for c in name):
        raise AdapterError(f"an adapter's name may not hold spaces or control characters, got "
                           f"{name!r}")


def look_alike(name: str, others: Iterable[str]) -> str | None:
    """The first of `others` that `name` reads as (itself included), or None."""
    folded = _folded(name)
    for other in others:
        if folded == _folded(other) or is_confusable(name, other):
            return other
    return None


def _folded(name: str) -> str:
    return unicodedata.normalize("NFKC", name).casefold()
