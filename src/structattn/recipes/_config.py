"""Command-line overrides for recipe config dataclasses: every field becomes ``--field-name``."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] | set[str] = frozenset()
) -> None:
    """Add ``--field-name`` for every field of the dataclass ``cls`` (default: unchanged)."""
    hints = get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} fields (defaults: the paper's settings)")
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        kind = hints[field.name]
        convert: Any = _parse_bool if kind is bool else kind
        group.add_argument(
            f"--{field.name.replace('_', '-')}",
            dest=f"cfg_{field.name}",
            type=convert,
            default=None,
            metavar=kind.__name__.upper() if isinstance(kind, type) else "VALUE",
            help=f"default: {field.default!r}",
        )


def config_from_args(
    cls: type[T], args: argparse.Namespace, base: T | None = None, **fixed: Any
) -> T:
    """A ``cls`` instance from ``base`` (or the defaults) with the given overrides applied."""
    config = base if base is not None else cls()
    changes = {
        f.name: getattr(args, f"cfg_{f.name}")
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if getattr(args, f"cfg_{f.name}", None) is not None
    }
    return dataclasses.replace(config, **{**changes, **fixed})  # type: ignore[type-var]
