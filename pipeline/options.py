"""Command lines generated from the pydantic configs: every option is declared once, on its field.

``OptionParser(Model)`` turns the fields of a pydantic model (recursively into nested config
models) into ``argparse`` flags: the flag is the field name in kebab case (or the field's
``json_schema_extra={"flag": ...}``), the help is the field's ``description`` followed by its default,
and the type, choices and on/off switches come from the annotation (``bool`` -> ``--x/--no-x``,
``Literal`` -> choices, ``list[float]`` -> comma-separated values). Fields with
``json_schema_extra={"cli": False}`` (internal fields, e.g. the job's name) get no flag. A config
offers exactly the fields that apply to it: a job composes the small models it needs instead of
inheriting fields and hiding some.

Settings are layered, later ones winning: the model's own defaults, a YAML file given with
``--config FILE`` (keys as in the model, nested: ``compression: {method: snapkv}``), then the flags
actually typed (only those: argparse defaults are suppressed). The result is validated by the
model; a bad value exits with code 2 and a message naming the flag and the field. Only
:meth:`OptionParser.parse` and :func:`fail` exit (they are the command line's edge); the functions
under them raise :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import math
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

REQUIRED = object()


class UsageError(ValueError):
    """A bad setting in a command line or ``--config`` file; the message names the flag."""


class CommandLineConfig(BaseModel):
    """A config whose command line is laid out by the config itself (the defaults here are what any
    other pydantic model gets): subclasses override what they need."""

    @classmethod
    def option_groups(cls) -> list[tuple[str, list[str]]]:
        """(help group title, field names) in help order; the default: one group of every field."""
        return one_group(cls)

    @classmethod
    def cli_aliases(cls) -> dict[str, tuple[Any, str, Callable[[Any], dict]]]:
        """Flags that are not fields: ``{name: (type, description, expand)}``, ``expand(value)`` returning
        the fields the alias stands for (raising ValueError on a bad value); they join the first group."""
        return {}


def one_group(model: type[BaseModel]) -> list[tuple[str, list[str]]]:
    """Every field of ``model`` in one help group, titled by the first line of its docstring (else its name)."""
    return [((model.__doc__ or model.__name__).strip().splitlines()[0].rstrip("."), list(model.model_fields))]


def _layout(model: type[BaseModel]) -> type[CommandLineConfig]:
    """The class whose declarations lay out ``model``'s flags: the model itself when it declares
    ``option_groups`` and ``cli_aliases`` (deriving from :class:`CommandLineConfig`, or defining both,
    as the compression config does without importing this module), else the defaults."""
    declares = all(callable(getattr(model, name, None)) for name in ("option_groups", "cli_aliases"))
    return model if declares else CommandLineConfig


@dataclass
class Option:
    """One generated flag: ``path`` is the field's dotted location in the model (its argparse dest)."""

    flag: str
    path: str
    annotation: Any
    help: str
    default: Any
    repeat: bool = False  # list[str] given by repeating the flag instead of comma separated
    shown: str | None = None  # the default in words, when it is computed (json_schema_extra "shown_default")


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def split_top_level(text: str, separator: str = ",") -> list[str]:
    """``text`` split at ``separator`` outside square brackets: ``"a,b[x=1,y=2]"`` -> ``["a", "b[x=1,y=2]"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _comma_list(item_type):
    def parse(text: str) -> list:
        return [item_type(part.strip()) for part in split_top_level(text) if part.strip()]

    parse.__name__ = f"comma-separated {item_type.__name__}"
    return parse


def first_paragraph(doc: str) -> str:
    """A module docstring's first paragraph as one line (a command's ``--help`` description)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def finite_float(text: str) -> float:
    """A float flag's value: a finite number (``inf`` and ``nan`` are no setting's meaning)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text}")
    return value


finite_float.__name__ = "float"


def _number(item_type):
    return finite_float if item_type is float else item_type


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors in one line, like every other bad setting (not the whole usage first)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (all options: {self.prog} --help)\n")


def _or_none(item_type):
    """A number, or ``none`` for an optional field (e.g. ``--prefill-chunk none``: one pass)."""

    def parse(text: str):
        return None if text.strip().lower() == "none" else _number(item_type)(text)

    parse.__name__ = f"{item_type.__name__} or none"
    return parse


def _argparse_kwargs(annotation: Any) -> dict | None:
    """How argparse reads a value of this type (None: not settable from the command line). An
    optional number also takes ``none``."""
    optional = _strip_optional(annotation) is not annotation
    annotation = _strip_optional(annotation)
    origin = typing.get_origin(annotation)
    if optional and annotation in (int, float):
        return {"type": _or_none(annotation)}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        choices = list(typing.get_args(annotation))
        return {"choices": choices, "type": type(choices[0])}
    if annotation in (int, float, str):
        return {"type": _number(annotation)}
    if annotation is Path:
        return {"type": str}
    if origin is list and typing.get_args(annotation) and typing.get_args(annotation)[0] in (int, float, str):
        return {"type": _comma_list(_number(typing.get_args(annotation)[0])), "metavar": "A,B,..."}
    return None


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "none"
    if value == "":
        return '""'
    return "none" if value is None else str(value)


def _help(opt: Option) -> str:
    """The field's description and its default (unless the description already says it)."""
    if opt.default is REQUIRED and opt.shown is None:
        tail = "(required)"
    elif "(default:" in opt.help:
        tail = ""
    else:
        tail = f"(default: {opt.shown or _show(opt.default)})"
    return " ".join(part for part in (opt.help, tail) if part).replace("%", "%%")


def _field_default(field, parent_default: BaseModel | None, name: str) -> Any:
    if parent_default is not None:
        return getattr(parent_default, name)
    if field.default is PydanticUndefined and field.default_factory is None:
        return REQUIRED
    return field.get_default(call_default_factory=True)


def collect_options(
    model: type[BaseModel], prefix: str = "", default: BaseModel | None = None
) -> list[tuple[str, list[Option]]]:
    """(group title, options) for ``model``'s fields, recursing into nested config models, laid out
    as the model declares (:class:`CommandLineConfig`)."""
    declared = _layout(model)
    layout = model.option_groups() if declared is model else one_group(model)
    groups: list[tuple[str, list[Option]]] = []
    for index, (group_title, names) in enumerate(layout):
        own: list[Option] = []
        if index == 0:
            for name, (annotation, description, _) in declared.cli_aliases().items():
                value = getattr(default, name, None) if default is not None else None
                own.append(Option("--" + name.replace("_", "-"), f"{prefix}{name}", annotation, description, value))
        nested: list[tuple[str, list[Option]]] = []
        for name in names:
            field = model.model_fields[name]
            path = f"{prefix}{name}"
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if extra.get("cli") is False:
                continue
            value = _field_default(field, default, name)
            if _is_model(field.annotation):
                sub_default = value if isinstance(value, BaseModel) else None
                nested += collect_options(field.annotation, f"{path}.", sub_default)
            elif _argparse_kwargs(field.annotation) is not None:
                flag = "--" + str(extra.get("flag", name)).replace("_", "-")
                own.append(
                    Option(
                        flag,
                        path,
                        field.annotation,
                        field.description or "",
                        value,
                        bool(extra.get("repeat")),
                        extra.get("shown_default"),
                    )
                )
        if own:
            groups.append((group_title, own))
        groups += nested
    return groups


class OptionParser:
    """An ``argparse`` parser generated from ``model`` (see the module docstring)."""

    def __init__(
        self,
        model: type[BaseModel],
        prog: str,
        description: str = "",
        epilog: str | None = None,
        extra_args=None,
    ) -> None:
        self.model = model
        self.parser = _OneLineParser(prog=prog, description=description, epilog=epilog)
        self.parser.add_argument(
            "--config",
            metavar="FILE.yaml",
            default=argparse.SUPPRESS,
            help="YAML file with these settings (nested keys as in the config); flags override it",
        )
        if extra_args is not None:  # options that are not config fields (e.g. --json output format)
            extra_args(self.parser)
        self.options: dict[str, Option] = {}
        for title, options in collect_options(model):
            group = self.parser.add_argument_group(title)
            for opt in options:
                if opt.flag in {o.flag for o in self.options.values()}:
                    raise TypeError(f"{model.__name__}: flag {opt.flag} declared by two fields ({opt.path})")
                self.options[opt.path] = opt
                kwargs = {"action": "append"} if opt.repeat else _argparse_kwargs(opt.annotation)
                if "choices" not in kwargs and kwargs.get("action") is not argparse.BooleanOptionalAction:
                    kwargs.setdefault("metavar", opt.flag[2:].upper().replace("-", "_"))
                group.add_argument(opt.flag, dest=opt.path, default=argparse.SUPPRESS, help=_help(opt), **kwargs)

    def parse(self, argv: Sequence[str] | None = None) -> tuple[BaseModel, argparse.Namespace]:
        """Validated model from defaults < ``--config`` YAML < typed flags; exits with 2 on a bad value.
        Also returns the namespace (for ``extra_args`` options)."""
        args = self.parser.parse_args(sys.argv[1:] if argv is None else list(argv))
        flags = _nested({k: v for k, v in vars(args).items() if k in self.options})
        try:
            from_file = load_yaml(args.config) if "config" in vars(args) else {}
            layered = model_defaults(self.model)
            for source, layer in (("in --config", from_file), ("", flags)):
                layered = merge_layer(self.model, layered, layer, source)
            return self.model.model_validate(layered), args
        except UsageError as exc:
            fail(str(exc))
        except ValidationError as exc:
            fail(self.describe_errors(exc))

    def describe_errors(self, exc: ValidationError) -> str:
        """One ``invalid --flag (field): message`` line per error."""
        lines = []
        for err in exc.errors():
            path = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or "config"
            opt = self.options.get(path)
            where = f"{opt.flag} ({path})" if opt else path
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":  # a key of another job's config, or a typo
                message = f"not a setting of {self.parser.prog} (its settings: --help)"
            lines.append(f"invalid {where}: {message}")
        return "\n".join(lines)


def model_defaults(model: type[BaseModel]) -> dict:
    """The explicitly set values of the defaults of ``model``'s nested config fields (e.g. a job's own
    compression method), so that layering a flag over them keeps the rest of the default."""
    out = {}
    for name, field in model.model_fields.items():
        if _is_model(field.annotation) and field.default_factory is not None:
            default = field.get_default(call_default_factory=True)
            out[name] = default.model_dump(exclude_unset=True, exclude=set(type(default).model_computed_fields))
    return out


def merge_layer(model: type[BaseModel] | None, base: dict, top: dict, source: str) -> dict:
    """``top`` over ``base`` for ``model``, key by key into nested configs; an alias in ``top``
    (``cli_aliases``) is expanded into its fields first, replacing theirs in ``base``. Raises
    :class:`UsageError` for a bad alias value or an alias that contradicts a field given beside it."""
    top = dict(top)
    aliases = _layout(model).cli_aliases() if model is not None else {}
    for name, (_, _, expand) in aliases.items():
        if name not in top:
            continue
        try:
            fields = expand(top.pop(name))
        except ValueError as exc:
            raise UsageError(f"invalid --{name.replace('_', '-')}{' ' + source if source else ''}: {exc}") from None
        for key, value in fields.items():
            if key in top and top[key] != value:
                raise UsageError(
                    f"invalid --{name.replace('_', '-')}{' ' + source if source else ''}: it sets {key}={value!r}, "
                    f"but {key}={top[key]!r} was also given"
                )
            top[key] = value
    merged = dict(base)
    for key, value in top.items():
        field = model.model_fields.get(key) if model is not None else None
        sub = field.annotation if field is not None and _is_model(field.annotation) else None
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_layer(sub, merged[key], value, source)
        else:
            merged[key] = value
    return merged


def _nested(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def load_yaml(path: str) -> dict:
    """The mapping in a ``--config`` YAML file; :class:`UsageError` naming the problem."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"invalid --config: no such file: {file}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"invalid --config: {file} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"invalid --config: {file} must hold a mapping of settings")
    return data


def fail(message: str) -> typing.NoReturn:
    """The command line's exit for a bad setting: ``error: message`` on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
