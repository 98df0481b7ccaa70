"""Checkpoints in node-local directories: each node holds its own ranks' files, replicated to
peer nodes over the job's process group, and restored from whatever copy survives.

A node-local directory is the same path on every node, seen by that node only (a local NVMe or
RAM disk). A checkpoint there is every node's *part*: the node's ranks' files plus the
checkpoint's ``metadata.json`` and chunk index. The save itself is the engine's save with a
``FileSystemWriter(node_local=True)``: each rank writes into its own node's staging directory of
the same name, and the coordinator commits node 0's part. :func:`publish_parts` then gives every
other node the metadata and renames its part into place. A part alone is never a checkpoint:
:func:`survey` tells a checkpoint whole only when every file it names is on some node.

:func:`replicate` sends each node's own files to its ``k`` partner nodes (the next ``k`` nodes,
so a replica never sits on its own node); they land in the partner's committed directory of the
same checkpoint, each verified against its recorded checksum before it takes its name.
:func:`fetch` makes every node's directory whole again before a load: a missing file comes from
the lowest node that holds it, or from the durable tier's copy of the same checkpoint when no
node does.

Everything here is collective over a ``Comm`` (every rank calls it in the same order); files
move between the nodes' leaders (their lowest rank) by point-to-point sends of 8 MiB blocks,
every pair of nodes at once (``node_moves``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

import torch.distributed as dist

from .comm.broadcast import node_id
from .comm.collectives import Comm, gloo_group
from .core.errors import ConfigError, CorruptCheckpointError, HpdcpError, MetadataError
from .core.utils import get_logger
from .background.drain import SerialWorker
from .format.metadata import METADATA_FILE, FileMeta, check_file_name, file_table
from .node_moves import RANGES_SUFFIX, Move, copy_from, land, recv_file, run_moves, send_file
from .storage.posix.commit import clear_abandoned, fsync_dir, publish_dir
from .storage.posix.filesystem import FileSystemReader
from .storage.retention import list_checkpoints

log = get_logger(__name__)
PROBE = ".hpdcp-node-probe-"
SPAN_GAP = 1 << 20  # ranges closer than this are fetched as one
RANGED_BELOW = 0.5  # a file its node's ranks read less of than this share is fetched in ranges


@dataclass(frozen=True)
class Nodes:
    """Which node each rank is on (nodes numbered in the order of their lowest rank)."""

    node_of: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.names)

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, node: int) -> int:
        return self.node_of.index(node)

    def partners(self, node: int, k: int) -> list[int]:
        """The nodes that hold ``node``'s replicas: the next ``k`` in a ring."""
        return [(node + i) % self.count for i in range(1, k + 1)]

    @classmethod
    def discover(cls, comm: Comm) -> "Nodes":
        keys = comm.all_gather_json(node_id(), "node tier: node names")
        order: list[str] = []
        for k in keys:
            if k not in order:
                order.append(k)
        return cls(tuple(order.index(k) for k in keys), tuple(order))


def check_sharing(comm: Comm, nodes: Nodes, directory: str, node_local: bool, key: str,
                  shown: str | None = None) -> None:
    """Refuse a directory declared node-local that every node in fact sees (a shared file system),
    or declared shared that some node does not see: each node's leader leaves a file there and
    looks for the others'. Raises the same ``ConfigError`` on every rank (``shown``: the
    directory as the user named it, the same on every node)."""
    if nodes.count < 2:
        return
    node = nodes.node_of[comm.rank]
    leader = nodes.leader(node) == comm.rank
    name = f"{PROBE}{uuid.uuid4().hex}" if leader else ""

    def leave() -> str:
        if leader:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, name), "w") as f:
                f.write(nodes.names[node])
        return name

    names = comm.agree(f"node tier: a file left in {directory}", leave)
    try:
        seen = [n for r, n in enumerate(names) if n and nodes.node_of[r] != node and
                os.path.exists(os.path.join(directory, n))] if leader else []
        views = comm.all_gather_json([leader, len(seen)], "node tier: sharing probe")
    finally:
        if leader:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
    others = nodes.count - 1
    shared = [nodes.names[nodes.node_of[r]] for r, (lead, n) in enumerate(views) if lead and n == others]
    apart = [nodes.names[nodes.node_of[r]] for r, (lead, n) in enumerate(views) if lead and n < others]
    shown = shown or directory
    if node_local and shared:
        raise ConfigError(f"{key}=true, but {shown} is shared: {shared[0]} sees the other nodes' files there; "
                          f"a node-local tier must be each node's own disk (set {key}=false for a shared one)")
    if not node_local and apart:
        raise ConfigError(f"{shown} is not shared between the nodes: {apart[0]} does not see the other nodes' "
                          f"files there; declare it node-local ({key}=true) or give a directory every node sees")


@dataclass(frozen=True)
class Table:
    """A checkpoint's files as its ``metadata.json`` names them (``format.metadata.file_table``)."""

    text: str
    files: Mapping[str, FileMeta]
    index: Mapping[str, Any] | None

    @classmethod
    def parse(cls, text: str, path: str) -> "Table":
        files, index = file_table(text, os.path.join(path, METADATA_FILE))
        return cls(text, files, index)

    @property
    def index_name(self) -> str | None:
        return self.index["file"] if self.index is not None else None


def _expected(table: "Table") -> dict[str, tuple[int, str]]:
    """Every file of the checkpoint: name -> (size, checksum); ``metadata.json`` by its digest."""
    text = table.text
    out = {n: (f.size, f.checksum) for n, f in table.files.items()}
    if table.index is not None:
        out[table.index["file"]] = (table.index["size"], table.index["checksum"])
    out[METADATA_FILE] = (len(text.encode()), "sha256:" + hashlib.sha256(text.encode()).hexdigest())
    return out


# -- the save's second half -----------------------------------------------------------------
def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def publish_parts(comm: Comm, nodes: Nodes, path: str, token: str, *, overwrite: bool = False,
                  fsync: bool = True) -> Table:
    """After the engine's save of ``path`` committed node 0's part: every other node's leader
    checks its ranks' files in its staging directory ``token`` (a name beside ``path``), writes
    the coordinator's chunk index and ``metadata.json`` there, and renames it to ``path``. The
    same outcome (or error) on every rank; returns the checkpoint's file table."""

    def read() -> dict:
        text = _read(os.path.join(path, METADATA_FILE)).decode()
        table = Table.parse(text, path)
        size = os.stat(os.path.join(path, table.index_name)).st_size if table.index_name else 0
        return {"text": text, "index_size": size}

    got = comm.agree_root("node tier: metadata", read)
    table = Table.parse(got["text"], path)
    index = comm.broadcast_bytes(_read(os.path.join(path, table.index_name))
                                 if comm.rank == 0 and table.index_name else None, "node tier: chunk index")
    node = nodes.node_of[comm.rank]

    def publish() -> None:
        if node == 0 or nodes.leader(node) != comm.rank:
            return
        parent = os.path.dirname(path)
        staging = os.path.join(parent, token)
        if len(index) != got["index_size"]:
            raise CorruptCheckpointError(f"{path}: the chunk index arrived with {len(index)} bytes, not "
                                         f"{got['index_size']}")
        mine = set(nodes.ranks(node))
        for name, f in sorted(table.files.items()):
            if f.rank in mine:
                got_size = os.stat(os.path.join(staging, name)).st_size
                if got_size != f.size:
                    raise CorruptCheckpointError(f"{staging}/{name}: {got_size} bytes, the save recorded {f.size}")
        for name, body in ((table.index_name, index), (METADATA_FILE, table.text.encode())):
            if name is None:
                continue
            with open(os.path.join(staging, name), "xb") as fh:
                fh.write(body)
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
        if fsync:
            fsync_dir(staging)
        publish_dir(staging, path, overwrite=overwrite, fsync=fsync)
        with contextlib.suppress(OSError):
            clear_abandoned(parent)

    comm.agree(f"node tier: publish the parts of {os.path.basename(path)}", publish)
    return table


def replicate(comm: Comm, nodes: Nodes, path: str, table: Table, k: int, group: Any, *,
              fsync: bool = True) -> dict[str, int]:
    """Send each node's own ranks' files of the committed checkpoint ``path`` to its ``k``
    partner nodes (``Nodes.partners``), leader to leader, every node at once (``node_moves.run_moves``);
    each lands in the partner's ``path`` verified. Returns what this rank sent and received
    (files, bytes)."""
    stats = {"files_sent": 0, "bytes_sent": 0, "files_received": 0, "bytes_received": 0}
    expected = _expected(table)
    order = sorted(table.files.items())
    moves = [Move(n, nodes.leader(src_node), nodes.leader((src_node + i) % nodes.count))
             for i in range(1, k + 1) for src_node in range(nodes.count)
             for n, f in order if nodes.node_of[f.rank % len(nodes.node_of)] == src_node]
    refused: list[str] = []

    def send(m: Move) -> None:
        size = expected[m.name][0]
        send_file(os.path.join(path, m.name), size, m.dst, group)
        stats["files_sent"] += 1
        stats["bytes_sent"] += size

    def receive(m: Move) -> None:
        size = expected[m.name][0]
        if refused or os.path.exists(os.path.join(path, m.name)):  # (every block still comes)
            recv_file(None, size, m.src, group)
            if not refused:
                refused.append(m.name)
                raise MetadataError(f"{path}/{m.name} already exists on {nodes.names[nodes.node_of[m.dst]]}")
            return
        land(path, m.name, *expected[m.name], lambda p, check: recv_file(p, size, m.src, group, check, fsync), fsync)
        stats["files_received"] += 1
        stats["bytes_received"] += size

    run_moves(comm, moves, send, receive, f"node tier: replicate {os.path.basename(path)} to {k} peer(s)")
    return stats


# -- restore ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Holding:
    """What one node holds of one checkpoint."""

    name: str
    step: int
    digest: str  # of its metadata.json: one save on every node
    files: Mapping[str, int]  # every file the checkpoint names -> its recorded size
    present: tuple[str, ...]  # those here, whole (at their recorded size)
    essential: tuple[str, ...] = (METADATA_FILE,)  # what every copy needs: metadata.json, the chunk index


def _holdings(directory: str, series: str) -> list[dict]:
    out = []
    for e in list_checkpoints(directory, series):
        path = os.path.join(directory, e.name)
        try:
            text = _read(os.path.join(path, METADATA_FILE)).decode()
            table = Table.parse(text, path)
        except (OSError, HpdcpError, UnicodeDecodeError) as err:
            log.warning("node tier: %s is unreadable here (%s); not counted", path, err)
            continue
        files = {n: s for n, (s, _) in _expected(table).items()}
        present = []
        for n, size in files.items():
            try:
                if os.stat(os.path.join(path, n)).st_size == size:
                    present.append(n)
            except OSError:
                pass
        out.append({"name": e.name, "step": e.step if e.step is not None else -1,
                    "digest": hashlib.sha256(text.encode()).hexdigest(), "files": files, "present": sorted(present),
                    "essential": [METADATA_FILE] + ([table.index_name] if table.index_name else [])})
    return out


def survey(comm: Comm, nodes: Nodes, directory: str, series: str) -> dict[str, dict[int, Holding]]:
    """Every checkpoint of ``series`` on any node's ``directory``: name -> node -> what it holds
    (the same answer on every rank; each node's leader looks at its own disk)."""
    node = nodes.node_of[comm.rank]
    gathered = comm.agree("node tier: survey",
                          lambda: _holdings(directory, series) if nodes.leader(node) == comm.rank else None)
    out: dict[str, dict[int, Holding]] = {}
    for r, held in enumerate(gathered):
        for h in held or []:
            out.setdefault(h["name"], {})[nodes.node_of[r]] = Holding(h["name"], h["step"], h["digest"], h["files"],
                                                                      tuple(h["present"]), tuple(h["essential"]))
    return out


@dataclass(frozen=True)
class RestorePlan:
    """How every node's directory becomes whole: (file, from) per node, ``from`` a node index or
    -1 for the durable tier's copy."""

    name: str
    step: int
    digest: str
    files: Mapping[str, int]
    moves: Mapping[int, tuple[tuple[str, int], ...]]
    essential: tuple[str, ...] = (METADATA_FILE,)
    #: per node, the files it lacks and does not fetch (its ranks read none of them)
    skipped: Mapping[int, int] = field(default_factory=dict)
    #: per node, the files it fetches in part: name -> the byte ranges (the rest of it: holes)
    ranges: Mapping[int, Mapping[str, tuple[tuple[int, int], ...]]] = field(default_factory=dict)

    def restrict(self, wanted: Mapping[int, Iterable[str] | None], *, always: Iterable[str] = (),
                 ranges: Mapping[int, Mapping[str, tuple[tuple[int, int], ...]]] | None = None) -> "RestorePlan":
        """The moves of the files each node wants (None: all), plus ``always``; the rest skipped.
        ``ranges``: of those, the ones fetched in part (``wanted_by_node``)."""
        keep = set(always)
        moves, skipped, parts = {}, {}, {}
        for n, mv in self.moves.items():
            want = wanted.get(n)
            allowed = None if want is None else keep | set(want)
            kept = tuple(m for m in mv if allowed is None or m[0] in allowed)
            if kept:
                moves[n] = kept
            if len(mv) > len(kept):
                skipped[n] = len(mv) - len(kept)
            mine = {f: r for f, r in (ranges or {}).get(n, {}).items() if any(f == m[0] for m in kept)}
            if mine:
                parts[n] = mine
        return replace(self, moves=moves, skipped=skipped, ranges=parts)

    def share_durable_reads(self) -> "RestorePlan":
        """A file no node holds that several nodes fetch is read from the durable copy once, by
        the lowest node that fetches it whole, and sent on from there (``fetch`` runs every
        durable read before the moves between nodes)."""
        readers: dict[str, int] = {}
        for n, mv in sorted(self.moves.items()):
            for f, src in mv:
                if src < 0 and f not in self.ranges.get(n, {}):
                    readers.setdefault(f, n)
        return replace(self, moves={n: tuple((f, readers[f]) if src < 0 and readers.get(f, n) != n else (f, src)
                                             for f, src in mv) for n, mv in self.moves.items()})

    def summary(self, nodes: Nodes) -> dict[str, dict[str, int]]:
        """Per node: how many files it had, how many came from each peer or the durable tier (and
        how many of those only in the ranges its ranks read), and how many it lacked and did not
        need."""
        out = {}
        for n in range(nodes.count):
            skipped = self.skipped.get(n, 0)
            got: dict[str, int] = {"local": len(self.files) - len(self.moves.get(n, ())) - skipped}
            if skipped:
                got["not needed"] = skipped
            for _, src in self.moves.get(n, ()):
                where = "durable" if src < 0 else f"from {nodes.names[src]}"
                got[where] = got.get(where, 0) + 1
            if self.ranges.get(n):
                got["of them in part"] = len(self.ranges[n])
            out[nodes.names[n]] = got
        return out


def wanted_by_node(nodes: Nodes, per_rank: Sequence[Mapping[str, Any] | None], sizes: Mapping[str, int]
                   ) -> tuple[dict[int, set[str] | None], dict[int, dict[str, tuple[tuple[int, int], ...]]]]:
    """From every rank's ``wanted_files`` (by rank): per node, the files its ranks read (None:
    every file) and, of those, the ones to fetch in part: every rank of the node gave its byte
    ranges and together they cover less than ``RANGED_BELOW`` of the file (``sizes``)."""
    wanted: dict[int, set[str] | None] = {}
    spans: dict[int, dict[str, list | None]] = {}
    for r, got in enumerate(per_rank):
        node = nodes.node_of[r]
        if got is None or (node in wanted and wanted[node] is None):
            wanted[node] = None
            continue
        wanted.setdefault(node, set()).update(got)  # type: ignore[union-attr]
        mine = spans.setdefault(node, {})
        for name, sp in got.items():
            if sp is None or mine.get(name, []) is None:
                mine[name] = None
            else:
                mine[name] = [*mine.get(name, []), *(tuple(x) for x in sp)]
    ranges: dict[int, dict[str, tuple[tuple[int, int], ...]]] = {}
    for node, files in spans.items():
        for name, sp in files.items():
            if wanted.get(node) is None or sp is None or name not in sizes:
                continue
            merged = merge_spans(sp)
            if sum(hi - lo for lo, hi in merged) < RANGED_BELOW * sizes[name]:
                ranges.setdefault(node, {})[name] = tuple(merged)
    return wanted, ranges


def plan_restore(holdings: Mapping[int, Holding], nodes: Nodes, durable_has: bool) -> RestorePlan | None:
    """The plan for one checkpoint, or None when some file is on no node and the durable tier has
    no copy of it. Nodes whose metadata differs from the majority's do not count (another save
    of the same name)."""
    digests = [h.digest for h in holdings.values()]
    digest = max(set(digests), key=digests.count)
    held = {n: h for n, h in holdings.items() if h.digest == digest}
    ref = next(iter(held.values()))
    moves: dict[int, list[tuple[str, int]]] = {}
    for n in range(nodes.count):
        have = set(held[n].present) if n in held else set()
        for f in sorted(ref.files):
            if f in have:
                continue
            srcs = [m for m in sorted(held) if f in held[m].present]
            if not srcs and not durable_has:
                return None
            moves.setdefault(n, []).append((f, srcs[0] if srcs else -1))
    return RestorePlan(ref.name, ref.step, digest, dict(ref.files), {n: tuple(m) for n, m in moves.items()},
                       ref.essential)


def fetch(comm: Comm, nodes: Nodes, directory: str, plan: RestorePlan, group: Any, *,
          durable: Any = None, fsync: bool = True) -> None:
    """Carry out ``plan``: each node's leader receives what its directory lacks of the checkpoint
    (from the peer the plan names, or read from ``durable``, a reader of the durable tier's copy),
    each file verified before it takes its name; a node that held nothing of it builds the
    directory under a staging name and renames it when complete; a file the plan fetches in
    ranges (``plan.ranges``) lands as ``node_moves.ranges_name``. Agreed on every rank. The
    files are not fsynced one by one (the load that follows reads them from the page cache;
    ``fsync`` syncs the directory once at the end): a file a crash then leaves short or torn
    fails its size or checksum check, and the next restore fetches it again. Every pair of
    nodes moves at once (``node_moves.run_moves``)."""
    path = os.path.join(directory, plan.name)
    node = nodes.node_of[comm.rank]
    leader = nodes.leader(node) == comm.rank
    # the checksums: the metadata of the lowest node that holds it (one digest, agreed by the plan)
    holder = min(n for n in range(nodes.count) if all(f != METADATA_FILE for f, _ in plan.moves.get(n, ())))
    expected = _expected(Table.parse(_metadata_from(comm, nodes, holder, path), path))
    target = {"dir": path}

    def prepare() -> None:
        if leader and plan.moves.get(node) and not os.path.isdir(path):
            staging = os.path.join(directory, f".{plan.name}.tmp-{uuid.uuid4().hex[:12]}")
            os.makedirs(staging)
            target["dir"] = staging

    comm.agree("node tier: restore prepare", prepare)
    moves = sorted((Move(name, nodes.leader(src_node) if src_node >= 0 else None, nodes.leader(dst_node),
                          plan.ranges.get(dst_node, {}).get(name))
                    for dst_node in range(nodes.count) for name, src_node in plan.moves.get(dst_node, ())),
                   key=lambda m: m.src is not None)  # the durable reads first: a node sends on what it read

    def send(m: Move) -> None:  # (a file this node fetched itself is in its staging directory)
        send_file(os.path.join(target["dir"], m.name), expected[m.name][0], m.dst, group, m.spans)

    def receive(m: Move) -> None:
        size, checksum = expected[m.name]
        got = (functools.partial(copy_from, durable, m.name, size, spans=m.spans) if m.src is None else
               lambda p, check: recv_file(p, size, m.src, group, check, spans=m.spans))
        land(target["dir"], m.name, size, checksum, got, False, ranged=m.spans is not None)

    run_moves(comm, moves, send, receive, f"node tier: restore {plan.name}")

    def finish() -> None:
        if leader and target["dir"] != path:
            publish_dir(target["dir"], path, overwrite=False, fsync=fsync)
        elif leader and fsync and plan.moves.get(node):
            fsync_dir(path)

    comm.agree("node tier: restore commit", finish)


def _metadata_from(comm: Comm, nodes: Nodes, holder: int, path: str) -> str:
    """``metadata.json`` of ``path`` as ``holder``'s leader has it, on every rank."""
    src = nodes.leader(holder)
    return comm.agree("node tier: restore metadata",
                      lambda: _read(os.path.join(path, METADATA_FILE)).decode() if comm.rank == src else None)[src]


def set_aside(comm: Comm, nodes: Nodes, directory: str, names: Iterable[str]) -> list[str]:
    """Rename this node's parts of checkpoints that cannot be restored (a file on no node, no
    durable copy) to ``.NAME.partial-<id>``: never a checkpoint again, never in the way of the
    next save of that step, and nothing deleted (a node that was only away still has its part).
    Every node's leader; returns the names set aside here."""
    node = nodes.node_of[comm.rank]

    def move() -> list[str]:
        out = []
        if nodes.leader(node) != comm.rank:
            return out
        for name in names:
            path = os.path.join(directory, check_file_name(name))
            if os.path.isdir(path):
                aside = os.path.join(directory, f".{name}.partial-{uuid.uuid4().hex[:8]}")
                os.rename(path, aside)
                log.warning("node tier: %s is not whole on the nodes and has no durable copy: set aside as %s",
                            path, aside)
                out.append(name)
        if out:
            fsync_dir(directory)
        return out

    return comm.agree("node tier: set aside", move)[comm.rank]


def merge_spans(spans: Iterable[Iterable[int]], gap: int = SPAN_GAP) -> list[tuple[int, int]]:
    """Byte ranges sorted and joined where they overlap or lie within ``gap`` of each other."""
    out: list[list[int]] = []
    for lo, hi in sorted((int(a), int(b)) for a, b in spans):
        if out and lo <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


class FilesWanted(Exception):
    """Raised by a probing ``NodeLocalReader`` where the load checks its files: the names, each
    with the byte ranges the rank reads from it (None: all of it)."""

    def __init__(self, names: Iterable[str], spans: Mapping[str, list[tuple[int, int]]] | None) -> None:
        super().__init__("node tier probe: the files this rank reads")
        self.wanted = {n: (merge_spans(spans[n]) if spans is not None and n in spans else None) for n in sorted(names)}


class NodeLocalReader(FileSystemReader):
    """The reader of a node-local checkpoint: every node reads its own copy, so the coordinator's
    pin (its directory's inode) names nothing here; the copies were agreed by their metadata's
    digest (``plan_restore``) and every chunk is checked against its checksum as it is read. A
    file the restore fetched in ranges (``node_moves.ranges_name``) is read in place of the missing one.
    ``probe``: stop the load where it checks the files its plan reads, before any byte moves,
    raising ``FilesWanted`` (``wanted_files``)."""

    def __init__(self, path: str | os.PathLike, probe: bool = False, **options: Any) -> None:
        aliases = {}
        with contextlib.suppress(OSError):
            for entry in os.listdir(path):
                name = entry[1:-len(RANGES_SUFFIX)]
                if entry.startswith(".") and entry.endswith(RANGES_SUFFIX) and name and \
                        not os.path.exists(os.path.join(path, name)):
                    aliases[name] = entry
        super().__init__(path, aliases=aliases, **options)
        self.probe = probe

    def pin(self) -> Any:
        return None

    def check_reads(self, names: Iterable[str], spans: Any) -> None:
        if self.probe:  # ranges only where every chunk read is verified (a hole never reads as data)
            raise FilesWanted(names, spans() if self.verify_checksums else None)
        super().check_reads(names, spans)


def wanted_files(load: Any) -> dict[str, list[tuple[int, int]] | None] | None:
    """The files this rank's load would read, each with the byte ranges it reads (None: all of
    it): ``load()`` runs a load through a probing ``NodeLocalReader`` (every rank,
    collectively), which stops where the files are checked. None when it stopped anywhere else
    (the caller then fetches every file)."""
    try:
        load()
    except BaseException as e:
        seen, cur = set(), e
        while cur is not None and id(cur) not in seen:
            if isinstance(cur, FilesWanted):
                return cur.wanted
            seen.add(id(cur))
            cur = cur.__cause__ or cur.__context__
        log.warning("node tier: the probe of what this rank reads stopped elsewhere (%s: %s); fetching every file",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return None


class Background(SerialWorker):
    """Runs submitted collective jobs (``fn(comm)``) one at a time, in order, in a thread of its
    own on a gloo group of its own (every rank submits the same jobs in the same order): the
    node-local tier's publish and replication, beside training and the async saves. Create it in
    the thread that runs the training collectives (the group is made there). A job that fails is
    remembered (``close`` returns the failures) and the next ones still run."""

    def __init__(self, timeout: Any = None) -> None:
        if dist.is_available() and dist.is_initialized():
            group = gloo_group(dist.group.WORLD, timeout, "node tier")
            self.comm = Comm(group, dist.get_rank(), dist.get_world_size(), group, timeout)
        else:
            self.comm = Comm.create(None, None)
        self.failures: list[str] = []
        super().__init__("hpdcp-node-tier")

    def submit(self, fn: Any) -> None:
        self._put(fn)

    def busy(self) -> bool:
        return bool(self._pending())

    nice = 10  # added to this thread's niceness: the steps beside it come first (as dcp.persist_nice)

    def _work(self) -> None:
        if self.nice:
            with contextlib.suppress(OSError, AttributeError):  # (a thread's own priority: Linux)
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.nice)
        super()._work()

    def _run(self, fn: Any) -> None:
        try:
            fn(self.comm)
        except BaseException as e:
            self.failures.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            log.error("node tier: %s", self.failures[-1])

    def close(self, timeout: float | None = None) -> list[str]:  # type: ignore[override]
        """Run what is queued, stop the thread; the failures, in order."""
        super().close(timeout)
        return list(self.failures)
