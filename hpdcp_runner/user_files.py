"""Files a user hands the runner (``layout.file``) are untrusted input: read with a size bound,
YAML without anchors or aliases (a few lines of nested aliases expand to gigabytes: the "billion
laughs") and with a depth bound, and errors that name a line, never echo content (a file that
holds, or links to, a secret must not print it). A model's ``config.json`` goes through the
engine's strict JSON parser (``tools.parse_json``)."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from .dcp import ConfigError

MAX_USER_FILE_BYTES = 1 << 20
MAX_DEPTH = 32


def read_bounded(path: str, what: str) -> bytes:
    """The bytes of a regular file of at most ``MAX_USER_FILE_BYTES``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_USER_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{what}: no file {path}") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_USER_FILE_BYTES:
        raise ConfigError(f"{what}: {path} is over {MAX_USER_FILE_BYTES} bytes; a layout or config is a few KiB")
    return data


def load_yaml_mapping(path: str, what: str) -> tuple[dict, dict[str, int]]:
    """(the mapping a YAML file holds, {top-level key: its line}); no anchors or aliases, bounded
    depth; one-line errors naming the line, not the text."""
    import yaml

    text = read_bounded(path, what).decode("utf-8", errors="replace")
    depth = 0
    try:
        for ev in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None):
                raise ConfigError(f"{what}: {path}, line {ev.start_mark.line + 1}: YAML anchors and aliases are not "
                                  f"allowed here (write the values out)")
            if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise ConfigError(f"{what}: {path}, line {ev.start_mark.line + 1}: nested deeper than {MAX_DEPTH}")
            elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{what}: {path} is not valid YAML{where}: {getattr(e, 'problem', None) or 'syntax error'}") \
            from None
    if not isinstance(raw, dict) or not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{what}: {path} must hold a mapping of fields (it holds a {type(raw).__name__})")
    lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return raw, lines


def unknown_field(path: str, what: str, key: Any, line: int | None, fields: list[str], section: str = "") -> ConfigError:
    """A key the schema lacks: named only when it is close to a real field (then it is a typo, not
    content), else by its line."""
    near = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.75) if isinstance(key, str) else []
    where = f", line {line}" if line else ""
    head = f"{what}: {path}{where}: "
    if near:
        return ConfigError(f"{head}unknown field {section + key!r}; did you mean {section + near[0]!r}?")
    return ConfigError(f"{head}a field {section or 'at the top level '}that is not one of {', '.join(fields)}")


def field_names(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]
