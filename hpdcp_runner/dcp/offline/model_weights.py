"""Which tensors of a training checkpoint are the model's weights.

A checkpoint saved from a training loop often holds the optimizer beside the model:
``{"model": model_sd, "optim": optim_sd}`` flattened to ``model.<fqn>`` and
``optim.state.<fqn>.exp_avg`` (torch DCP, ``get_optimizer_state_dict``), or the model's keys at
the top level beside ``optimizer.state.<fqn>.<name>`` (torchtitan). A Hugging Face directory
must hold the model's weights only, under the model's own names. The optimizer state is told
apart by its structure, not by names we guess: a key ``<group>state.<fqn>.<name>`` is optimizer
state when ``<fqn>`` is a tensor of the same checkpoint (possibly under a prefix such as
``model.``). That prefix is then the model's, and is stripped from the names written.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

_STATE = "state."


@dataclass(frozen=True)
class WeightSplit:
    """``names``: kept key -> output name (the model prefix stripped). ``optimizer``: keys of
    optimizer state (every key under a detected optimizer group). ``other``: tensors neither
    (outside the model prefix, e.g. ``train.step``). ``prefix``: the model prefix stripped."""

    names: dict[str, str]
    optimizer: tuple[str, ...]
    other: tuple[str, ...]
    prefix: str
    groups: tuple[str, ...]  # the optimizer groups found ("optim.")

    @property
    def split(self) -> bool:
        return bool(self.optimizer)


def split_model_weights(keys: Iterable[str]) -> WeightSplit:
    """Split ``keys`` (tensor names of one checkpoint) into the model's weights, optimizer state
    and the rest. A checkpoint with no optimizer state keeps every key under its own name."""
    keys = sorted(set(keys))
    # every dotted suffix of every key -> the prefixes it appears under ("a.b.c": c under "a.b.")
    under: dict[str, set[str]] = {}
    for k in keys:
        parts = k.split(".")
        for j in range(len(parts)):
            under.setdefault(".".join(parts[j:]), set()).add(".".join(parts[:j]) + "." if j else "")
    groups: Counter = Counter()
    prefixes: Counter = Counter()
    for k in keys:
        i = k.find(_STATE)
        while i >= 0:
            if i == 0 or k[i - 1] == ".":
                fqn, _, name = k[i + len(_STATE):].rpartition(".")
                group = k[:i]
                # the parameter it is state of: a tensor of this checkpoint outside the group
                found = [p for p in under.get(fqn, ()) if not (p + fqn).startswith(group)] \
                    if group and fqn and name else []
                if group and found:
                    groups[group] += 1
                    prefixes[min(found, key=len)] += 1
                    break
            i = k.find(_STATE, i + 1)
    if not groups:
        return WeightSplit({k: k for k in keys}, (), (), "", ())
    group_list = tuple(sorted(groups))
    optimizer = tuple(k for k in keys if k.startswith(group_list))
    prefix = prefixes.most_common(1)[0][0]
    names: dict[str, str] = {}
    other: list[str] = []
    for k in keys:
        if k.startswith(group_list):
            continue
        if k.startswith(prefix) and len(k) > len(prefix):
            names[k] = k[len(prefix):]
        else:
            other.append(k)
    return WeightSplit(names, optimizer, tuple(other), prefix, group_list)


def describe_split(s: WeightSplit, limit: int = 3) -> str:
    """One sentence on what a split left out (for a log line and the job summary)."""
    def some(xs: tuple[str, ...]) -> str:
        return ", ".join(xs[:limit]) + (", ..." if len(xs) > limit else "")

    parts = [f"{len(s.optimizer)} optimizer-state tensors ({'/'.join(g + '*' for g in s.groups)})"]
    if s.other:
        parts.append(f"{len(s.other)} other tensors outside the model ({some(s.other)})")
    strip = f", '{s.prefix}' stripped from their names" if s.prefix else ""
    return f"kept the model's {len(s.names)} weights{strip}; left out {' and '.join(parts)}"
