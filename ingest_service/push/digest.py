"""A push batch's identity (:class:`BatchDigest`): what tells a resent batch from a
different one under the same seq (re-exported by :mod:`ingest_service.push.body`)."""

from __future__ import annotations

import hashlib

__all__ = ["BatchDigest"]


class BatchDigest:
    """A batch's identity: blake2b of its entries' fields, each length-prefixed, so the
    same records give the same digest whatever the body's encoding, and two batches
    that differ anywhere (a record, the order, the count) give different ones."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)

    def add(self, fields: dict[bytes, bytes]) -> None:
        h = self._h
        for k, v in fields.items():
            h.update(b"%d:%b%d:" % (len(k), k, len(v)))
            h.update(v)
        h.update(b";")

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    @classmethod
    def of(cls, records: list[dict[bytes, bytes]]) -> str:
        digest = cls()
        for fields in records:
            digest.add(fields)
        return digest.hexdigest()
