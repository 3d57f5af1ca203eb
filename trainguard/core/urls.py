"""Credentials out of every URL trainguard shows: API answers, CLI messages, logs.

``redis://:hunter2@cache:6379/0`` shows as ``redis://:***@cache:6379/0``;
``s3://bucket/run?secret=abc`` as ``s3://bucket/run?secret=***``. :func:`redact_text`
does the same to every URL inside a message (an exception's text often quotes one),
and :class:`RedactingFilter` to every log record a handler emits.
"""

from __future__ import annotations

import logging
import re

__all__ = ["RedactingFilter", "redact_text", "redact_url"]

# scheme://[user[:password]@]host...  -- the userinfo part ends at the last '@' before
# the path; a password may hold anything but '@', '/' and spaces.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/\s]*)(?::[^@/\s]*)?@")
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&](?:[A-Za-z0-9_.-]*(?:password|passwd|secret|token|key|signature|credential)"
    r"[A-Za-z0-9_.-]*)=)[^&#\s]*",
    re.IGNORECASE,
)


def redact_text(text: str) -> str:
    """``text`` with the password of every URL's userinfo, and the value of every
    secret-looking query parameter, replaced by ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m['key']}***", text)


def redact_url(url: str | None) -> str | None:
    return None if url is None else redact_text(url)


class RedactingFilter(logging.Filter):
    """Rewrites each record's message with :func:`redact_text` (installed on the
    service's log handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True
