"""Storage URLs as logs, errors and the HTTP API show them: the password never, the rest
as given (`redis://user:***@host:6379/0`)."""

from __future__ import annotations

import re

_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")


def redacted_url(url: str) -> str:
    """`url` with any password in its authority replaced by `***`."""
    return _PASSWORD.sub(r"\1***@", url)
