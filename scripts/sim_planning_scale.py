"""Planning at thousands of ranks, simulated in one process: time and memory per role.

    python scripts/sim_planning_scale.py --ranks 8 64 256 1024 --tensors 2000
    python scripts/sim_planning_scale.py --ranks --hostile 4000 30000   # adversarial tiling only

A save or load gathers what needs deciding on the coordinator (rank 0), which plans once and sends
each rank its own part (``Comm.coordinate``). One process replays the roles with the engine's own
functions on synthetic plans: ``--tensors`` tensors of max(1024, ranks) x 1024 fp32 (so every rank
holds rows of each), 9 of every 10 sharded Shard(0) over all ranks (FSDP: a DTensor on a mesh as
large as the group, so ``unique``), every 10th replicated on every rank (norms).

* save, any rank (first save): its plan, its ``SaveSummary`` (73 bytes, all-gathered), the
  payload it sends if it is the lowest rank of its table/layout (rank 0 here), and after writing
  its ``WrittenRows`` report;
* save, coordinator, plan: ``layouts_from`` (N summaries + the one distinct table and layout) and
  ``create_global_plan``, and the N replies encoded for the scatter;
* save, coordinator, metadata: ``build_metadata`` over the rows every rank reported (received in
  place by ``Comm.gather_rows``: generated here straight into that matrix, untimed), the chunk
  index written, ``Metadata.to_json``;
* verify of the checkpoint's index (``Metadata.from_json`` + ``validate_all``: every row checked,
  tiling, shared bytes) and the describe that ``inspect`` prints;
* metadata parse (``Metadata.from_json``): every rank on load;
* load, one rank: ``StandardLoadPlanner.create_local_plan`` against that metadata;
* load, coordinator: parse N ranks' columnar shard summaries and ``plan_replica_reads``
  (mode always: every replicated shard gets a reader and a broadcast).

``--cached``: a repeated save with a cached plan (``save(cache_plan=True)``) instead: a rank's
plan to its digest and the compare of N all-gathered summaries. The collectives themselves
(all-gathers, gathers, point-to-point rows) are what a one-process simulation cannot time; the
bytes each moves are printed (``scripts/real_scale_save.py`` runs them for real on gloo ranks).

Memory: peak RSS growth while the step runs (``/proc/self/clear_refs`` resets the peak), which
also counts torch allocations; tracemalloc's peak where the reset is not permitted.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import time
import tracemalloc

import torch

from hpdcp_runner.dcp.comm.collectives import encode_each
from hpdcp_runner.dcp.core.columns import decode_frame, encode_frame
from hpdcp_runner.dcp.core.geometry import Box, split_piece, whole
from hpdcp_runner.dcp.format.chunk_index import INDEX_FILE
from hpdcp_runner.dcp.format.metadata import (METADATA_FILE, FileMeta, Metadata, ReportedRows, WriteResult,
                                              WrittenRows, chunk_key)
from hpdcp_runner.dcp.format.safetensors_io import write_index
try:  # (absent before the index was streamed: this script also times older trees, on PYTHONPATH)
    from hpdcp_runner.dcp.format.safetensors_io import IndexStream
    from hpdcp_runner.dcp.protocol import STREAM_INDEX_BYTES
except ImportError:
    IndexStream, STREAM_INDEX_BYTES = None, 0
from hpdcp_runner.dcp.storage.posix.filesystem import FileSink
from hpdcp_runner.dcp.storage.interfaces import IOCounters
from hpdcp_runner.dcp.planning.interfaces import TENSOR, SavePlan, WriteItem
from hpdcp_runner.dcp.planning.plans import CompactPlan
from hpdcp_runner.dcp.core.ragged import LocalShard
from hpdcp_runner.dcp.planning.load_replicas import CompactShards, plan_replica_reads
from hpdcp_runner.dcp.planning.standard import StandardLoadPlanner, StandardSavePlanner, build_metadata
from hpdcp_runner.dcp.protocol import SaveReply, SaveSummary, layouts_from, plan_digest

ROWS, COLS = 1024, 1024  # ROWS becomes max(1024, ranks) per row: every rank holds a non-empty shard
MIB = 1 << 20


def set_rows(n: int) -> None:
    global ROWS
    ROWS = max(1024, n)


def _box(i: int, n: int, rank: int) -> Box:
    if i % 10 == 9:
        return whole((ROWS, COLS))
    start, size = split_piece(ROWS, n, rank)
    return Box((start, 0), (size, COLS))


def rank_plan(n: int, t: int, r: int) -> SavePlan:
    """Rank r's plan as ``StandardSavePlanner`` makes it: the FSDP shards ``unique``."""
    items = tuple(WriteItem(f"t{i}", TENSOR, _box(i, n, r), "float32", (ROWS, COLS), _box(i, n, r).numel * 4, 0, None,
                            i % 10 != 9) for i in range(t))
    return SavePlan(r, items, {f"t{i}": (f"t{i}",) for i in range(t)})


def rank_first_save(n: int, t: int, r: int) -> tuple[bytes, bytes, int]:
    """What one rank computes in a first save, the protocol's own steps: its plan in compact form,
    its digests and summary, its payload if it is the lowest of its layout (rank 0 is; the
    others send an empty one), and after writing its rows report (the writer's own bookkeeping,
    chunk key -> location, is made untimed). Returns (summary, payload, report bytes)."""
    plan = rank_plan(n, t, r)
    compact = CompactPlan.from_plan(plan)
    shared, idx = compact.shared()
    unique = compact.unique_items()
    summary = SaveSummary(True, plan_digest(compact), compact.table_digest(), shared.columns_digest(),
                          compact.unique_bytes()).encode()
    payload = encode_frame({"ok": {"token": None, "table": compact.table_text() if r == 0 else None,
                                   "shared": shared.to_frame() if r == 0 else None}})
    items = [(i, plan.items[i].box, chunk_key(plan.items[i].fqn, plan.items[i].box.offsets)) for i in unique.tolist()]
    return summary, payload, items


def rank_report(r: int, items: list) -> int:
    res = WriteResult(r, (FileMeta(f"rank{r:05d}.safetensors", 1 << 40, "0", r),),
                      {k: (f"rank{r:05d}.safetensors", 64 + 4096 * j, f"{j:016x}", "") for j, (_, _, k) in enumerate(items)},
                      {})
    t0 = time.perf_counter()
    w = WrittenRows.from_result(res, items, 2)
    env = encode_frame({"ok": w.envelope()})
    return time.perf_counter() - t0, w.rows.numel() * 8 + len(env)


def coordinator_plan(n: int, summary: bytes, payload0: bytes):
    """The coordinator's plan round: N summaries (as all-gathered), N payloads decoded (one
    carries the table and the layout), the layouts, the global plan, the N replies encoded."""
    summaries = torch.frombuffer(bytearray(summary), dtype=torch.uint8).repeat(n, 1)
    empty = encode_frame({"ok": {"token": None, "table": None, "shared": None}})
    payloads = [payload0] + [empty] * (n - 1)
    bufs = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]

    def run():
        gathered = [decode_frame(b)["ok"] for b in bufs]
        layouts = layouts_from(summaries, gathered, n)
        gplan = StandardSavePlanner().create_global_plan(layouts)
        replies: dict = {}
        out = []
        for w in gplan.write_idx:
            k = id(w) if w.numel() else -1
            if k not in replies:
                replies[k] = {"ok": SaveReply(w, "token", gplan.ndim).to_wire()}
            out.append(replies[k])
        sent = encode_each(out)
        return gplan, sum(len(x) for x in {id(x): x for x in sent}.values())
    return run, sum(map(len, payloads))


def reported_rows(n: int, t: int, gplan) -> ReportedRows:
    """Every rank's rows as they land in the coordinator's matrix (``Comm.gather_rows``), in rank
    order and each rank's write order: its FSDP shards, and the replicated tensors it was given
    (4 MiB and more: block digests)."""
    d = 2
    width = 6 + 2 * d
    rep = [i for i in range(t) if i % 10 == 9]
    uniq = torch.tensor([i for i in range(t) if i % 10 != 9], dtype=torch.int64)
    shared_of = [gplan.write_idx[r] for r in range(n)]  # positions in the shared items = index into rep
    counts = [len(uniq) + len(w) for w in shared_of]
    rows = torch.empty((sum(counts), width), dtype=torch.int64)
    rep_bytes = ROWS * COLS * 4
    nblk = -(-rep_bytes // MIB) if rep_bytes > MIB else 0
    block_counts = []
    at = 0
    rep_t = torch.tensor(rep, dtype=torch.int64)
    for r in range(n):
        start, size = split_piece(ROWS, n, r)
        tids = torch.sort(torch.cat([uniq, rep_t[shared_of[r]]])).values
        k = len(tids)
        part = rows[at:at + k]
        is_rep = tids % 10 == 9
        nbytes = torch.where(is_rep, rep_bytes, size * COLS * 4)
        part[:, 0] = tids
        part[:, 1] = 0
        part[:, 2] = torch.cumsum(nbytes, 0) - nbytes + 64
        part[:, 3] = torch.arange(k) + r * 7919
        bc = torch.where(is_rep, nblk, 0)
        part[:, 5] = bc
        part[:, 4] = torch.cumsum(bc, 0) - bc
        part[:, 6] = torch.where(is_rep, 0, start)
        part[:, 7] = 0
        part[:, 8] = torch.where(is_rep, ROWS, size)
        part[:, 9] = COLS
        block_counts.append(int(bc.sum()))
        at += k
    blocks = torch.arange(sum(block_counts), dtype=torch.int64)
    files = tuple((FileMeta(f"rank{r:05d}.safetensors", 1 << 40, "0", r),) for r in range(n))
    return ReportedRows(n, rows, tuple(counts), blocks, tuple(block_counts), files, tuple({} for _ in range(n)))


def shard_wires(n: int, t: int, all_shards: bool = False) -> list[str]:
    """Every rank's gathered shard summaries for a load of the same layout (columnar wire). A
    rank sends only the shards another rank may hold (``StandardLoadPlanner._summaries``): the
    replicated tenth here, not the DTensors sharded over the whole mesh (``all_shards``: the
    protocol before that, every shard)."""
    keys = tuple((f"t{i}", "float32", "cpu", 2) for i in range(t))
    rep = torch.tensor([i % 10 == 9 for i in range(t)])
    sent = torch.arange(t) if all_shards else torch.nonzero(rep).flatten()
    out = []
    for r in range(n):
        start, size = split_piece(ROWS, n, r)
        off0, size0 = torch.where(rep, 0, start)[sent], torch.where(rep, ROWS, size)[sent]
        m = len(sent)
        boxes = torch.stack([off0, torch.zeros(m, dtype=torch.int64), size0, torch.full((m,), COLS)], 1).flatten()
        cs = CompactShards(keys, sent, boxes, size0 * COLS * 4)
        out.append(json.dumps({"ok": {"shards": cs.to_wire()}}, separators=(",", ":")))
    return out


def coordinator_replicas(texts: list[str], n: int):
    tables: dict = {}
    shards = [CompactShards.from_wire(json.loads(x)["ok"]["shards"], tables) for x in texts]
    return plan_replica_reads(shards, mode="always", nodes=["a"] * n, slow_storage=False)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def measure(fn):
    """(seconds, peak MiB growth, result)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base, traced = _rss_kib("VmRSS:"), False
    except OSError:
        tracemalloc.start()
        traced = True
    gc.disable()  # as in save/load, which pause automatic collection (utils.pauses_gc)
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        secs = time.perf_counter() - t0
        gc.enable()
    if traced:
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    else:
        peak = (_rss_kib("VmHWM:") - base) / 1024
    return secs, max(peak, 0.0), out


def row(n: int, t: int, skip_metadata: bool, v1: bool = False, whole_index: bool = False) -> str:
    cols = []
    r = n // 2
    s_rank, m_rank, (summary, _, items) = measure(lambda: rank_first_save(n, t, r))
    s_rep, report_bytes = rank_report(r, items)
    _, _, (_, payload0, _) = measure(lambda: rank_first_save(n, t, 0))
    cols.append(f"{s_rank + s_rep:.3f} ({m_rank:.0f}); {report_bytes / 1024:.0f} KiB report")
    run, inbox = coordinator_plan(n, summary, payload0)
    s, m, (gplan, sent) = measure(run)
    cols.append(f"{s:.2f} ({m:.0f}); {(n * len(summary) + inbox) / MIB:.1f} MiB in, {sent / 1024:.0f} KiB out")
    text = md = None
    if not skip_metadata:
        reported = reported_rows(n, t, gplan)
        rows_mib = reported.rows.numel() * 8 / MIB
        tmp = tempfile.mkdtemp(prefix="sim_md_")

        parts = {}

        def commit() -> str:  # what the coordinator does after the writes: metadata, index file, JSON
            nonlocal reported
            rep, reported = reported, None
            t0 = time.perf_counter()
            counts = (sum(1 for k in gplan.keys if k.kind == TENSOR), len(rep.rows), gplan.ndim, rep.blocks.numel())
            stream = None
            if not v1 and not whole_index and IndexStream and IndexStream.size(*counts) >= STREAM_INDEX_BYTES:  # as the protocol does
                stream = IndexStream(FileSink(os.path.join(tmp, INDEX_FILE), False, IOCounters()), *counts)
            built = build_metadata(gplan, rep, n, **({"on_sorted": stream.put} if stream else {}))
            del rep
            t1 = time.perf_counter()
            if v1:  # the format before the chunk index: every chunk inline in metadata.json
                built = dataclasses.replace(built, index=None, tensors={
                    k: dataclasses.replace(tm, chunks=tuple(tm.chunks)) for k, tm in built.tensors.items()})
            elif stream is not None:
                stream.finish(built.index)
            else:
                write_index(os.path.join(tmp, INDEX_FILE), built.index, fsync=False)
            if not v1:
                parts["index_bytes"] = os.path.getsize(os.path.join(tmp, INDEX_FILE))
            t2 = time.perf_counter()
            out = built.to_json()
            parts.update(build=t1 - t0, write=t2 - t1, json=time.perf_counter() - t2, streamed=stream is not None)
            return out

        s, m, text = measure(commit)
        with open(os.path.join(tmp, METADATA_FILE), "w") as f:
            f.write(text)
        split = (f"build while the index streams {parts['build']:.2f} + the index's end {parts['write']:.2f}"
                 if parts["streamed"] else f"build {parts['build']:.2f} + index write {parts['write']:.2f}") \
            + f" + JSON {parts['json']:.2f}"
        if "index_bytes" in parts:
            split += f"; the same {parts['index_bytes'] / MIB:.0f} MiB written alone: {write_bound(tmp, parts['index_bytes']):.2f}"
        cols.append(f"{s:.2f} ({m:.0f}); {rows_mib:.0f} MiB of rows in; {split}")

        def opener(name: str) -> int:
            return os.open(os.path.join(tmp, name), os.O_RDONLY)

        def verify_index() -> int:
            v = Metadata.from_json(text, source=os.path.join(tmp, METADATA_FILE), open_file=opener)
            v.validate_all()
            describe_tensors(v)
            return len(v.tensors)

        s, m, _ = measure(verify_index)
        cols.append(f"{s:.2f} ({m:.0f})")
        s, m, md = measure(lambda: Metadata.from_json(text, source=os.path.join(tmp, METADATA_FILE), open_file=opener))
        cols.append(f"{s:.3f} ({m:.0f})")
        target = {}
        for i in range(t):
            b = _box(i, n, n // 2)
            target[f"t{i}"] = LocalShard(torch.empty(b.sizes, device="meta"), b.offsets, (ROWS, COLS))
        lp = StandardLoadPlanner()
        lp.configure(target, md, rank=n // 2, world_size=n, sendable=frozenset({"cpu"}))
        s, m, _ = measure(lp.create_local_plan)
        index_kib = md.index.bytes_read / 1024 if md.index is not None else 0
        cols.append(f"{s:.3f} ({m:.0f}); {index_kib:.0f} KiB of index")
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        cols += ["-", "-", "-", "-"]
    del gplan, text, md
    texts = shard_wires(n, t)
    s, m, _ = measure(lambda: coordinator_replicas(texts, n))
    del texts
    cols.append(f"{s:.2f} ({m:.0f})")
    return f"| {n} | {t} | " + " | ".join(cols) + " |"


def write_bound(tmp: str, nbytes: int) -> float:
    """The bound of the index write on this disk: ``nbytes`` from memory into a fresh file of the
    same directory, one write as ``write_index`` does, no fsync. Once, right after the index
    write, so it meets the same dirty-page backlog (a second write after deleting the first
    reuses its pages and measures 10x faster, which no save meets)."""
    buf = torch.ones(nbytes, dtype=torch.uint8).numpy()
    path = os.path.join(tmp, "bound")
    t0 = time.perf_counter()
    with open(path, "xb") as f:
        f.write(buf)
        f.flush()
    took = time.perf_counter() - t0
    os.unlink(path)
    return took


def describe_tensors(md: Metadata) -> None:
    """What ``inspect`` prints per tensor (chunk count, files), for the whole checkpoint."""
    from hpdcp_runner.dcp.offline.inspection import tensor_files

    tensor_files(md)


def hostile_strips(n: int) -> str:
    """The adversarial metadata.json for the tiling check: one tensor tiled by ``n`` column strips
    of decreasing height plus their complements (2n chunks), which keeps every strip open in a
    plain sweep (quadratic: 4,000 strips took 12-19 s before the bounded sweep). Returns the
    time to parse and validate it."""
    from hpdcp_runner.dcp.format.metadata import Metadata

    chunks = []
    for i in range(n):
        h = n - i
        chunks.append([[0, i], [h, 1], "rank00000.safetensors", f"w@0,{i}", 0, "0" * 16])
        chunks.append([[h, i], [n + 1 - h, 1], "rank00000.safetensors", f"w@{h},{i}", 0, "0" * 16])
    doc = {"format": "hpdcp", "format_version": 1, "world_size": 1, "checksum_algorithm": "xxh3_64",
           "files": {"rank00000.safetensors": {"size": 1 << 40, "checksum": "0" * 16, "rank": 0}},
           "tensors": {"w": {"dtype": "uint8", "shape": [n + 1, n], "path": ["w"], "chunks": chunks}},
           "objects": {}, "extra": {}}
    text = json.dumps(doc)
    t0 = time.perf_counter()
    Metadata.from_json(text)
    return f"| {n} strips ({2 * n} chunks, {len(text) // 1024} KiB) | {time.perf_counter() - t0:.2f} s |"


def cached_row(n: int, t: int) -> str:
    plan = rank_plan(n, t, n // 2)

    def summary() -> bytes:
        c = CompactPlan.from_plan(plan)
        shared, _ = c.shared()
        return SaveSummary(True, plan_digest(c), c.table_digest(), shared.columns_digest(), 0).encode()

    s_rank, m_rank, row = measure(summary)
    # what the all-gather hands every rank: N summaries; their flag + plan digest compared with
    # the cached ones (the rows differ per rank in a real job; equal here, the same work)
    row = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    gathered, cached = row.repeat(n, 1), row[:17].repeat(n, 1)
    s_cmp, m_cmp, hit = measure(lambda: torch.equal(gathered[:, :17], cached))
    assert hit
    return (f"| {n} | {t} | {s_rank * 1e3:.1f} ({m_rank:.0f}) | {s_cmp * 1e3:.2f} ({m_cmp:.0f}); "
            f"{gathered.numel() / 1024:.0f} KiB gathered |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 256, 1024])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--skip-metadata-above", type=int, default=1 << 30,
                    help="skip the metadata and load columns above this many ranks x tensors")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hostile", type=int, nargs="*", default=[],
                    help="also time validating the adversarial strips metadata at these strip counts")
    ap.add_argument("--cached", action="store_true", help="time a repeated save with a cached plan instead")
    ap.add_argument("--whole-index", action="store_true",
                    help="write the chunk index after the build, not streamed while it is built (the protocol streams "
                         "one of 64 MiB or more)")
    ap.add_argument("--format-v1", action="store_true",
                    help="commit and read format v1 (every chunk inline in metadata.json): the 'before' of the index")
    args = ap.parse_args()
    if args.cached:
        print("| ranks | tensors | any rank: plan -> summary ms (MiB) | every rank: N gathered summaries compared "
              "ms (MiB) |\n|---|---|---|---|", flush=True)
        for n in args.ranks:
            set_rows(n)
            print(cached_row(n, args.tensors), flush=True)
        return
    if args.hostile:
        print("| hostile tiling | parse + validate |\n|---|---|")
        for n in args.hostile:
            print(hostile_strips(n), flush=True)
    rows = ["| ranks | tensors | save, any rank: first save (plan, summary, rows report) s (MiB) "
            "| save, coordinator: plan (layouts, dedup, replies) s (MiB) "
            "| save, coordinator: metadata build + index + JSON s (MiB) | verify + describe of the index s (MiB) "
            "| load, every rank: metadata parse s (MiB) | load, one rank: local plan s (MiB) "
            "| load, coordinator: replica plan s (MiB) |",
            "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for n in args.ranks:
        set_rows(n)
        rows.append(row(n, args.tensors, n * args.tensors > args.skip_metadata_above, args.format_v1,
                        args.whole_index))
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
