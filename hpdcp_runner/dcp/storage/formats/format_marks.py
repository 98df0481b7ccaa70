"""What the files of a directory say about the format of the checkpoint in it, for the one format
detector (``foreign.detect_format``) and the readers of each format: kept apart from the readers
so that detecting a format never imports one."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..location import Location

#: DeepSpeed: the run directory's tracker, naming the newest step directory (``global_step<N>``),
#: and the one ``ds_to_universal`` writes beside it, naming the universal checkpoint it made
DS_TRACKER = "latest"
DS_UNIVERSAL_TRACKER = "latest_universal"
DS_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_DS_MODEL3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_DS_MODEL12 = re.compile(r"mp_rank_(\d+)_model_states\.pt")
#: Megatron-Core: the run directory's tracker (an iteration number or ``release``) and the
#: iteration directory's ``metadata.json`` naming its sharded backend
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_MARKER = "metadata.json"
#: Megatron-LM's legacy format (``--ckpt-format torch``): in the iteration directory, one directory
#: per model-parallel rank, ``mp_rank_<TP>[_<PP>][_<EP>]``, each holding ``model_optim_rng.pt``
MEGATRON_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
MEGATRON_RANK_FILE = "model_optim_rng.pt"
_OTHER_FORMATS = {"metadata.json", ".metadata", "model.safetensors", "model.safetensors.index.json"}


def is_deepspeed_step(names: set[str]) -> bool:
    """A DeepSpeed step directory holds model-states and optimizer-states archives."""
    return any(_DS_MODEL12.fullmatch(n) or _DS_MODEL3.fullmatch(n) for n in names) and \
        any(DS_OPTIM.fullmatch(n) for n in names)


def is_deepspeed_universal(names: set[str]) -> bool:
    """A universal checkpoint (``ds_to_universal``'s output): the model states copied from the
    step it was made from, no optimizer-states archive (its state is in ``zero/<param>/``), and
    no checkpoint of another format beside it."""
    return any(_DS_MODEL12.fullmatch(n) or _DS_MODEL3.fullmatch(n) for n in names) and \
        not any(DS_OPTIM.fullmatch(n) for n in names) and not names & _OTHER_FORMATS


def is_deepspeed_run(names: set[str]) -> bool:
    """A run directory: a ``latest`` (or only a ``latest_universal``) file and no checkpoint of
    another format beside it."""
    return bool({DS_TRACKER, DS_UNIVERSAL_TRACKER} & names) and not names & _OTHER_FORMATS


def is_megatron_run(names: set[str]) -> bool:
    return MEGATRON_TRACKER in names


def megatron_rank_dirs(dirs: list[str]) -> list[str]:
    """The legacy format's rank directories among ``dirs`` (none: not that format)."""
    return [d for d in dirs if MEGATRON_RANK_DIR.fullmatch(d)]


def backend_of(loc: "Location", names: set[str]) -> str | None:
    """The ``sharded_backend`` a Megatron ``metadata.json`` here names (None: not Megatron's)."""
    if MEGATRON_MARKER not in names or ".metadata" not in names:
        return None
    try:
        doc = json.loads((loc.read_small(MEGATRON_MARKER, 1 << 16) or b"{}").decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    backend = doc.get("sharded_backend") if isinstance(doc, dict) else None
    return str(backend) if backend is not None else None
