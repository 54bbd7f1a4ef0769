"""From YAML and `--set` overrides to a checked `Config`, and back to YAML.

A config file's sections are mappings of keys to plain values; each value is checked against its
key's type annotation (`_coerce`) and the section built from them checks its rules. Unknown keys,
wrong types and unreadable files are `ConfigError`s whose message names the key and the value.
`--set section.key=value` overrides are parsed as YAML scalars and validated exactly like the file.

`load_config` comes first, then its steps in the order it takes them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import shlex
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from llmcli.config.objective_defaults import with_objective_defaults
from llmcli.config.sections import SECTIONS, Config
from llmcli.config.shipped import bundled_paths, find_config
from llmcli.errors import ConfigError, InputError, did_you_mean
from llmcli.fileio import read_user_text


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load, override and validate a config file or a shipped config by name.

    Args:
        path: a YAML file with any of the sections model, data, train, sample, or the name of
            a shipped config (`tiny`, `speedrun-cpu`, ...; see `shipped_configs`).
        overrides: `section.key=value` strings, applied after the file.

    Raises:
        ConfigError: the file is missing, unreadable, not YAML, or a value breaks a rule.
    """
    file, shipped = find_config(path)
    raw = read_yaml(file)
    if shipped:
        raw = bundled_paths(raw, file)
    raw = apply_overrides(raw, list(overrides or []))
    return config_from_dict(raw, name=file.stem)


def read_yaml(path: str | Path) -> Any:
    """Read a YAML config file, turning every way it can be unreadable into a `ConfigError`."""
    p = Path(path)
    try:
        text = read_user_text(p, "config file", kind="YAML")
    except InputError as exc:
        raise ConfigError(str(exc)) from None
    if not text.strip():
        raise ConfigError(
            f"config file {str(p)!r} is empty: write at least one section, for example "
            "'model: {n_layer: 4}', or start from a shipped one: `llmcli config tiny > my.yaml`."
        )
    try:
        raw = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(
            f"config file {str(p)!r} nests lists or mappings too deeply to read: a config is "
            "four sections of plain key: value pairs."
        ) from None
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(
            f"config file {str(p)!r} is not valid YAML{where}: {problem}. Fix the syntax "
            "(indentation, colons, quotes) there."
        ) from None
    if raw is None:
        raise ConfigError(f"config file {str(p)!r} holds no settings (only comments?).")
    return raw


def apply_overrides(raw: Any, overrides: list[str]) -> Any:
    """Return a copy of the parsed YAML with `--set` overrides applied."""
    if not overrides:
        return raw
    if not isinstance(raw, dict):
        return raw  # config_from_dict reports the shape problem
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        key, _, inner = key.partition(".")
        if section not in SECTIONS:
            hint = did_you_mean(section, SECTIONS)
            raise ConfigError(
                f"--set {text!r}: unknown section '{section}'.{hint} The sections are "
                f"{', '.join(SECTIONS)}."
            )
        current = merged.get(section)
        if current is None:
            current = merged[section] = {}
        if not isinstance(current, dict):
            raise ConfigError(f"--set {text!r}: section '{section}' in the file is not a mapping.")
        if inner:  # a key of a nested mapping (train.lora.rank): the mapping made if null
            nested = current.get(key)
            nested = {} if nested is None else nested
            if not isinstance(nested, dict):
                raise ConfigError(
                    f"--set {text!r}: '{section}.{key}' is not a mapping with keys of its own: "
                    f"set it whole, as {section}.{key}=VALUE."
                )
            value = {**nested, inner: value}
        current[key] = value
    return merged


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse one `--set section.key=value` into (section, key, YAML scalar value); the key of
    a nested mapping comes back dotted (`--set train.lora.rank=4`: "train", "lora.rank")."""
    if "=" not in text:
        raise ConfigError(
            f"--set {text!r}: expected section.key=value, for example --set train.max_steps=200."
        )
    dotted, _, raw_value = text.partition("=")
    parts = dotted.strip().split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(
            f"--set {text!r}: the key must be section.key with a section among "
            f"{', '.join(SECTIONS)} (for example model.n_head=8), or section.key.key for a "
            "mapping's key (train.lora.rank=8)."
        )
    value = parse_scalar(raw_value, f"--set {text!r}", f"--set '{dotted.strip()}=\"...\"'")
    return parts[0], ".".join(parts[1:]), value


def format_scalar(value: Any) -> str:
    """A setting's value as YAML writes it, as `parse_scalar` reads it back: `null`, `true`,
    `0.8`."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def set_options(key: str, value: Any) -> list[str]:
    """The `--set KEY=VALUE` arguments that give `key` its `value`, quoted for a shell: a list
    as comma text (`train.reward=exact,number`), a mapping as one `--set` a key
    (`train.lora.rank=8`), anything else as `format_scalar` writes it."""
    if isinstance(value, dict):
        return [arg for k, v in value.items() for arg in set_options(f"{key}.{k}", v)]
    text = ",".join(map(format_scalar, value)) if isinstance(value, list) else format_scalar(value)
    return ["--set", shlex.quote(f"{key}={text}")]


def parse_scalar(raw: str, what: str, quoted: str) -> Any:
    """A setting's value typed by the user, read as a YAML scalar (a blank text is None): what
    `--set KEY=VALUE` and `sample --interactive`'s `/KEY VALUE` take.

    Args:
        raw: the value's text.
        what: how messages name the whole input, e.g. `--set 'model.n_head=['`.
        quoted: the input with its value quoted, for the message that suggests quoting it.

    Raises:
        ConfigError: the text is not YAML, or is a list or mapping.
    """
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError) as exc:
        problem = (
            getattr(exc, "problem", None)
            or getattr(exc, "reason", None)
            or ("nested too deeply" if isinstance(exc, RecursionError) else "invalid YAML")
        )
        raise ConfigError(
            f"{what}: the value is not a YAML scalar ({problem}); quote it, for example {quoted}."
        ) from None
    if isinstance(value, (dict, list)):
        raise ConfigError(
            f"{what}: the value must be a single scalar (number, string, true/false, null), "
            "not a list or mapping."
        )
    return value


def config_from_dict(raw: Any, name: str = "run") -> Config:
    """Build and validate a `Config` from parsed YAML (a mapping of sections)."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"a config must be a mapping with the sections {', '.join(SECTIONS)}; "
            f"got {type(raw).__name__} ({_short(raw)})."
        )
    for key in raw:
        if key not in SECTIONS:
            hint = did_you_mean(str(key), SECTIONS)
            raise ConfigError(
                f"unknown config section '{key}'.{hint} The sections are {', '.join(SECTIONS)}."
            )
    raw = with_objective_defaults(raw)
    config = Config(
        **{section: _build_section(section, raw.get(section)) for section in SECTIONS},
        name=name,
    )
    config.validate()
    return config


def _build_section(section: str, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config section '{section}' must be a mapping of keys to values, "
            f"not {type(raw).__name__} ({_short(raw)})."
        )
    return _build_fields(section, SECTIONS[section], raw)


def _build_fields(section: str, cls: type, raw: dict) -> Any:
    """`cls` built from the mapping `raw`, each value checked against its annotation; `section`
    names the mapping in messages (`train`, or `train.lora` for a mapping inside one)."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if not isinstance(key, str) or key not in known:
            hint = did_you_mean(str(key), known, f" Did you mean '{section}.{{}}'?")
            raise ConfigError(
                f"unknown key '{section}.{key}'.{hint} Known keys in '{section}': "
                f"{', '.join(known)}."
            )
        nested = _nested_class(hints[key])
        if nested is not None and isinstance(value, dict):
            values[key] = _build_fields(f"{section}.{key}", nested, value)
            continue
        ok, converted = _coerce(hints[key], value)
        if not ok:
            raise ConfigError(
                f"{section}.{key} must be {_type_name(hints[key])}, got {_short(value)} "
                f"({type(value).__name__})."
            )
        values[key] = converted
    return cls(**values)


def _nested_class(tp: Any) -> type | None:
    """The settings class of a key that holds a mapping (`LoraConfig | None`), else None."""
    for arg in (tp, *typing.get_args(tp)):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _coerce(tp: Any, value: Any) -> tuple[bool, Any]:
    """Check `value` against the annotation `tp`; returns (ok, value converted)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, converted = _coerce(arg, value)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        return (type(value) is str and value in typing.get_args(tp)), value
    if origin is list:
        (item,) = typing.get_args(tp)
        if type(value) is not list:
            return False, value
        converted = [_coerce(item, v) for v in value]
        return all(ok for ok, _ in converted), [v for _, v in converted]
    if tp is float:
        return _coerce_float(value)
    if tp in (type(None), bool, int, str):  # exactly that type: True is not an int
        return type(value) is tp, value
    if dataclasses.is_dataclass(tp):  # a mapping was built by _build_fields; not a mapping
        return False, value
    raise TypeError(f"unsupported config annotation {tp!r}")


def _coerce_float(value: Any) -> tuple[bool, Any]:
    """A float setting takes a finite int or float, or a number YAML left as a string."""
    # PyYAML reads `1e-3` (no dot) as a string under YAML 1.1: accept such numbers.
    if type(value) is str and _FLOAT_RE.fullmatch(value.strip()):
        value = float(value)
    if type(value) is int and abs(value) > 2**1023:  # beyond any float: not a number here
        return False, value
    if type(value) in (int, float) and math.isfinite(value):
        return True, float(value)
    return False, value


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('a ')}s"
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _short(value: Any, limit: int = 60) -> str:
    # reprlib bounds the work: a YAML alias bomb ("billion laughs") has an exponential repr.
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60


def dump_yaml(config: Config) -> str:
    """The fully resolved config as YAML text, sections in their usual order."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False)
