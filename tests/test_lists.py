"""The list grammar of settings and options has one home (``trainguard.core.lists``):
every comma-separated setting reads the same text the same way."""

from __future__ import annotations

import pytest

from ingest_service.service.admin_checkpoints import StoreRoot, parse_store_roots
from ingest_service.service.auth import PushTokens
from ingest_service.service.gpu_health import parse_probes
from trainer_client.watchdog import WatchdogConfig
from trainguard.core import lists


def test_each_setting_takes_spaces_and_a_trailing_comma_alike() -> None:
    """Items are stripped and an empty item (a trailing comma) is no error, in every
    setting written as a list: the probes, the store roots, the watchdog, a push
    token's scopes, ``--ids``."""
    assert lists.pairs(" a = 1 ,b=x=y,, ", what="item", expected="n=v") == {"a": "1",
                                                                              "b": "x=y"}
    assert parse_probes(" n1 = http://h:9400/ , ") == {"n1": "http://h:9400"}
    assert parse_store_roots(" main = /ckpt , ") == {"main": StoreRoot("main", "/ckpt", None)}
    assert WatchdogConfig.from_env(" k = 5 , min_steps=4, ") == WatchdogConfig(k=5.0,
                                                                                  min_steps=4)
    token = "t" * 24
    tokens = PushTokens.parse(f"{token}: d1, d2 ,: p* ,")
    assert tokens.tokens[0].datasets == ("d1", "d2")
    assert tokens.tokens[0].producers == ("p*",)


@pytest.mark.parametrize("parse", [parse_probes, parse_store_roots, WatchdogConfig.from_env])
def test_an_item_without_a_name_is_refused_by_name(parse: object) -> None:
    """An item that is not name=value is refused with the item quoted and the form
    expected, whichever setting holds it."""
    with pytest.raises(ValueError, match=r"'=x' is not valid: expected .*comma-separated"):
        parse("=x")  # type: ignore[operator]


def test_a_refused_store_root_shows_no_password() -> None:
    """The refusal quotes an item through ``shown``: a store root's credentials never
    reach the message."""
    with pytest.raises(ValueError) as info:
        parse_store_roots("s3://AKIA:secret@bucket/x")
    assert "secret" not in str(info.value) and "is not valid" in str(info.value)
