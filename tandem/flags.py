"""CLI flags generated from a settings class: every field a `--name-with-dashes` flag, its help the
field's description with the default and the environment variable, so `--help`, the settings and the
configuration reference (docs/configuration.md, tandem/config_reference.py) cannot drift.

A flag the user does not give stays out of the parsed namespace (`argparse.SUPPRESS`), so the
settings class fills it from its environment variable or its default, in that order.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings


def add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings], *,
                       skip: tuple[str, ...] = (), aliases: dict[str, list[str]] | None = None,
                       hidden: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls` but `skip`; `aliases` adds older spellings of a flag,
    `hidden` keeps a flag out of `--help`."""
    aliases = aliases or {}
    group = parser.add_argument_group("settings (environment "
                                      f"{cls.model_config.get('env_prefix', '')}*)")
    for name, field in fields_in_order(cls).items():
        if name in skip:
            continue
        flags = [flag_name(name), *aliases.get(name, [])]
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                                  "help": argparse.SUPPRESS if name in hidden
                                  else _help(cls, name)}
        kind, choices = flag_type(field.annotation)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is list:
            # Repeatable and multi-valued both (`--served-model-name a b`, as in `vllm serve`).
            kwargs["action"] = "extend"
            kwargs["nargs"] = "+"
            kwargs["metavar"] = "VALUE"
            if choices:
                kwargs["choices"] = choices
        else:
            kwargs["type"] = kind
            if choices:
                kwargs["choices"] = choices
            kwargs["metavar"] = name.upper() if not choices else None
        group.add_argument(*flags, **kwargs)


def given(args: argparse.Namespace, cls: type[BaseSettings]) -> dict[str, Any]:
    """The settings of `cls` the user gave as flags."""
    return {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}


def fields_in_order(cls: type[BaseModel]) -> dict[str, FieldInfo]:
    """`cls`'s fields, its own first (pydantic puts a base's first): a settings class keeps its
    order in `--help` and the reference when a group of its fields lives in a base it mixes in
    (router/planner_settings.py)."""
    own = [name for name in vars(cls).get("__annotations__", {}) if name in cls.model_fields]
    return {name: cls.model_fields[name] for name in [*own, *cls.model_fields]}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def shown_default(field: FieldInfo) -> Any:
    """A field's default as --help and docs/configuration.md show it (a path in the home folder as
    ~/...)."""
    default = field.default if field.default_factory is None else field.default_factory()
    if isinstance(default, Path) and str(default).startswith(str(Path.home())):
        default = "~" + str(default)[len(str(Path.home())):]
    return default


def _help(cls: type[BaseSettings], name: str) -> str:
    field = cls.model_fields[name]
    env = f"{cls.model_config.get('env_prefix', '')}{name.upper()}"
    default = shown_default(field)
    shown = "none" if default is None or default == [] else default
    text = (field.description or "").replace("%", "%%")
    if field.is_required():
        return f"{text} (required; env {env})"
    return f"{text} (default: {shown}; env {env})"


def flag_type(annotation: Any) -> tuple[type, list[str] | None]:
    """The argparse type of a field annotation (`int | None` -> int) and its choices."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return flag_type(args[0])
    if origin is Literal:
        return str, [str(a) for a in typing.get_args(annotation)]
    if origin is list:  # a list of choices keeps them (--ready-roles prefill decode)
        return list, (flag_type(args[0])[1] if args else None)
    if annotation in (bool, int, float, str, Path):
        return annotation, None
    raise TypeError(f"no flag type for {annotation!r}")
