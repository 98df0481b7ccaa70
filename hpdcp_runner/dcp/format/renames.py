"""Key renames at load: ordered regex rules applied to a checkpoint's keys before planning, so a
Hugging Face checkpoint loads into torchtitan names (and back) without rewriting any file.

Only the names change: every chunk keeps its stored key and location, so reads are unaffected.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

from ..core.errors import ConfigError, MetadataError
from .metadata import Metadata

Rule = tuple[str, str]


def compile_rules(rules: Iterable[Rule | dict]) -> list[tuple[re.Pattern, str]]:
    """``[(pattern, replace)]`` or ``[{pattern, replace}]`` -> compiled; a bad regex or
    replacement is a ``ConfigError`` naming the rule."""
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, dict):
            if set(rule) != {"pattern", "replace"}:
                raise ConfigError(f"rename rule {i}: needs exactly 'pattern' and 'replace', got {sorted(rule)}")
            pattern, replace = rule["pattern"], rule["replace"]
        else:
            pattern, replace = rule
        if not isinstance(pattern, str) or not isinstance(replace, str):
            raise ConfigError(f"rename rule {i}: pattern and replace must be strings")
        try:
            rx = re.compile(pattern)
            rx.sub(replace, "")  # group references are checked only when used: try them now
        except re.error as e:
            raise ConfigError(f"rename rule {i} ({pattern!r} -> {replace!r}): {e}") from None
        out.append((rx, replace))
    return out


def rename_key(key: str, rules: Sequence[tuple[re.Pattern, str]]) -> str:
    """Every rule in order, each applied to the result of the previous one."""
    for rx, replace in rules:
        key = rx.sub(replace, key)
    return key


def new_key_path(old_path: tuple, new_key: str) -> tuple:
    """Keep the top-level container (``model``, ``optim``) when the new key still starts with it;
    otherwise the key becomes one flat top-level name."""
    if len(old_path) > 1 and isinstance(old_path[0], str) and new_key.startswith(old_path[0] + "."):
        return (old_path[0], new_key[len(old_path[0]) + 1:])
    return (new_key,)


def rename_keys(md: Metadata, rules: Sequence[Rule | dict], *, source: str = "checkpoint") -> Metadata:
    """``md`` with every tensor and object key renamed; two keys renamed onto one name (or onto
    a key that is kept) is a ``MetadataError`` listing every collision."""
    compiled = compile_rules(rules)
    if not compiled:
        return md
    names = {k: rename_key(k, compiled) for k in md.keys()}
    by_new: dict[str, list[str]] = {}
    for old, new in names.items():
        by_new.setdefault(new, []).append(old)
    collisions = sorted((new, olds) for new, olds in by_new.items() if len(olds) > 1)
    if collisions:
        shown = "; ".join(f"{' and '.join(map(repr, olds))} -> {new!r}" for new, olds in collisions[:20])
        more = f" ... ({len(collisions) - 20} more)" if len(collisions) > 20 else ""
        raise MetadataError(f"{source}: rename rules map {len(collisions)} name(s) onto keys of other tensors: "
                            f"{shown}{more}")
    if any(not n for n in names.values()):
        raise MetadataError(f"{source}: rename rules turn {[o for o, n in names.items() if not n][:5]} into empty keys")
    tensors = {names[k]: dataclasses.replace(t, path=new_key_path(t.path, names[k])) for k, t in md.tensors.items()}
    objects = {names[k]: dataclasses.replace(o, path=new_key_path(o.path, names[k])) for k, o in md.objects.items()}
    return dataclasses.replace(md, tensors=tensors, objects=objects)
