"""Command-line flags generated from config dataclasses, as vLLM's EngineArgs does: a field declared with
`option(...)` is a flag, its default is the field's default, its help and parsing are the field's metadata.
A config is written once; the parser and `from_args` follow from it.

    @dataclass(frozen=True, kw_only=True)
    class RouterSettings:
        max_retries: int = option(2, "tries on other instances when one fails before the client saw a byte")

    add_flags(parser, RouterSettings)          # --max-retries, type int, default 2
    settings = from_args(RouterSettings, args)

Fields without `option` (set by the program, not the user) are left out of the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")
_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *, flag: str | None = None,
           type: Callable[[str], Any] | None = None, choices: Iterable[Any] | None = None,
           group: str | None = None, env: str | None = None, switch: bool = False,
           factory: Callable[[], Any] | None = None, aliases: tuple[str, ...] = (), nargs: str | None = None,
           const: Any = None) -> Any:
    """A dataclass field that is also a command-line flag.

    flag: its name when not `--field-name`; type: the parser of its text
    (default: from the annotation); group: the --help section; env: an environment variable whose value is
    the default when set; switch: a bool given as `--flag` alone (store_true) rather than --flag/--no-flag;
    aliases: other names of the flag (vLLM's short ones, `-tp`); nargs: argparse's, for a tuple field of
    several values (`--lora-modules a=/x b=/y`), each parsed by `type`, or "?" with `const`, the value of the
    flag given alone.
    """
    meta = {"help": help, "flag": flag, "type": type, "choices": None if choices is None else list(choices),
            "group": group, "env": env, "switch": switch,
            "aliases": aliases, "nargs": nargs, "const": const}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"option": meta})
    return dataclasses.field(default=default, metadata={"option": meta})


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata["option"]["flag"] or "--" + field.name.replace("_", "-")


def option_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "option" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, cls: type, *, only: Iterable[str] | None = None,
              defaults: dict[str, Any] | None = None, help_suffix: str = "") -> None:
    """One flag per `option` field of `cls` (those named in `only`, when given), in their --help groups.
    `defaults` overrides fields' defaults (launch's own choices for the router's flags), their environment
    variables included: a caller's default is its own choice, which the variable is for the program it starts."""
    hints = typing.get_type_hints(cls)
    groups: dict[str | None, Any] = {}
    wanted = None if only is None else set(only)
    defaults = defaults or {}
    for f in option_fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        meta = f.metadata["option"]
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"]) if meta["group"] else parser
        default = defaults.get(f.name, _default(f))
        if meta["env"] and f.name not in defaults and os.environ.get(meta["env"]) is not None:
            default = os.environ[meta["env"]]
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"] + help_suffix}
        kind = _plain_type(hints[f.name])
        if kind is bool:
            kwargs["action"] = "store_true" if meta["switch"] else argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta["type"] or kind
            if meta["choices"] is not None:
                kwargs["choices"] = meta["choices"]
            elif isinstance(kind, type) and issubclass(kind, Enum):
                kwargs["choices"] = list(kind)
            if meta["flag"] and "choices" not in kwargs:  # the flag's name, not the field's, in --help
                kwargs["metavar"] = meta["flag"].lstrip("-").replace("-", "_").upper()
            if meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
            if meta.get("const") is not None:
                kwargs["const"] = meta["const"]
        groups[meta["group"]].add_argument(flag_name(f), *meta["aliases"], **kwargs)


def from_args(cls: type[T], args: argparse.Namespace, **extra: Any) -> T:
    """The config from parsed flags (fields the parser did not have keep their defaults), plus `extra`."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
             if f.init and hasattr(args, f.name) and f.name not in extra}
    return cls(**given, **extra)


def to_flags(config: Any, only: Iterable[str] | None = None) -> list[str]:
    """The command line that gives `config`'s values which differ from the defaults (to start a child
    process with the same settings: launch -> router)."""
    wanted = None if only is None else set(only)
    out: list[str] = []
    for f in option_fields(type(config)):
        value = getattr(config, f.name)
        if (wanted is not None and f.name not in wanted) or value == _default(f) or value is None:
            continue
        if isinstance(value, bool):
            out.append(flag_name(f) if value else "--no-" + flag_name(f).removeprefix("--"))
        elif f.metadata["option"].get("nargs") and isinstance(value, tuple | list):
            out += [flag_name(f), *(v if isinstance(v, str) else msgspec.json.encode(v).decode() for v in value)]
        else:
            out += [flag_name(f), ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)]
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not _MISSING else None


def _plain_type(hint: Any) -> Any:
    """`int | None` -> int; anything else as it is."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint
