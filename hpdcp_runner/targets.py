"""Load targets built from a checkpoint's own metadata, for checkpoints the runner did not write:
every tensor the checkpoint holds, with its saved shape and dtype, placed by ``layout=`` (each
rank allocates only its own shard), and every object as a placeholder the load fills in."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .dcp import ConfigError, Metadata
from .dcp.tools import dtype_from_name, set_element
from .layouts import Placer


def _ensure_path(root: dict, path: tuple) -> None:
    """Create the nested dicts leading to ``path`` (lists become dicts keyed by index)."""
    node = root
    for k in path[:-1]:
        node = node.setdefault(k, {})


def local_bytes(md: Metadata, placer: Placer, keys: Any = None) -> int:
    """Bytes :func:`state_from_metadata` allocates on this rank (for ``keys``, default all)."""
    return sum(placer.local_numel(k, t.shape) * dtype_from_name(t.dtype).itemsize
               for k, t in md.tensors.items() if keys is None or k in keys)


def partly_split_text(partial: Mapping[str, tuple[list[str], list[str]]]) -> str:
    """What ``Placer.partly_split`` found, in words: the first block's split and left-out weights."""
    block, (split, left) = next(iter(partial.items()))
    names = lambda ks: ", ".join(k[len(block) + 1:] for k in ks[:4]) + (" ..." if len(ks) > 4 else "")  # noqa: E731
    return (f"splits {len(partial)} block(s) only in part, so a tensor-parallel forward cannot use it: in {block!r} "
            f"{names(split)} are split while {names(left)} fall to the default (replicated); add rules for them, "
            f"or choose a layout without tensor parallelism")


def state_from_metadata(md: Metadata, placer: Placer, *, strict: bool | None = None,
                        only: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The nested load target for every key of ``md`` (that ``only`` admits) under ``placer``'s
    layout. Unless ``strict`` is False, a block the layout splits only in part is an error (a
    tensor-parallel forward could not use it); with ``strict`` True, so are tensors that no rule
    names (one error listing them all) and tensors two rules place differently."""
    if strict is not False:
        partial = placer.partly_split({k: t.shape for k, t in md.tensors.items()})
        if partial:
            raise ConfigError(f"layout {placer.layout.name!r} {partly_split_text(partial)} (layout.strict=false "
                              f"accepts it)")
    if strict:
        unmatched = placer.unmatched(sorted(k for k, t in md.tensors.items() if t.shape))
        if unmatched:
            shown = ", ".join(repr(k) for k in unmatched[:20])
            more = f" ... ({len(unmatched) - 20} more)" if len(unmatched) > 20 else ""
            raise ConfigError(f"layout.strict: no rule of layout {placer.layout.name!r} names {len(unmatched)} "
                              f"tensor(s): {shown}{more}; add rules for them or set layout.strict=false")
        for k in sorted(md.tensors):
            clash = placer.clashing_rules(k)
            if clash:
                i, j = clash
                raise ConfigError(f"layout.strict: {k!r} is matched by rules[{i}] ({placer.layout.rules[i].pattern!r}) "
                                  f"and by rules[{j}] ({placer.layout.rules[j].pattern!r}), which place it "
                                  f"differently; the first wins unless strict: narrow one of the patterns")
    root: dict[str, Any] = {}
    for k, t in sorted(md.tensors.items()):
        if only is not None and not only(k):
            continue
        value = placer.empty(k, t.shape, dtype_from_name(t.dtype))
        if value is None:  # another expert-parallel group's expert: this rank holds none of it
            continue
        _ensure_path(root, t.path)
        set_element(root, t.path, value)
    for k, o in sorted(md.objects.items()):
        _ensure_path(root, o.path)
        set_element(root, o.path, None)
    return root
