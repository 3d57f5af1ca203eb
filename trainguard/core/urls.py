"""Credentials out of every URL trainguard shows: API answers, CLI messages, logs.

This module is the one home of redaction; every part that shows a URL or quotes an
error calls it.

- :func:`redact_url` is for a URL trainguard was configured with (a store root, a
  dataset source, a tokenizer): its userinfo password and *every* query value are
  replaced, ``s3://bucket/run?X-Amz-Credential=abc&v=1`` showing as
  ``s3://bucket/run?X-Amz-Credential=***&v=***``, since a configured URL's parameters
  are presigned or tokened as often as not.
- :func:`redact_text` is for free text (an exception's message quotes URLs, often
  without their scheme: botocore names a bucket ``KEY:SECRET@bucket``): the userinfo
  of every ``user:password@`` found, schemed or not, from ``://`` (or the start of the
  token) to the *last* ``@`` of the authority, so a raw ``@`` inside a password leaks
  nothing; and the value of every secret-looking query parameter (``token``, ``sig``,
  ``auth``, ``jwt``, ``pw``, ...).
- :func:`redact_values` applies them to the strings of a JSON-like value (a dataset's
  options), and :class:`RedactingFilter` to every log record a handler emits.
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["RedactingFilter", "has_password", "redact_text", "redact_url", "redact_values"]

# scheme://user:password@host...: the password runs to the *last* '@' before a '?',
# '#', quote or space (greedy ``[^...]*@`` finds exactly that one), so a raw '@' or '/'
# inside it (AWS secret keys hold '/') leaks nothing. A user name holds no '/', so a
# path with an '@' in it (``s3://bucket/a@b``) is left alone.
_AUTHORITY_CHARS = r"[^?#\s'\"<>]"
_USERINFO = re.compile(
    rf"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/?#\s'\"<>]*)(?::{_AUTHORITY_CHARS}*)?@"
)
# user:password@host with no scheme in front (botocore's bucket names, host lists).
_BARE_USERINFO = re.compile(
    rf"(?<![A-Za-z0-9+.:/-])(?P<user>[A-Za-z0-9._~%!$&*+=-]+):(?!//){_AUTHORITY_CHARS}*@"
    r"(?=[A-Za-z0-9\[])"
)
_SECRET_WORDS = ("password", "passwd", "pass", "pwd", "pw", "secret", "token", "key",
                 "signature", "sig", "credential", "auth", "jwt", "session", "code")
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&;](?:[A-Za-z0-9_.-]*(?:" + "|".join(_SECRET_WORDS) + r")[A-Za-z0-9_.-]*)=)"
    r"[^&#\s'\"]*",
    re.IGNORECASE,
)
_ANY_PARAM = re.compile(r"(?P<key>[?&;][^=&#\s]*=)[^&#\s]*")


def _userinfo(text: str) -> str:
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _BARE_USERINFO.sub(lambda m: f"{m['user']}:***@", text)


def redact_text(text: str) -> str:
    """``text`` with the password of every userinfo (schemed or not) and the value of
    every secret-looking query parameter replaced by ``***``."""
    return _SECRET_PARAM.sub(lambda m: f"{m['key']}***", _userinfo(text))


def redact_url(url: str | None) -> str | None:
    """A configured URL as it may be shown: userinfo password and every query value
    replaced by ``***`` (None stays None)."""
    if url is None:
        return None
    base, sep, rest = url.partition("?")
    query, hash_sep, fragment = rest.partition("#")
    if sep:
        query = _ANY_PARAM.sub(lambda m: f"{m['key']}***", "?" + query)[1:]
    return redact_text(base) + sep + query + hash_sep + ("***" if fragment else "")


def has_password(url: str) -> bool:
    """Whether ``url`` carries a ``user:password@`` (schemed or not)."""
    return _userinfo(url) != url


def redact_values(value: Any) -> Any:
    """The strings of a JSON-like value redacted: a URL (``://``) as a configured URL,
    any other string as free text."""
    if isinstance(value, str):
        return redact_url(value) if "://" in value else redact_text(value)
    if isinstance(value, dict):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_values(v) for v in value]
    return value


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
