"""Storage URLs as logs, errors and the HTTP API show them: the password never, the rest
as given (`redis://user:***@host:6379/0`); a Redis Cluster URL's seeds (`cluster_seeds`)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")


def redacted_url(url: str) -> str:
    """`url` with any password in its authority replaced by `***`."""
    return _PASSWORD.sub(r"\1***@", url)


def cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """A cluster URL as redis-py takes it: (the URL of the first seed alone, with the
    scheme's `+cluster` dropped and the user, password, path and query kept; every seed's
    (host, port), port 6379 where none is given). Raises ValueError naming the bad part."""
    parts = urlsplit(url)
    scheme = parts.scheme.removesuffix("+cluster")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for entry in hosts.split(","):
        one = urlsplit(f"//{entry}")
        if not one.hostname:
            raise ValueError(f"seed {entry!r} names no host")
        try:
            port = one.port
        except ValueError as exc:
            raise ValueError(f"seed {entry!r}: {exc}") from None
        seeds.append((one.hostname, 6379 if port is None else port))
    first = hosts.split(",")[0]
    netloc = f"{userinfo}@{first}" if userinfo else first
    single = parts._replace(scheme=scheme, netloc=netloc).geturl()
    return single, seeds
