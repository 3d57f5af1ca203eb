"""The list grammar of settings and options: ``a, b,c`` and ``name=value,name=value``.

One grammar for every comma-separated setting (``$TRAINGUARD_WATCHDOG``, the
checkpoint stores, the GPU probes, a push token's scopes, ``--ids``): items are
stripped and empty items dropped (a trailing comma is no error), a pair splits at its
first ``=``. What a value must look like is the caller's check; this module only says
which item is not a pair, through ``shown`` where an item may carry a secret.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["items", "pairs"]


def items(text: str, sep: str = ",") -> list[str]:
    """``" a, b,,c "`` -> ``["a", "b", "c"]``."""
    return [item for item in (part.strip() for part in text.split(sep)) if item]


def pairs(text: str, *, what: str, expected: str, shown: Callable[[str], str] = str
          ) -> dict[str, str]:
    """``"a=1, b=x=y"`` -> ``{"a": "1", "b": "x=y"}``, names and values stripped; a
    later name replaces an earlier one. An item without ``=`` or without a name raises
    ``ValueError`` naming ``what`` the items are (e.g. ``"probe"``), the item (as
    ``shown`` writes it) and ``expected``, the form the caller wants (e.g.
    ``"node=http://host:port"``)."""
    out: dict[str, str] = {}
    for item in items(text):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{what} {shown(item)!r} is not valid: expected {expected}, "
                             "comma-separated")
        out[name.strip()] = value.strip()
    return out
