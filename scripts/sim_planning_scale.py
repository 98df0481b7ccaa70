"""Planning at thousands of ranks, simulated in one process: time and memory per role.

    python scripts/sim_planning_scale.py --ranks 8 64 256 1024 --tensors 2000
    python scripts/sim_planning_scale.py --ranks --hostile 4000 30000   # adversarial tiling only

A save or load gathers every rank's plan on the coordinator (rank 0), which plans once and sends
each rank its own part (``Comm.coordinate``). One process replays both roles on synthetic plans:
``--tensors`` tensors of max(1024, ranks) x 1024 fp32 (so every rank holds rows of each), 9 of
every 10 sharded Shard(0) over all ranks (FSDP), every 10th replicated on every rank (norms).

* save, any rank: its local plan in compact wire form (``CompactPlan.to_wire`` + JSON);
* save, coordinator: parse N wires, ``assign_owners`` (vectorised dedup + tiling check), then
  ``build_metadata`` and ``Metadata.to_json`` (the committed file);
* metadata parse (``Metadata.from_json``): every rank on load; on save, the other ranks get the
  committed text back and parse it only on first use (``DeferredMetadata``);
* load, one rank: ``StandardLoadPlanner.create_local_plan`` against that metadata;
* load, coordinator: parse N ranks' columnar shard summaries and ``plan_replica_reads``
  (mode always: every replicated shard gets a reader and a broadcast).

``--cached``: a repeated save with a cached plan (``save(cache_plan=True)``) instead: a rank's
plan to its structure digest (``CompactPlan.from_plan`` + ``plan_digest``, what every rank
computes per save) and what every rank (the coordinator included) does with the all-gathered
digests (N rows of 17 bytes: compare with the cached ones). The all-gather itself (N x 17 bytes
over gloo) and the staging token's broadcast are collectives a one-process simulation cannot time.

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

from hpdcp_runner.dcp.planning.save_dedup import CompactPlan, KeyInfo, assign_owners
from hpdcp_runner.dcp.core.geometry import Box, split_piece, whole
from hpdcp_runner.dcp.format.chunk_index import INDEX_FILE
from hpdcp_runner.dcp.format.metadata import METADATA_FILE, FileMeta, Metadata, WrittenChunks
from hpdcp_runner.dcp.format.safetensors_io import write_index
from hpdcp_runner.dcp.planning.interfaces import TENSOR, SavePlan, WriteItem
from hpdcp_runner.dcp.core.ragged import LocalShard
from hpdcp_runner.dcp.planning.load_replicas import CompactShards, plan_replica_reads
from hpdcp_runner.dcp.planning.standard import StandardLoadPlanner, build_metadata

ROWS, COLS = 1024, 1024  # ROWS becomes max(1024, ranks) per row: every rank holds a non-empty shard


def set_rows(n: int) -> None:
    global ROWS
    ROWS = max(1024, n)


def _box(i: int, n: int, rank: int) -> Box:
    if i % 10 == 9:
        return whole((ROWS, COLS))
    start, size = split_piece(ROWS, n, rank)
    return Box((start, 0), (size, COLS))


def rank_plan(n: int, t: int, r: int) -> SavePlan:
    items = tuple(WriteItem(f"t{i}", TENSOR, _box(i, n, r), "float32", (ROWS, COLS), _box(i, n, r).numel * 4)
                  for i in range(t))
    return SavePlan(r, items, {f"t{i}": (f"t{i}",) for i in range(t)})


def wires(n: int, t: int) -> list[str]:
    """Every rank's gathered payload; built from tensors directly (a SavePlan per rank is slow)."""
    keys = tuple(KeyInfo(f"t{i}", TENSOR, "float32", (ROWS, COLS), (f"t{i}",)) for i in range(t))
    rep = torch.tensor([i % 10 == 9 for i in range(t)])
    out = []
    for r in range(n):
        start, size = split_piece(ROWS, n, r)
        off0 = torch.where(rep, 0, start)
        size0 = torch.where(rep, ROWS, size)
        boxes = torch.stack([off0, torch.zeros(t, dtype=torch.int64), size0, torch.full((t,), COLS)], 1).flatten()
        cp = CompactPlan(r, keys, torch.arange(t), boxes, size0 * COLS * 4)
        out.append(json.dumps({"ok": {"plan": cp.to_wire(), "token": None}}, separators=(",", ":")))
    return out


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


def coordinator_plan(texts: list[str]):
    tables: dict = {}
    plans = [CompactPlan.from_wire(json.loads(x)["ok"]["plan"], tables) for x in texts]
    return assign_owners(plans, "balanced")


def results_for(n: int, gplan) -> list[WrittenChunks]:
    """What every rank reports after writing, in the save's wire form (columns in write order;
    1 MiB blocks as a real writer records them), built vectorised."""
    d = (gplan.owned.shape[1] - 2) // 2
    nbytes = gplan.owned[:, 2 + d:].prod(1) * 4
    keep = nbytes > 0  # empty chunks are not written
    items = torch.cat(list(gplan.write_idx))[keep]
    nbytes = nbytes[keep]
    counts = torch.bincount(gplan.owned[keep, 1], minlength=n).tolist()  # owned rows are in rank order
    blocks = torch.where(nbytes > (1 << 20), (nbytes + (1 << 20) - 1) // (1 << 20), 0)
    out = []
    for r, (it, nb, bl) in enumerate(zip(items.split(counts), nbytes.split(counts), blocks.split(counts))):
        k = len(it)
        out.append(WrittenChunks(r, (FileMeta(f"rank{r:05d}.safetensors", 1 << 40, "0", r),), it,
                                 torch.zeros(k, dtype=torch.int64), torch.cumsum(nb, 0) - nb,
                                 torch.arange(k, dtype=torch.int64), bl, torch.arange(int(bl.sum()), dtype=torch.int64),
                                 {}))
    return out


def row(n: int, t: int, skip_metadata: bool, v1: bool = False) -> str:
    cols = []
    plan = rank_plan(n, t, n // 2)
    s, m, _ = measure(lambda: json.dumps(CompactPlan.from_plan(plan).to_wire()))
    cols.append(f"{s:.3f} ({m:.0f})")
    texts = wires(n, t)
    mib = sum(map(len, texts)) / 2**20
    s, m, gplan = measure(lambda: coordinator_plan(texts))
    del texts
    cols.append(f"{s:.2f} ({m:.0f}); {mib:.0f} MiB in")
    per_item = 1e6 * s / (n * t)
    text = md = None
    if not skip_metadata:
        results = results_for(n, gplan)
        tmp = tempfile.mkdtemp(prefix="sim_md_")

        def commit() -> str:  # what the coordinator does after the writes: metadata, index file, JSON
            built = build_metadata(gplan, results, n)
            if v1:  # the format before the chunk index: every chunk inline in metadata.json
                built = dataclasses.replace(built, index=None, tensors={
                    k: dataclasses.replace(tm, chunks=tuple(tm.chunks)) for k, tm in built.tensors.items()})
            else:
                write_index(os.path.join(tmp, INDEX_FILE), built.index, fsync=False)
            return built.to_json()

        s, m, text = measure(commit)
        del results
        with open(os.path.join(tmp, METADATA_FILE), "w") as f:
            f.write(text)
        cols.append(f"{s:.2f} ({m:.0f}); {len(text) / 2**20:.1f} MiB")

        def opener(name: str) -> int:
            return os.open(os.path.join(tmp, name), os.O_RDONLY)

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
        cols += ["-", "-", "-"]
    del gplan, text, md
    texts = shard_wires(n, t)
    s, m, _ = measure(lambda: coordinator_replicas(texts, n))
    del texts
    cols.append(f"{s:.2f} ({m:.0f})")
    return f"| {n} | {t} | " + " | ".join(cols) + f" | {per_item:.2f} |"


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
    from hpdcp_runner.dcp.protocol import plan_digest

    plan = rank_plan(n, t, n // 2)
    s_rank, m_rank, digest = measure(lambda: plan_digest(CompactPlan.from_plan(plan)))
    # what the all-gather hands every rank: N rows of 17 bytes (flag + digest); compared with the
    # cached ones (the rows differ per rank in a real job; equal here, the same work)
    row = torch.frombuffer(bytearray(b"\x01" + bytes.fromhex(digest)), dtype=torch.uint8)
    gathered, cached = row.repeat(n, 1), row.repeat(n, 1)
    s_cmp, m_cmp, hit = measure(lambda: torch.equal(gathered, cached))
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
    ap.add_argument("--format-v1", action="store_true",
                    help="commit and read format v1 (every chunk inline in metadata.json): the 'before' of the index")
    args = ap.parse_args()
    if args.cached:
        print("| ranks | tensors | any rank: plan -> digest ms (MiB) | every rank: N gathered digests compared "
              "ms (MiB) |\n|---|---|---|---|", flush=True)
        for n in args.ranks:
            set_rows(n)
            print(cached_row(n, args.tensors), flush=True)
        return
    if args.hostile:
        print("| hostile tiling | parse + validate |\n|---|---|")
        for n in args.hostile:
            print(hostile_strips(n), flush=True)
    rows = ["| ranks | tensors | save, any rank: plan to wire s (MiB) | save, coordinator: gather parse + dedup s (MiB) "
            "| save, coordinator: metadata build + index + JSON s (MiB) | load, every rank: metadata parse s (MiB) "
            "| load, one rank: local plan s (MiB) | load, coordinator: replica plan s (MiB) | coordinator dedup us/item |",
            "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for n in args.ranks:
        set_rows(n)
        rows.append(row(n, args.tensors, n * args.tensors > args.skip_metadata_above, args.format_v1))
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
