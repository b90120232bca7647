"""gin files for the typed configs: `OptimizerConfig.learning_rate = 1e-5` sets `learner.optimizer.learning_rate`.

gin-config parses and binds (macros `LR = 1e-5` ... `%LR`, `include`, line continuations); each
binding names a config class of the tree (`TrainConfig` for the top-level keys) and one of its
keys. The bindings become dotted-key overrides that `typed_config` checks exactly as it checks
YAML, with the same one-line errors. Values are Python literals: a section or a list item is a
dict (`TrainConfig.envs = [{'name': 'echo', 'bundled': 'echo'}]`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import tokenize
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gin

from jaxrl.run.typed_config import ConfigError, section_type

GIN_MODULE = "jaxrl"  # bindings may also be written `jaxrl.OptimizerConfig.learning_rate`


def section_paths(root: type) -> dict[str, str | None]:
    """Config class name -> its dotted path in `root`'s tree ('' for `root`); None for a class that
    sits at two places (a binding could not say which)."""
    return {name: path for name, (path, _) in _sections(root).items()}


@functools.cache
def _sections(root: type) -> dict[str, tuple[str | None, type]]:
    found: dict[str, tuple[str | None, type]] = {}

    def walk(cls, path: str):
        name = cls.__name__
        found[name] = (path if found.get(name, (path,))[0] == path else None, cls)
        for field in dataclasses.fields(cls):
            sub = section_type(typing.get_type_hints(cls)[field.name])
            if sub is not None:
                walk(sub, f"{path}.{field.name}" if path else field.name)

    walk(root, "")
    return found


def gin_key(key: str, root: type) -> str:
    """A dotted config key, or a gin binding name (`OptimizerConfig.learning_rate`) as its dotted key."""
    head, _, param = key.rpartition(".")
    paths = section_paths(root)
    if head.removeprefix(f"{GIN_MODULE}.") not in paths:
        return key
    return _dotted(head.removeprefix(f"{GIN_MODULE}."), param, paths, key)


def gin_overrides(files: Sequence[str | Path], bindings: Sequence[str], root: type) -> list[tuple[str, Any]]:
    """The (dotted key, value) pairs that gin `files` then `bindings` set, parents before children."""
    paths = _register(root)
    gin.clear_config()
    try:
        for path in files:
            if not Path(path).is_file():
                raise ConfigError(f"config file {path} not found")
            _parse(gin.parse_config_file, str(path), paths, f'file "{path}"')
        for binding in bindings:  # one by one, so that an error names its binding
            _parse(gin.parse_config, binding, paths, f"--gin '{binding}'")
        return _pairs(paths, root)
    finally:
        gin.clear_config()


def _parse(parse, source: str, paths: dict[str, str | None], what: str) -> None:
    try:
        parse(source)
    except tokenize.TokenError as e:  # an unclosed bracket: the tokenizer's own error
        raise ConfigError(f"gin: {e.args[0]} ({what})") from None
    except (ValueError, SyntaxError, OSError) as e:
        raise ConfigError(_one_line(e, paths, what)) from None


@functools.cache
def _register(root: type) -> dict[str, str | None]:
    """Registers one gin configurable per config class of `root`'s tree (once per process)."""
    paths = section_paths(root)
    for name in paths:
        # Any key is accepted here: typed_config names a wrong one with what it should be.
        gin.external_configurable(lambda **keys: keys, name=name, module=GIN_MODULE)
    return paths


def _pairs(paths: dict[str, str | None], root: type) -> list[tuple[str, Any]]:
    pairs = []
    # gin keeps its bindings by (scope, selector); it has no public list of every binding made.
    for scope, selector in list(gin.config._CONFIG):
        module, _, name = selector.rpartition(".")
        if module != GIN_MODULE:
            continue  # macros and constants: gin resolves them where they are used
        if scope:
            raise ConfigError(f"gin binding '{scope}/{name}...': scopes do not apply to a config; bind "
                              f"'{name}.<key>' without '{scope}/'")
        for param, raw in gin.get_bindings(selector, resolve_references=False).items():
            key = _dotted(name, param, paths, f"{name}.{param}")
            known = [f.name for f in dataclasses.fields(_sections(root)[name][1]) if f.init]
            if param not in known:
                close = difflib.get_close_matches(param, known, n=1)
                hint = f"did you mean '{name}.{close[0]}'? " if close else ""
                section = f"config section '{key.rpartition('.')[0]}'" if "." in key else "the top level"
                raise ConfigError(f"gin binding '{name}.{param}': {name} ({section}) has no key '{param}' "
                                  f"({hint}its keys: {', '.join(known)})")
            for ref in _references(raw):
                if not repr(ref).startswith("%"):  # a macro or constant is a value; @a_function is not
                    raise ConfigError(f"gin binding '{name}.{param}' (config key '{key}'): {ref!r} is a "
                                      "reference to a function; give the value itself (a section as a dict)")
            pairs.append((key, copy.deepcopy(raw)))  # deepcopy evaluates gin's macro references
    return sorted(pairs, key=lambda pair: pair[0].count("."))


def _dotted(name: str, param: str, paths: dict[str, str | None], binding: str) -> str:
    path = paths[name]
    if path is None:
        raise ConfigError(f"gin binding '{binding}': {name} is used in several places of the config; "
                          "set the dotted key instead (`jaxrl config` lists them)")
    return f"{path}.{param}" if path else param


def _references(value):
    if isinstance(value, gin.config.ConfigurableReference):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _references(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _references(v)


def _one_line(e: BaseException, paths: dict[str, str | None], what: str) -> str:
    """gin's message in one line, with where it was and the binding; a close name for an unknown class."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    head = lines[0] if lines else type(e).__name__
    where = lines[1][3:] if len(lines) > 1 and lines[1].startswith("In ") else None
    code = lines[2] if where and len(lines) > 2 else None
    if isinstance(e, SyntaxError):
        head, code = e.msg, (e.text or "").strip() or None
        where = f'file "{e.filename}", line {e.lineno}' if e.filename else what
    elif where is None or where.startswith("bindings string"):
        where, code = what, None
    if head.startswith("No configurable matching reference"):
        head = f"{head.split(chr(39))[1]} refers to a function; a config value is a literal (a section as a dict)"
    elif head.startswith("No configurable matching"):
        unknown = head.split("'")[1].rpartition("/")[2].removeprefix(f"{GIN_MODULE}.")
        close = difflib.get_close_matches(unknown, list(paths), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        head = f"unknown config class '{unknown}' ({hint}config classes: {', '.join(paths)})"
    return f"gin: {head}" + (f" ({where}: {code})" if code else f" ({where})" if where else "")
