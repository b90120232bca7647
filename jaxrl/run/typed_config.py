"""Typed dataclass configs from YAML, with `--set dotted.key=value` overrides.

A config is a tree of dataclasses whose annotations say what each key accepts: bool, int,
float (ints accepted), str, Path, ``Literal[...]``, ``X | None``, ``list[T]``, ``tuple[T, ...]``,
``dict[str, T]``, nested dataclasses and lists of them. Every value is checked against its
annotation and every error is one line naming the dotted key, the bad value and what is
allowed. A field's ``metadata={"help": ...}`` documents it; ``describe`` prints all defaults
with that help, which is where the defaults are documented.

YAML is read with one fix to PyYAML's YAML 1.1 rules: ``1e-5`` is a float, not a string.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value, key or file that cannot be used; the message names it."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float and refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        # PyYAML silently keeps the last of two equal keys: a doubled `lr:` would go unnoticed.
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


# YAML 1.1 wants a dot and a signed exponent (`1.0e-5`); researchers write `1e-5` and `3e4`.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


# ---- reading values ---------------------------------------------------------------------


def from_dict(cls: type[T], data: Mapping[str, Any] | None, key: str = "") -> T:
    """Builds dataclass `cls` from parsed YAML, checking every value against its annotation.

    Missing keys take the dataclass defaults. `key` is the dotted key of this section, used in
    messages. ValueErrors from the dataclass's own `__post_init__` become ConfigErrors.
    """
    # `learner:` with every key commented out reads as None: that section takes its defaults.
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_where(key)}: expected {_expected(cls)}, got {_show(data)}")
    fields = _init_fields(cls)
    hints = typing.get_type_hints(cls)
    for name in data:
        if name not in fields:
            raise ConfigError(_unknown_key(key, name, list(fields), getattr(cls, "RENAMED", {})))
    kwargs = {}
    for name, field in fields.items():
        sub = _join(key, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], sub)
        elif not _has_default(field):
            help_text = field.metadata.get("help")
            raise ConfigError(
                f"missing required config key '{sub}' ({_expected(hints[name])})"
                + (f": {help_text}" if help_text else "")
            )
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{_where(key)}: {e}") from e


def _convert(tp, value, key: str):
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        # The first option of the right kind checks the value; its errors are the specific ones.
        for option in args:
            if _fits(option, value):
                return _convert(option, value, key)
        raise _mismatch(tp, value, key)
    if not _fits(tp, value):
        raise _mismatch(tp, value, key)
    if tp is float:
        return float(value)
    if tp is Path:
        return Path(value)
    if origin is list or tp is list:
        (item,) = args or (Any,)
        return [_convert(item, v, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is tuple or tp is tuple:
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            item = args[0] if args else Any
            return tuple(_convert(item, v, f"{key}.{i}") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{_where(key)}: expected {_expected(tp)}, got {len(value)}: {_show(value)}")
        return tuple(_convert(a, v, f"{key}.{i}") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict or tp is dict:
        _, item = args or (str, Any)
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{_where(key)}: keys must be strings, got {_show(k)}")
        return {k: _convert(item, v, f"{key}.{k}") for k, v in value.items()}
    return value  # bool, int, str, None, a Literal member or Any: already checked


def _fits(tp, value) -> bool:
    """Whether `value` is of the kind `tp` names (its items are checked by `_convert`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin is Literal:
        # `True == 1`: compare types too, so that Literal[1] refuses `true`.
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (Union, types.UnionType):
        return any(_fits(a, value) for a in args)
    if dataclasses.is_dataclass(tp) or origin is dict or tp is dict:
        return isinstance(value, Mapping)
    if origin in (list, tuple) or tp in (list, tuple):
        return isinstance(value, (list, tuple))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is Path:
        return isinstance(value, (str, os.PathLike))
    raise TypeError(f"typed_config does not support the annotation {tp!r}")


def _expected(tp) -> str:
    """What `tp` accepts, in words: 'a float', "one of 'sync', 'async'", 'an int or null'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_expected(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} keys"
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        return f"a list of {len(args)} items"
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    names = {bool: "a bool (true or false)", int: "an int", float: "a float", str: "a string",
             Path: "a path", Any: "any value"}
    return names[tp]


def _mismatch(tp, value, key: str) -> ConfigError:
    if typing.get_origin(tp) is Literal:
        allowed = ", ".join(repr(a) for a in typing.get_args(tp))
        return ConfigError(f"{_where(key)}: {_show(value)} is not one of {allowed}")
    return ConfigError(f"{_where(key)}: expected {_expected(tp)}, got {_show(value)}")


def _unknown_key(section: str, name, known: list[str], renamed: Mapping[str, str]) -> str:
    """`renamed` (a dataclass's `RENAMED`): keys of earlier versions -> the key that replaced them."""
    if name in renamed:
        return f"config key '{_join(section, name)}' is gone: set '{_join(section, renamed[name])}' instead"
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f"did you mean '{_join(section, close[0])}'? " if close else ""
    where = f"known keys under '{section}'" if section else "known top-level keys"
    return f"unknown config key '{_join(section, name)}' ({hint}{where}: {', '.join(known)})"


def _where(key: str) -> str:
    return f"config key '{key}'" if key else "config"


def _join(section: str, name) -> str:
    return f"{section}.{name}" if section else str(name)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _init_fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _has_default(field: dataclasses.Field) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def _default(field: dataclasses.Field):
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


# ---- overrides --------------------------------------------------------------------------

_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def parse_overrides(items: Iterable[str]) -> list[tuple[str, Any]]:
    """`["learner.lr=1e-5", "envs.0.url=ws://h:1"]` -> `[("learner.lr", 1e-05), ...]`.

    Values are YAML: `true`, `null`, `[1, 2]`, `{a: 1}`; `1e-5` is a float.
    """
    pairs = []
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not _KEY.fullmatch(key):
            raise ConfigError(f"bad override {item!r}: expected dotted.key=value, e.g. learner.lr=1e-5")
        try:
            value = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"bad override {item!r}: the value is not valid YAML ({problem})") from None
        pairs.append((key, value))
    return pairs


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[tuple[str, Any]]) -> dict:
    """A copy of `data` with each `(dotted.key, value)` set.

    Missing intermediate mappings are created; a numeric part indexes a list (`envs.0.url`).
    A value replaces what was there, mappings included (they are not merged).
    """
    out = copy.deepcopy(dict(data))
    for key, value in overrides:
        parts = key.split(".")
        node: Any = out
        for i, part in enumerate(parts):
            here, last = ".".join(parts[: i + 1]), i == len(parts) - 1
            if isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if node.get(part) is None:
                        node[part] = {}
                    node = node[part]
            elif isinstance(node, list):
                parent = ".".join(parts[:i])
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(
                        f"cannot set config key '{key}': '{parent}' is a list of {len(node)} items, "
                        f"so '{here}' needs an index from 0 to {len(node) - 1}"
                    )
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            else:
                parent = ".".join(parts[:i])
                raise ConfigError(f"cannot set config key '{key}': '{parent}' is {_show(node)}, not a mapping")
    return out


# ---- files ------------------------------------------------------------------------------


def read_yaml(path: str | Path) -> dict:
    """The mapping in YAML file `path` ({} for an empty file); errors name the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level, got {_show(data)}")
    return data


def load(cls: type[T], path: str | Path | Mapping[str, Any], overrides: Iterable[str | tuple[str, Any]] = ()) -> T:
    """Reads YAML file `path` (or takes the mapping of keys `path`), applies `overrides` and builds `cls`.

    Each override is either a `--set` item (`"learner.lr=1e-5"`) or a parsed `(key, value)` pair.
    """
    pairs = [parse_overrides([o])[0] if isinstance(o, str) else o for o in overrides]
    data = apply_overrides(path if isinstance(path, Mapping) else read_yaml(path), pairs)
    try:
        _refuse_derived(cls, data)
        return from_dict(cls, data)
    except ConfigError as e:
        if isinstance(path, Mapping):
            raise
        raise ConfigError(f"{path}: {e}") from None


def _derived(cls) -> dict[str, str]:
    """`cls.DERIVED`: dotted keys the program sets from others (not user keys) -> their source."""
    return getattr(cls, "DERIVED", {})


def _lookup(data: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _refuse_derived(cls, data: Mapping[str, Any]) -> None:
    for key, source in _derived(cls).items():
        if _lookup(data, key)[0]:
            raise ConfigError(f"'{key}' is not a config key: the run derives it from {source}; set that instead")


def to_dict(obj) -> dict:
    """A dataclass config (or a mapping) as plain YAML-serialisable data, derived keys left out;
    `load` reads it back."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        data = {name: _plain(getattr(obj, name)) for name in _init_fields(type(obj))}
        for key in _derived(type(obj)):
            *parents, last = key.split(".")
            found, parent = _lookup(data, ".".join(parents)) if parents else (True, data)
            if found and isinstance(parent, dict):
                parent.pop(last, None)
        return data
    return {k: _plain(v) for k, v in obj.items()}


def _plain(value):
    if (dataclasses.is_dataclass(value) and not isinstance(value, type)) or isinstance(value, Mapping):
        return to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    return value


def dump_yaml(obj, path: str | Path) -> Path:
    """Writes `to_dict(obj)` as YAML to `path` (atomically: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(obj), sort_keys=False, width=100))
    os.replace(tmp, path)
    return path


# ---- documentation ----------------------------------------------------------------------


def describe(cls) -> str:
    """Every key of `cls` with its default, as YAML, with its help above and its type beside it."""
    return "\n".join(_describe_lines(cls, _defaults(cls), "", set(_derived(cls)))) + "\n"


def _describe_lines(cls, values: Mapping[str, Any], pad: str, hidden: set[str] = frozenset(),
                    prefix: str = "") -> list[str]:
    lines = []
    hints = typing.get_type_hints(cls)
    for name, field in _init_fields(cls).items():
        if prefix + name in hidden:
            continue
        tp = hints[name]
        lines += [f"{pad}# {line}" for line in field.metadata.get("help", "").splitlines()]
        section = section_type(tp)
        if name not in values:
            if section is not None:
                lines.append(f"{pad}{name}:  # required")
                lines += _describe_lines(section, _defaults(section), pad + "  ")
            else:
                lines.append(f"{pad}{name}:  # required, {_label(tp)}")
                lines += _item_keys(tp, pad)
            continue
        value = values[name]
        if section is not None and isinstance(value, dict):
            lines.append(f"{pad}{name}:")
            lines += _describe_lines(section, value, pad + "  ", hidden, f"{prefix}{name}.")
            continue
        # Flow style for short collections (`betas: [0.9, 0.999]`); a lone scalar would flow too.
        flow = None if isinstance(value, (list, dict)) else False
        dumped = yaml.safe_dump({name: value}, sort_keys=False, default_flow_style=flow, width=10**6)
        first, *rest = dumped.rstrip("\n").splitlines()
        if rest and flow is False:  # a multi-line string: a comment inside it would become text
            lines += [f"{pad}# {_label(tp)}"] + [pad + line for line in (first, *rest)]
        else:
            lines += [f"{pad}{first}  # {_label(tp)}"] + [pad + line for line in rest]
        lines += _item_keys(tp, pad)
    return lines


def _item_keys(tp, pad: str) -> list[str]:
    """The keys of the dataclass inside `tp` (a list or an unset section of them), commented."""
    item = _item_type(tp)
    if item is None:
        return []
    return [f"{pad}#   {line}" for line in _describe_lines(item, _defaults(item), "")]


def _defaults(cls) -> dict[str, Any]:
    return {name: _plain(_default(f)) for name, f in _init_fields(cls).items() if _has_default(f)}


def _label(tp) -> str:
    """`tp` as a short type name for docs: 'float | null', "'sync' | 'async'", 'list[Env]'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_label(a) for a in args)
    if args:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _label(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def section_type(tp):
    """The dataclass of a `Section` or `Section | None` annotation, else None."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    sections = [o for o in options if dataclasses.is_dataclass(o)]
    return sections[0] if len(sections) == 1 else None


def _item_type(tp):
    """The dataclass inside `tp` (a section, a list or mapping of them), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        found = _item_type(arg)
        if found is not None:
            return found
    return None


def key_rows(cls) -> list[tuple[str, str, str, str]]:
    """Every key of `cls` as (dotted key, type, default as YAML or 'required', help), in `describe`'s
    order; a list of sections' keys as `name[].key`, an unset section's as `name.key`."""
    return _key_rows(cls, _defaults(cls), "", set(_derived(cls)))


def _key_rows(cls, values: Mapping[str, Any], prefix: str, hidden: set[str] = frozenset()):
    rows = []
    hints = typing.get_type_hints(cls)
    for name, field in _init_fields(cls).items():
        key = prefix + name
        if key in hidden:
            continue
        tp, help_ = hints[name], " ".join(field.metadata.get("help", "").split())
        section = section_type(tp)
        if section is not None and isinstance(values.get(name), dict):
            rows += _key_rows(section, values[name], key + ".", hidden)
            continue
        if name not in values and section is not None:
            rows.append((key, _label(tp), "required", help_))
            rows += _key_rows(section, _defaults(section), key + ".")
            continue
        default = "required" if name not in values else _flow(values[name])
        rows.append((key, _label(tp), default, help_))
        item = _item_type(tp)
        if item is not None:
            rows += _key_rows(item, _defaults(item), key + ("." if section is not None else "[]."))
    return rows


def _flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip().removesuffix("\n...").strip()


def describe_markdown(cls) -> str:
    """`describe` as Markdown for the documentation: a table of keys per top-level section (the
    top-level scalars first), then `describe`'s YAML as `jaxrl config` prints it."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, list] = {}
    for row in key_rows(cls):
        head = row[0].split(".")[0].removesuffix("[]")
        nested = section_type(hints[head]) is not None or _item_type(hints[head]) is not None
        groups.setdefault(head if nested else "", []).append(row)
    out = []
    for group, rows in groups.items():
        out += [f"## {group or 'Top-level keys'}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| `{key}` | {_md_code(label)} | {_md_code(default)} | {_md_text(help_)} |"
                for key, label, default, help_ in rows]
        out.append("")
    out += ["## As `jaxrl config` prints it", "", "```yaml", describe(cls).rstrip("\n"), "```", ""]
    return "\n".join(out)


def _md_code(text: str) -> str:
    """`text` as a code span in a table cell (Python-Markdown's tables leave a code span's `|` alone)."""
    return "`" + text + "`" if text != "required" else "*required*"


def _md_text(text: str) -> str:
    """Help text for a table cell: its `code` spans kept as they are, Markdown's and HTML's special
    characters outside them escaped."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: all plain text
        parts = [text]
    for i in range(0, len(parts), 2):
        plain = parts[i].replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        parts[i] = re.sub(r"([*_\[\]|#])", r"\\\1", plain)
    return "`".join(parts)
