"""Modes of the ingest service and the CLI have one home each, a ``Literal``: the CLI's
choices, the OpenAPI enums, the dispatch tables and the dataclass fields read it, and a
plain string from outside is refused at the boundary with the expected values named."""

from __future__ import annotations

import argparse
import typing
from typing import get_args

import pytest

from ingest_service import seek
from ingest_service.errors import BadRequest
from ingest_service.service.openapi import openapi_document
from ingest_service.sources import files
from trainguard.core import groups, streams
from trainguard.ops import ckpt_cli
from trainguard.ops.cli import build_parser


def _option(parser: argparse.ArgumentParser, path: tuple[str, ...], flag: str) -> argparse.Action:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return next(a for a in parser._actions if flag in a.option_strings)


def test_a_dataset_format_is_the_literal_and_formats_lists_it() -> None:
    """DatasetSpec.format is typed by SourceFormat; FORMATS is exactly its values, and
    the formats read from a source are all of them but push."""
    hints = typing.get_type_hints(streams.DatasetSpec)
    assert hints["format"] == streams.SourceFormat
    assert get_args(streams.SourceFormat) == streams.FORMATS
    assert tuple(f for f in streams.FORMATS if f != "push") == streams.SOURCED_FORMATS


def test_every_sourced_format_has_exactly_one_file_reader() -> None:
    """The file readers' table covers exactly the formats read from a source."""
    assert set(files._READERS) == set(streams.SOURCED_FORMATS)


def test_an_unknown_format_is_refused_naming_the_formats() -> None:
    """A format string from outside is refused with every valid format in the message;
    a valid one passes through unchanged."""
    assert streams.check_format("parquet") == "parquet"
    with pytest.raises(streams.ContractError) as exc:
        streams.check_format("csv")
    assert str(exc.value) == f"format 'csv' is unknown: expected one of {streams.FORMATS}"
    with pytest.raises(streams.ContractError):
        streams.DatasetSpec(name="d", source="/x", format="csv")  # type: ignore[arg-type]


def test_cli_choices_read_the_one_home_of_each_mode() -> None:
    """`ingest --format`, `offsets seek --to` and `ckpt export --format` offer exactly
    the values of their Literal."""
    parser = build_parser()
    assert tuple(_option(parser, ("ingest",), "--format").choices or ()) == streams.SOURCED_FORMATS
    assert tuple(_option(parser, ("offsets", "seek"), "--to").choices or ()) == groups.SEEK_TARGETS
    assert (tuple(_option(parser, ("ckpt", "export"), "--format").choices or ())
            == ckpt_cli.EXPORT_FORMATS == get_args(ckpt_cli.ExportFormat))


def test_openapi_seek_enum_is_the_seek_target_literal() -> None:
    """The SeekRequest schema's `to` enum is exactly SeekTarget's values."""
    schema = openapi_document()["components"]["schemas"]["SeekRequest"]
    to = next(alt for alt in schema["oneOf"] if alt["required"] == ["to"])
    assert to["properties"]["to"]["enum"] == list(get_args(groups.SeekTarget))
    assert (seek.EARLIEST, seek.LATEST) == groups.SEEK_TARGETS


@pytest.mark.parametrize("bad", ["newest", 3, None, ["earliest"]])
def test_a_seek_target_outside_the_literal_is_a_bad_request(bad: object) -> None:
    """Any `to` that is not a SeekTarget is a 400 bad_target naming both targets."""
    assert seek.check_seek_target("latest") == "latest"
    with pytest.raises(BadRequest) as exc:
        seek.check_seek_target(bad)
    assert "expected 'earliest' or 'latest'" in str(exc.value)
