"""The store roots the admin API and CLI serve: a name (used in URLs and on the
command line) for a checkpoint store URL, optionally with a remote tier
(``name=file:///ckpt/run|s3://bucket/run``) and the job's tier servers, parsed once
from the service's settings and refused whole when one is not valid."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ingest_service.service.tier_places import TierServers, with_servers
from trainguard.core import lists
from trainguard.core.urls import has_password, redact_url

__all__ = ["StoreRoot", "parse_store_roots"]


@dataclass(frozen=True)
class StoreRoot:
    name: str
    url: str
    remote_url: str | None = None
    storage_options: Mapping[str, Any] | None = None
    tier_servers: TierServers | None = None  # where its RAM and partner copies are

    def describe(self, *, full: bool = True) -> dict[str, Any]:
        """Name and tiers; the URLs (credentials redacted) only when ``full``."""
        if not full:
            return {"name": self.name, "url": None, "remote_url": None,
                    "tiered": self.remote_url is not None}
        return {"name": self.name, "url": redact_url(self.url),
                "remote_url": redact_url(self.remote_url), "tiered": self.remote_url is not None}


def parse_store_roots(text: str, tier_servers: str = "") -> dict[str, StoreRoot]:
    """``"a=file:///x,b=file:///y|s3://bkt/y"`` -> store roots by name; ``tier_servers``
    (:func:`~ingest_service.service.tier_places.parse_tier_servers`) by store name."""
    roots: dict[str, StoreRoot] = {}
    expected = "name=url or name=local_url|remote_url"
    for name, urls in lists.pairs(text, what="checkpoint store", expected=expected,
                                  shown=lambda item: str(redact_url(item))).items():
        local, _, remote = urls.partition("|")
        if not local.strip():
            raise ValueError(f"checkpoint store {redact_url(f'{name}={urls}')!r} is not valid: "
                             f"expected {expected}, comma-separated")
        for url in filter(None, (local.strip(), remote.strip())):
            # A store's URL is shown to operators and quoted in backend errors (botocore
            # names the bucket "KEY:SECRET@bucket"): credentials never belong in it.
            if has_password(url):
                raise ValueError(
                    f"checkpoint store {name!r}: its URL {redact_url(url)!r} carries "
                    "user:password@, which would be shown in errors and logs; give the "
                    "credentials to the backend instead (AWS_ACCESS_KEY_ID/"
                    "AWS_SECRET_ACCESS_KEY or a profile for s3://) and drop them from the URL"
                )
        roots[name] = StoreRoot(name, local.strip(), remote.strip() or None)
    return with_servers(roots, tier_servers)
