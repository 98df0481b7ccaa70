"""Checkpoint tiers of the train job (``checkpoint.fast_tier``): every save commits to a fast
directory and returns; every ``drain_every``-th committed save is copied in the background,
verified against its checksums, to ``checkpoint.dir`` (the durable tier) and committed there by
that store's commit. Each tier keeps its own ``keep_last``. ``checkpoint.resume=latest`` takes
the newest checkpoint committed in either tier, the fast tier's copy when it is whole on every
rank, else the next newest (the durable tier's when a node's fast tier is gone); a copy that then
fails its checksums while it loads gives way to the next whole one (the durable copy of the step).

``checkpoint.fast_tier.node_local=true``: the directory is each node's own disk. Each node holds
its ranks' files (``dcp.node_tier``); after every commit a background thread of its own gives
the other nodes their part, applies each node's retention and sends each node's part to
``replicas`` other nodes; ``resume=latest`` makes every node's copy of the newest restorable
checkpoint whole (from its own disk, the peers' replicas, then the durable tier) and loads it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
import torch.distributed as dist

from . import dcp
from .dcp.tools import Comm, apply_retention, get_logger, join_location, list_checkpoints, node_tier

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
        t = c.fast_tier
        self.node_local = bool(t.node_local)
        self.replicas = int(t.replicas) if self.node_local else 0
        self.fast_id = t.dir  # as configured: the same on every node (its directory may differ)
        self.comm = comm = Comm.create(None, e.timeout_s)
        self.nodes = node_tier.Nodes.discover(comm)
        node = self.nodes.node_of[self.rank]
        self.leader = self.nodes.leader(node) == self.rank
        if self.node_local and self.replicas >= self.nodes.count:
            raise dcp.ConfigError(f"checkpoint.fast_tier.replicas={self.replicas}: each node's part goes to that many "
                                  f"other nodes, and this job has {self.nodes.count} node(s); set it below "
                                  f"{self.nodes.count} (0: no replicas)")
        node_tier.check_sharing(comm, self.nodes, self.fast, self.node_local, "checkpoint.fast_tier.node_local",
                                shown=f"checkpoint.fast_tier.dir={t.dir}")
        self.drainer = dcp.Drainer(timeout=e.timeout_s, store_options=e.store, fsync=e.fsync,
                                   overwrite=c.overwrite)
        self.durable_after: dict[str, float] = {}
        self._retention_lock = threading.Lock()  # commits (a save's thread) and drains land concurrently
        self.restored: dict[str, Any] | None = None
        self.set_aside: list[str] = []
        #: node-local resume: path -> the files this rank's load reads (None: cannot tell), set by the job
        self.probe: Any = None
        self.restore_phases: dict[str, float] = {}
        self.replication: dict[str, dict[str, Any]] = {}
        self.worker = node_tier.Background(e.timeout_s) if self.node_local else None

    def candidates(self) -> list[Candidate]:
        """Rank 0's listing of both tiers, newest step first, the fast tier first on a tie."""
        out = []
        if self.rank == 0:
            for tier, d in (("fast", self.fast), ("durable", self.durable)):
                for e in list_checkpoints(d, self.series):
                    out.append(Candidate(tier, e.name, e.step if e.step is not None else -1, join_location(d, e.name)))
            out.sort(key=lambda x: (-x.step, x.tier != "fast"))
        return [Candidate(*x) for x in _from_rank0([(x.tier, x.name, x.step, x.path) for x in out])]

    def _durable_listing(self) -> dict[str, Candidate]:
        out = []
        if self.rank == 0:
            out = [(e.name, e.step if e.step is not None else -1) for e in list_checkpoints(self.durable, self.series)]
        return {n: Candidate("durable", n, s, join_location(self.durable, n)) for n, s in _from_rank0(out)}

    def whole_across_nodes(self) -> Iterator[Candidate]:
        """Node-local: the newest checkpoint every file of which some node holds (or the durable
        tier's copy of it does), made whole on every node before it is yielded; durable-only
        checkpoints in their order. Says in one line where each node's files came from."""
        comm = self.comm
        found = node_tier.survey(comm, self.nodes, self.fast, self.series)
        durable = self._durable_listing()
        steps = {n: next(iter(h.values())).step for n, h in found.items()}
        steps.update({n: c.step for n, c in durable.items() if n not in steps})
        broken: list[str] = []
        for name in sorted(steps, key=lambda n: (-steps[n], n not in found)):
            if name not in found:
                self._set_aside(comm, broken)
                yield durable[name]
                continue
            plan = node_tier.plan_restore(found[name], self.nodes, name in durable)
            if plan is None:
                log.warning("checkpoint.resume=latest: %s is not whole on the nodes (a file is on no node) and the "
                            "durable tier has no copy; trying the next newest", name)
                broken.append(name)
                continue
            self._set_aside(comm, broken)
            t0 = time.perf_counter()
            reader = None
            if any(src < 0 for n, moves in plan.moves.items() for _, src in moves
                   if self.nodes.leader(n) == self.rank):
                reader = self.ctx.reader(durable[name].path)
                reader.read_metadata_text()
            try:
                plan = self._fetch(comm, plan, reader)
            finally:
                if reader is not None:
                    reader.close()
            summary = plan.summary(self.nodes)
            self.restored = {"checkpoint": name, "step": plan.step, "fetch_s": round(time.perf_counter() - t0, 4),
                             **self.restore_phases, "parts": summary}
            log.info("checkpoint.resume=latest: %s from the node-local tier: %s", name,
                     "; ".join(f"{node}: " + ", ".join(f"{v} {k}" for k, v in got.items())
                               for node, got in summary.items()))
            yield Candidate("fast", name, plan.step, os.path.join(self.fast, name))
            if name in durable:
                yield durable[name]

    def _fetch(self, comm: Comm, plan: Any, reader: Any) -> Any:
        """Make every node's copy of ``plan``'s checkpoint readable: first what every copy needs
        (metadata.json, the chunk index), then, when ``probe`` can tell, only the files each
        node's ranks will read (else every file it lacks), a file they read little of only in
        the ranges they read; a file only the durable copy holds is read from it once and sent
        on. Returns the plan carried out."""
        fsync, group = self.ctx.engine.fsync, self.drainer.group
        t0 = time.perf_counter()
        first = plan.restrict({n: () for n in range(self.nodes.count)}, always=plan.essential).share_durable_reads()
        node_tier.fetch(comm, self.nodes, self.fast, first, group, durable=reader, fsync=fsync)
        t1 = time.perf_counter()
        wanted: dict[int, Any] = {}
        ranges: dict[int, Any] = {}
        if self.probe is not None:  # each rank: the files it reads, and which bytes of them
            got = comm.all_gather_json(self.probe(os.path.join(self.fast, plan.name)), "node tier: files wanted")
            wanted, ranges = node_tier.wanted_by_node(self.nodes, got, plan.files)
        rest = replace(plan, moves={n: tuple(m for m in mv if m[0] not in plan.essential)
                                    for n, mv in plan.moves.items()})
        second = rest.restrict(wanted, ranges=ranges).share_durable_reads()
        t2 = time.perf_counter()
        node_tier.fetch(comm, self.nodes, self.fast, second, group, durable=reader, fsync=fsync)
        self.restore_phases = {"metadata_s": round(t1 - t0, 4), "plan_s": round(t2 - t1, 4),
                               "files_s": round(time.perf_counter() - t2, 4)}
        merged = {n: first.moves.get(n, ()) + second.moves.get(n, ()) for n in range(self.nodes.count)}
        return replace(plan, moves={n: m for n, m in merged.items() if m}, skipped=second.skipped,
                       ranges=second.ranges)

    def _set_aside(self, comm: Comm, broken: list[str]) -> None:
        """Parts of newer checkpoints no copy completes would block the next save of their step."""
        if broken:
            node_tier.set_aside(comm, self.nodes, self.fast, broken)
            self.set_aside = list(broken)
            broken.clear()

    def whole(self) -> Iterator[Candidate]:
        """The checkpoints committed in some tier and whole where they are read, newest first: a
        fast-tier copy counts only when every rank finds all its files (checked on every rank,
        agreed); the durable tier's copy of the same step follows it (what a resume falls back to
        when the fast copy then fails its checksums)."""
        if self.node_local:
            yield from self.whole_across_nodes()
            return
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
        if not self.leader or self.keep_fast <= 0 or (self.rank != 0 and not self.node_local):
            return
        with self._retention_lock:
            busy = {os.path.basename(p) for p in self.drainer.busy()}
            apply_retention(self.fast, self.keep_fast, series=self.series, keep=busy | set(keep))

    def target(self, name: str) -> tuple[str, Any]:
        """(the checkpoint id, the writer or None) of the save of ``name`` to the fast tier; a
        node-local one is named as configured (one name on every node) and written to this
        node's own directory."""
        path = join_location(self.fast, name)
        if not self.node_local:
            return path, None
        e = self.ctx.engine
        return join_location(self.fast_id, name), dcp.FileSystemWriter(path, fsync=e.fsync, node_local=True)

    def reader_for(self, path: str) -> Any:
        """The reader of a resume candidate: a node-local copy is read on every node from its own disk."""
        if self.node_local and os.path.dirname(path) == self.fast:
            return node_tier.NodeLocalReader(path)
        return None

    def committed(self, name: str, step: int, save_index: int, started: float | None = None,
                  token: str | None = None) -> None:
        """After the fast tier committed ``name`` (any thread): its retention, then the drain if
        due; node-local: first the other nodes' parts and the replicas, in the background."""
        if self.worker is not None:
            self.worker.submit(lambda comm: self._spread(comm, name, save_index, started, token))
            return
        self._retain_fast(name)
        self._drain_if_due(name, save_index, started)

    def _drain_if_due(self, name: str, save_index: int, started: float | None) -> None:
        if save_index % self.every:
            return
        self.drainer.submit(os.path.join(self.fast, name), join_location(self.durable, name),
                            callback=lambda md: self._landed(name, started))

    def _spread(self, comm: Comm, name: str, save_index: int, started: float | None, token: str | None) -> None:
        """Node-local (the tiers' own thread, every rank): publish every node's part, retention on
        each node, the replicas, then the drain if due."""
        t0 = time.perf_counter()
        path = os.path.join(self.fast, name)
        out: dict[str, Any] = {}
        self.replication[name] = out
        e = self.ctx.engine
        table = node_tier.publish_parts(comm, self.nodes, path, token or "", overwrite=self.ctx.cfg.checkpoint.overwrite,
                                     fsync=e.fsync)
        self._retain_fast(name)
        if self.replicas:
            stats = node_tier.replicate(comm, self.nodes, path, table, self.replicas, comm.group, fsync=e.fsync)
            out["moved"] = {k: v for k, v in stats.items() if v}
        out["seconds"] = round(time.perf_counter() - t0, 4)
        out["replicas"] = self.replicas
        self._drain_if_due(name, save_index, started)

    def _landed(self, name: str, started: float | None) -> None:
        if started is not None:  # from the start of the save to its commit in the durable tier
            self.durable_after[name] = time.perf_counter() - started
        if self.rank == 0 and self.keep_durable > 0:
            apply_retention(self.durable, self.keep_durable, series=self.series, keep=[name])
        self._retain_fast()  # (the drainer may still list this one as busy: finish() runs it again)

    def close(self, timeout: float | None = None) -> None:
        if self.worker is not None:
            self.worker.close(timeout)
        self.drainer.close(timeout=timeout)

    def finish(self) -> dict[str, Any]:
        """Wait for every drain to land or fail (the job does not exit before); what happened."""
        if self.worker is not None:
            failures = self.worker.close()
            for name_err in failures:
                log.error("node tier: %s", name_err)
            if failures:
                self.drainer.close()
                raise dcp.HpdcpError(f"the node-local fast tier {self.fast} failed to complete a checkpoint: "
                                     f"{failures[0]}")
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

