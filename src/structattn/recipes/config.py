"""Recipe configs on the command line: every field of a config dataclass becomes a flag.

Supported field types: ``bool`` (``--flag true|false``), ``int``, ``float``, ``str``,
``Literal[...]`` (choices), ``X | None`` (``none`` gives ``None``), ``tuple[X, ...]`` and
``tuple[X, X]`` (comma-separated), and nested dataclasses, whose fields keep their own flat
names (a recipe config's ``train: TrainConfig`` gives ``--epochs``, ``--lr``, ...; a name
already taken by an outer field is prefixed: ``--train-seed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = [
    "add_config_arguments",
    "config_fields",
    "config_from_args",
    "config_from_dict",
    "config_to_dict",
    "replace_path",
]

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_PREFIX = "cfg:"  # argparse dest prefix of config flags: "cfg:train.epochs"


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _is_dataclass_type(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _optional(kind: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, ``(kind, False)`` otherwise."""
    if get_origin(kind) in (Union, types.UnionType):
        args = [a for a in get_args(kind) if a is not type(None)]
        if len(args) == 1 and len(get_args(kind)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union type {kind!r} (only `X | None`)")
    return kind, False


def _converter(kind: Any, where: str) -> tuple[Callable[[str], Any], str, list[Any] | None]:
    """(text -> value, metavar, choices) for a non-optional field type."""
    if kind is bool:
        return _parse_bool, "BOOL", None
    if kind in (int, float, str):
        return kind, kind.__name__.upper(), None
    if get_origin(kind) is Literal:
        values = list(get_args(kind))
        kinds = {type(v) for v in values}
        if len(kinds) != 1 or kinds.pop() not in (int, str):
            raise TypeError(f"{where}: Literal values must all be int or all str, got {values}")
        convert: Callable[[str], Any] = int if isinstance(values[0], int) else str
        return convert, "{" + ",".join(map(str, values)) + "}", values
    if get_origin(kind) is tuple:
        args = get_args(kind)
        size = None if len(args) == 2 and args[1] is Ellipsis else len(args)
        items = set(args[:1] if size is None else args)
        if len(items) != 1 or not items <= {int, float, str}:
            raise TypeError(f"{where}: tuples must be tuple[X, ...] or tuple[X, X] of one of "
                            f"int, float, str; got {kind}")  # fmt: skip
        item = items.pop()

        def parse_tuple(text: str) -> tuple[Any, ...]:
            try:
                value = tuple(item(t.strip()) for t in text.split(",") if t.strip())
            except ValueError:
                value = None
            if value is None or (size is not None and len(value) != size):
                count = "" if size is None else f"{size} "
                raise argparse.ArgumentTypeError(
                    f"expected {count}comma-separated {item.__name__} values, got {text!r}"
                )
            return value

        return parse_tuple, f"{item.__name__.upper()},...", None
    raise TypeError(f"{where}: unsupported config field type {kind!r}")


def config_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """``(path, type, field)`` of every leaf field of ``cls``, nested dataclasses flattened
    (``path`` as ``"train.epochs"``)."""
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if _is_dataclass_type(kind):
            yield from config_fields(kind, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", kind, field


def _flag_names(cls: type) -> dict[str, str]:
    """path -> flag name: the field's own name, prefixed by its parents' when taken."""
    paths = [path for path, _, _ in config_fields(cls)]
    names: dict[str, str] = {}
    taken: set[str] = set()
    # outer fields first (fewer dots), so they keep the plain names
    for path in sorted(paths, key=lambda p: p.count(".")):
        parts = path.split(".")
        name = parts[-1]
        if name in taken:
            name = "_".join(parts)
        if name in taken:
            raise ValueError(f"config field {path!r} gives the flag --{name} twice")
        taken.add(name)
        names[path] = name.replace("_", "-")
    return {p: names[p] for p in paths}


def add_config_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: frozenset[str] | set[str] = frozenset(),
    defaults: Any = None,
    title: str | None = None,
) -> None:
    """Add a flag for every leaf field of the dataclass ``cls`` except the paths in ``skip``
    (``"attention"``, ``"train.seed"``; unset flags keep the preset's or the default
    value); ``defaults`` (an instance) is
    shown in the help. A field with ``metadata={"required": True}`` is a required flag, one
    with ``metadata={"help": "..."}`` shows that text."""
    shown = defaults if defaults is not None else cls()
    group = parser.add_argument_group(title or f"{cls.__name__} fields (defaults: the paper's)")
    names = _flag_names(cls)
    for path, kind, field in config_fields(cls):
        if path in skip:
            continue
        base, optional = _optional(kind)
        convert, metavar, choices = _converter(base, f"{cls.__name__}.{path}")
        if optional:
            inner = convert

            def convert(text: str, inner: Callable[[str], Any] = inner) -> Any:
                return None if text.lower() in ("none", "null") else inner(text)

            metavar += "|none"
        value: Any = shown
        for part in path.split("."):
            value = getattr(value, part)
        meta: Mapping[str, Any] = field.metadata or {}
        comment = str(meta.get("help", ""))
        required = bool(meta.get("required"))
        group.add_argument(
            f"--{names[path]}",
            dest=_PREFIX + path,
            required=required,
            type=convert,
            default=argparse.SUPPRESS,
            choices=choices if not optional else None,
            metavar=metavar,
            help=comment
            if required or "default" in comment
            else f"{comment}{'; ' if comment else ''}default: {value!r}",
        )


def replace_path(config: T, changes: Mapping[str, Any]) -> T:
    """``config`` with ``{"train.epochs": 5, "dim": 8}`` applied (nested configs rebuilt, so
    every ``__post_init__`` check runs again)."""
    if not changes:
        return config
    own: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    names = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    for path, value in changes.items():
        head, _, rest = path.partition(".")
        if head not in names:
            raise ValueError(f"{type(config).__name__} has no field {head!r}")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            own[head] = value
    for head, sub in nested.items():
        own[head] = replace_path(getattr(config, head), sub)
    return dataclasses.replace(config, **own)  # type: ignore[type-var]


def config_from_args(
    cls: type[T], args: argparse.Namespace, base: T | None = None, **fixed: Any
) -> T:
    """A ``cls`` instance from ``base`` (or the defaults) with the flags given on the command
    line and the ``fixed`` paths (``**{"train.seed": 3}``) applied."""
    config = base if base is not None else cls()
    changes = {k[len(_PREFIX) :]: v for k, v in vars(args).items() if k.startswith(_PREFIX)}
    return replace_path(config, {**changes, **fixed})


def _from_json(kind: Any, value: Any) -> Any:
    base, optional = _optional(kind)
    if value is None and optional:
        return None
    if get_origin(base) is tuple and isinstance(value, list | tuple):
        return tuple(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def config_from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
    """Rebuild a config from :func:`config_to_dict`'s output (unknown keys are ignored). Keys
    of a nested config found at the top level (configs saved before it was nested: flat
    ``epochs``, ``lr``, ...) are moved into it."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    nested = {f.name: hints[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    nested = {k: v for k, v in nested.items() if _is_dataclass_type(v)}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in data and field.name not in nested:
            values[field.name] = _from_json(hints[field.name], data[field.name])
    for name, kind in nested.items():  # missing keys: the default's
        if name in data and isinstance(data[name], Mapping):
            given = dict(data[name])
        else:
            inner = {f.name for f in dataclasses.fields(kind)}
            given = {k: v for k, v in data.items() if k in inner}
        if given:
            default = config_to_dict(getattr(cls(), name))
            values[name] = config_from_dict(kind, {**default, **given})
    return cls(**values)


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as plain JSON / checkpoint values (nested dicts, lists for tuples)."""
    result: dict[str, Any] = dataclasses.asdict(config)
    return typing.cast(dict[str, Any], _plain(result))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
