"""Checkpoint tiers of the train job (``checkpoint.fast_tier``): every save commits to a fast
directory and returns; every ``drain_every``-th committed save is copied in the background,
verified against its checksums, to ``checkpoint.dir`` (the durable tier) and committed there by
that store's commit. Each tier keeps its own ``keep_last``. ``checkpoint.resume=latest`` takes
the newest checkpoint committed in either tier, the fast tier's copy when it is whole on every
rank, else the next newest (the durable tier's when a node's fast tier is gone); a copy that then
fails its checksums while it loads gives way to the next whole one (the durable copy of the step).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from . import dcp
from .dcp.tools import apply_retention, get_logger, join_location, list_checkpoints

log = get_logger(__name__)


@dataclass(frozen=True)
class Candidate:
    tier: str  # fast | durable
    name: str
    step: int
    path: str


def whole_here(path: str) -> str | None:
    """None when every file ``path``'s metadata names is here at its recorded size; else why not
    (what this rank sees: on a node that lost its fast tier, the files are missing)."""
    try:
        md = dcp.read_metadata(path)
    except dcp.HpdcpError as e:
        return str(e).splitlines()[0]
    names = {n: f.size for n, f in md.files.items()}
    if md.index is not None:
        names[md.index.recorded["file"]] = md.index.recorded["size"]
    for name, size in sorted(names.items()):
        try:
            got = os.stat(os.path.join(path, name)).st_size
        except OSError:
            return f"{name} is missing"
        if got != size:
            return f"{name} has {got} bytes, metadata.json records {size}"
    return None


def _everyone_agrees(ok: bool) -> bool:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _from_rank0(obj: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)  # (our own listing: names and steps, never checkpoint data)
    return box[0]


class Tiers:
    """The fast and durable tiers of one train job, and the drains between them."""

    def __init__(self, ctx: Any) -> None:
        c = ctx.cfg.checkpoint
        self.ctx = ctx
        self.fast = ctx.abspath(c.fast_tier.dir)
        self.durable = ctx.checkpoint_dir
        self.keep_fast, self.keep_durable = c.fast_tier.keep_last, c.keep_last
        self.every = c.fast_tier.drain_every
        self.series = ctx.series[1]
        self.rank = ctx.info.rank
        e = ctx.engine
        self.drainer = dcp.Drainer(timeout=e.timeout_s, store_options=e.store, fsync=e.fsync,
                                   overwrite=c.overwrite)
        self.durable_after: dict[str, float] = {}
        self._retention_lock = threading.Lock()  # commits (a save's thread) and drains land concurrently

    def candidates(self) -> list[Candidate]:
        """Rank 0's listing of both tiers, newest step first, the fast tier first on a tie."""
        out = []
        if self.rank == 0:
            for tier, d in (("fast", self.fast), ("durable", self.durable)):
                for e in list_checkpoints(d, self.series):
                    out.append(Candidate(tier, e.name, e.step if e.step is not None else -1, join_location(d, e.name)))
            out.sort(key=lambda x: (-x.step, x.tier != "fast"))
        return [Candidate(*x) for x in _from_rank0([(x.tier, x.name, x.step, x.path) for x in out])]

    def whole(self) -> Iterator[Candidate]:
        """The checkpoints committed in some tier and whole where they are read, newest first: a
        fast-tier copy counts only when every rank finds all its files (checked on every rank,
        agreed); the durable tier's copy of the same step follows it (what a resume falls back to
        when the fast copy then fails its checksums)."""
        for cand in self.candidates():
            if cand.tier == "durable":
                yield cand
                continue
            why = whole_here(cand.path)
            if _everyone_agrees(why is None):
                yield cand
                continue
            log.warning("checkpoint.resume=latest: %s in the fast tier is not whole on every rank%s; trying the next "
                        "newest", cand.path, f" (here: {why})" if why else "")

    def _retain_fast(self, *keep: str) -> None:
        """The fast tier's retention (rank 0): checkpoints a drain still reads are kept, and so
        is ``keep`` (the one just committed). Run after each commit and after each drain lands,
        so a checkpoint kept only while it drained goes once it has landed."""
        if self.rank != 0 or self.keep_fast <= 0:
            return
        with self._retention_lock:
            busy = {os.path.basename(p) for p in self.drainer.busy()}
            apply_retention(self.fast, self.keep_fast, series=self.series, keep=busy | set(keep))

    def committed(self, name: str, step: int, save_index: int, started: float | None = None) -> None:
        """After the fast tier committed ``name`` (any thread): its retention, then the drain if due."""
        self._retain_fast(name)
        if save_index % self.every:
            return
        self.drainer.submit(os.path.join(self.fast, name), join_location(self.durable, name),
                            callback=lambda md: self._landed(name, started))

    def _landed(self, name: str, started: float | None) -> None:
        if started is not None:  # from the start of the save to its commit in the durable tier
            self.durable_after[name] = time.perf_counter() - started
        if self.rank == 0 and self.keep_durable > 0:
            apply_retention(self.durable, self.keep_durable, series=self.series, keep=[name])
        self._retain_fast()  # (the drainer may still list this one as busy: finish() runs it again)

    def finish(self) -> dict[str, Any]:
        """Wait for every drain to land or fail (the job does not exit before); what happened."""
        responses = self.drainer.close()
        self._retain_fast()  # nothing drains any more: what was kept only for a drain goes
        outcome: dict[str, Any] = {}
        failed = []
        for r in responses:
            name = os.path.basename(r.source)
            err = r.exception()
            if err is None:
                outcome[name] = {"tier": "durable", "seconds": round(r.persist_seconds or 0.0, 4),
                                 "waited_s": round(r.staging_seconds, 4)}
                if name in self.durable_after:
                    outcome[name]["durable_after_s"] = round(self.durable_after[name], 4)
            else:
                outcome[name] = {"tier": "fast only", "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
                failed.append(name)
        if failed:
            log.error("drains to %s failed for %s (still in the fast tier %s)", self.durable, ", ".join(failed),
                      self.fast)
        elif responses:
            log.info("every drain landed in %s: %s", self.durable, ", ".join(outcome))
        return outcome

    def listing(self) -> dict[str, list[str]]:
        return {tier: [e.name for e in list_checkpoints(d, self.series)]
                for tier, d in (("fast", self.fast), ("durable", self.durable))}
