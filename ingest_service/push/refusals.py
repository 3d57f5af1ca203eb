"""The 409 refusals of a push, built from the append script's replies: another batch
under a seq (partly appended, or the last complete one), a seq out of order."""

from __future__ import annotations

from ingest_service.errors import BatchMismatchError, PushOutOfOrderError

__all__ = ["mismatch", "out_of_order", "text"]


def mismatch(seq: int, count: int, digest: str, reply: list[object]) -> BatchMismatchError:
    """The script's reply to another batch under ``seq``: ``[-3, appended, "count:digest"]``
    while the seq's first batch is partly appended, ``[-4, mark, "count:digest"]`` once it
    is complete (``mark`` is then the producer's last complete seq)."""
    status, figure = int(text(reply[0])), int(text(reply[1]))
    their_count, _, their_digest = text(reply[2]).partition(":")
    ours = f"this request's batch is {count} records, digest {digest}: nothing was appended"
    if status == -4:
        return BatchMismatchError(
            f"seq {seq} of this producer is complete with another batch ({their_count} "
            f"records, digest {their_digest}); {ours}. These records are not in the stream: "
            f"send them under the next seq, {figure + 1}",
            appended=int(their_count), count=int(their_count), digest=their_digest)
    return BatchMismatchError(
        f"seq {seq} of this producer is partly appended ({figure} of {their_count} records) "
        f"from another batch (digest {their_digest}); {ours}. Resend the batch first sent "
        f"under seq {seq}, whole, to complete it; send new records under the next seq",
        appended=figure, count=int(their_count), digest=their_digest)


def out_of_order(seq: int, mark: int | None) -> PushOutOfOrderError:
    expected = 0 if mark is None else mark + 1
    return PushOutOfOrderError(
        f"seq {seq} is out of order for this producer: its mark (last batch wholly appended) "
        f"is {mark if mark is not None else 'none'}, so the next batch is seq {expected}; "
        "resend from there (batches at or below the mark are in already)",
        mark,
    )


def text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
