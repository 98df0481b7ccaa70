"""The node-local tier's engine steps on 4 real gloo ranks standing for 2 nodes of 2 (torchrun's
node rank set per rank, each node with a directory of its own): the save writes each node's part
to its own disk, ``publish_parts`` commits the other nodes' parts, ``replicate`` gives each node
the other's files verified, and after a node's disk is lost ``survey``/``plan_restore``/``fetch``
make it whole again from the peer, so a load on every node is bitwise, also at another layout.
A replica corrupted on its way (a flipped byte in the source) is refused on arrival."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.multiproc.harness import run_ranks


def _node_dir(base, rank):
    node = rank // 2
    os.environ["GROUP_RANK"] = str(node)  # (what torchrun sets: node_id tells the nodes apart by it)
    return os.path.join(base, f"node{node}", "fast")


def _state(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(7)
    w = torch.randn(64, 24)
    b = torch.arange(10, dtype=torch.bfloat16)
    return {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": b, "step": 3}, w, b


def _save_and_spread(nodes, fast, state, k):
    """Save ``state`` as ``fast/step_3`` into each node's own directory, publish every node's
    part and replicate it to ``k`` peers; (the path, what this rank moved)."""
    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.tools import node_tier, series_extra

    path = os.path.join(fast, "step_3")
    writer = dcp.FileSystemWriter(path, node_local=True)
    dcp.save(state, checkpoint_id="fast/step_3", storage_writer=writer, extra=series_extra("step_{step}", 3))
    worker = node_tier.Background(30)
    out = {}

    def spread(c):
        table = node_tier.publish_parts(c, nodes, path, writer.staging_token)
        out["moved"] = node_tier.replicate(c, nodes, path, table, k, c.group)

    worker.submit(spread)
    assert worker.close() == []
    return path, out["moved"]


def _body(rank, world, base):
    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.tools import Comm, node_tier

    fast = _node_dir(base, rank)
    comm = Comm.create()
    nodes = node_tier.Nodes.discover(comm)
    assert nodes.count == 2 and nodes.node_of == (0, 0, 1, 1) and nodes.partners(1, 1) == [0]
    node_tier.check_sharing(comm, nodes, fast, True, "k")  # each node's own directory: accepted
    state, w, b = _state(rank, world)
    path, moved = _save_and_spread(nodes, fast, state, 1)
    names = sorted(os.listdir(path))
    # each node: its own files, the other node's replicas, the index and metadata.json
    assert names == ["chunk_index.safetensors", "metadata.json", "rank00000.safetensors", "rank00001.safetensors",
                     "rank00002.safetensors", "rank00003.safetensors"] or "objects" in "".join(names), names
    comm.agree("barrier", lambda: None)

    # node 1's disk is lost
    if rank == 2:
        shutil.rmtree(os.path.dirname(fast))
    comm.agree("lost", lambda: None)
    found = node_tier.survey(comm, nodes, fast, "step_{step}")
    assert set(found) == {"step_3"} and set(found["step_3"]) == {0}
    plan = node_tier.plan_restore(found["step_3"], nodes, durable_has=False)
    assert plan is not None and 0 not in plan.moves and all(src == 0 for _, src in plan.moves[1])
    summary = plan.summary(nodes)
    fetcher = node_tier.Background(30)
    fetcher.submit(lambda c: node_tier.fetch(c, nodes, fast, plan, c.group))
    assert fetcher.close() == []
    # every node reads its own copy: the model sharded, then another layout (all replicated)
    target = {"w": torch.distributed.tensor.zeros(64, 24, device_mesh=state["w"].device_mesh,
                                                  placements=state["w"].placements),
              "b": torch.zeros(10, dtype=torch.bfloat16), "step": 0}
    dcp.load(target, checkpoint_id="fast/step_3", storage_reader=node_tier.NodeLocalReader(path))
    full = {"w": torch.zeros(64, 24), "b": torch.zeros(10, dtype=torch.bfloat16), "step": 0}
    dcp.load(full, checkpoint_id="fast/step_3", storage_reader=node_tier.NodeLocalReader(path))
    return {"local_equal": torch.equal(target["w"].to_local(), state["w"].to_local()),
            "full_equal": torch.equal(full["w"], w) and torch.equal(full["b"], b) and full["step"] == 3,
            "summary": summary, "moved": moved}


def test_parts_published_replicated_and_restored_bitwise(tmp_path):
    results = run_ranks(4, _body, str(tmp_path))
    assert all(r["local_equal"] and r["full_equal"] for r in results)
    n0, n1 = list(results[0]["summary"])
    assert results[0]["summary"][n0] == {"local": len(results[0]["summary"][n0]) and results[0]["summary"][n0]["local"]}
    assert results[0]["summary"][n1]["local"] == 0 and results[0]["summary"][n1][f"from {n0}"] > 0
    # the leaders moved the files (rank 0 sent node 0's part and received node 1's; rank 1 moved nothing)
    assert results[0]["moved"]["files_sent"] > 0 and results[0]["moved"]["files_received"] > 0
    assert results[1]["moved"] == {"files_sent": 0, "bytes_sent": 0, "files_received": 0, "bytes_received": 0}


def _corrupt_body(rank, world, base):
    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.tools import Comm, node_tier

    fast = _node_dir(base, rank)
    comm = Comm.create()
    nodes = node_tier.Nodes.discover(comm)
    state, _, _ = _state(rank, world)
    path = os.path.join(fast, "step_3")
    writer = dcp.FileSystemWriter(path, node_local=True)
    dcp.save(state, checkpoint_id="fast/step_3", storage_writer=writer)
    worker = node_tier.Background(30)
    worker.submit(lambda c: node_tier.publish_parts(c, nodes, path, writer.staging_token))
    assert worker.close() == []
    if rank == 2:  # a byte of node 1's file flips on its disk after the commit
        name = os.path.join(path, "rank00002.safetensors")
        with open(name, "r+b") as f:
            f.seek(os.path.getsize(name) - 3)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    comm.agree("flipped", lambda: None)
    table = node_tier.Table.parse(open(os.path.join(path, "metadata.json")).read(), path)
    worker = node_tier.Background(30)
    worker.submit(lambda c: node_tier.replicate(c, nodes, path, table, 1, c.group))
    failures = worker.close()
    leftovers = sorted(n for n in os.listdir(path) if n.startswith("."))
    return {"failures": failures, "has_replica": os.path.exists(os.path.join(path, "rank00002.safetensors")),
            "leftovers": leftovers}


def test_a_replica_that_differs_from_its_checksum_is_refused_on_arrival(tmp_path):
    results = run_ranks(4, _corrupt_body, str(tmp_path))
    assert all(r["failures"] and "checksum" in r["failures"][0] and "rank00002.safetensors" in r["failures"][0]
               for r in results), [r["failures"] for r in results]
    assert results[0]["has_replica"] is False  # node 0 never gave it the name
    assert results[0]["leftovers"] == []  # nor kept the part received


@pytest.mark.parametrize("have, durable, expect", [
    ({0: ["a", "b"], 1: ["a", "b"]}, False, {}),
    ({0: ["a", "b"]}, False, {1: (("a", 0), ("b", 0))}),
    ({0: ["a"], 1: ["b"]}, False, {0: (("b", 1),), 1: (("a", 0),)}),
    ({0: ["a"]}, True, {0: (("b", -1),), 1: (("a", 0), ("b", -1))}),
    ({0: ["a"]}, False, None),
])
def test_plan_restore_takes_the_lowest_holder_then_the_durable_copy(have, durable, expect):
    from hpdcp_runner.dcp.tools import node_tier

    nodes = node_tier.Nodes((0, 0, 1, 1), ("h#0", "h#1"))
    held = {n: node_tier.Holding("step_3", 3, "d", {"a": 1, "b": 2}, tuple(files)) for n, files in have.items()}
    plan = node_tier.plan_restore(held, nodes, durable)
    assert (plan.moves if plan is not None else None) == expect


def test_plan_restore_ignores_a_node_whose_metadata_is_of_another_save():
    from hpdcp_runner.dcp.tools import node_tier

    nodes = node_tier.Nodes((0, 1, 2), ("h#0", "h#1", "h#2"))
    held = {0: node_tier.Holding("s", 3, "old", {"a": 1}, ("a",)),
            1: node_tier.Holding("s", 3, "new", {"a": 1}, ("a",)),
            2: node_tier.Holding("s", 3, "new", {"a": 1}, ())}
    plan = node_tier.plan_restore(held, nodes, False)
    assert plan.digest == "new" and plan.moves == {0: (("a", 1),), 2: (("a", 1),)}


def _three_nodes_body(rank, world, base, lost):
    """3 nodes of one rank, 2 replicas each (the ring: node n's part on n+1 and n+2); the nodes
    in ``lost`` lose their disks at once, the survivor's copy restores them. Blocks of 1,000
    bytes, so every file moves in many (the last one short) through both sides' double buffers."""
    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.tools import Comm, node_tier

    os.environ["GROUP_RANK"] = str(rank)
    fast = os.path.join(base, f"node{rank}", "fast")
    from hpdcp_runner.dcp import node_moves

    node_moves.BLOCK = 1000
    comm = Comm.create()
    nodes = node_tier.Nodes.discover(comm)
    assert nodes.count == 3 and nodes.partners(2, 2) == [0, 1]
    state, w, b = _state(rank, world)
    path, moved = _save_and_spread(nodes, fast, state, 2)
    held = sorted(n for n in os.listdir(path) if n.startswith("rank"))
    comm.agree("barrier", lambda: None)
    if rank in lost:
        shutil.rmtree(os.path.dirname(fast))
    comm.agree("lost", lambda: None)
    found = node_tier.survey(comm, nodes, fast, "step_{step}")
    plan = node_tier.plan_restore(found["step_3"], nodes, durable_has=False)
    fetcher = node_tier.Background(30)
    fetcher.submit(lambda c: node_tier.fetch(c, nodes, fast, plan, c.group))
    assert fetcher.close() == []
    full = {"w": torch.zeros(64, 24), "b": torch.zeros(10, dtype=torch.bfloat16), "step": 0}
    dcp.load(full, checkpoint_id="fast/step_3", storage_reader=node_tier.NodeLocalReader(path))
    return {"held": held, "moves": {n: sorted(m) for n, m in plan.moves.items()}, "moved": moved,
            "equal": torch.equal(full["w"], w) and torch.equal(full["b"], b) and full["step"] == 3,
            "files": sorted(os.listdir(path))}


@pytest.mark.parametrize("lost", [(1, 2), (0, 1)])
def test_three_nodes_two_replicas_survive_two_lost_disks(tmp_path, lost):
    results = run_ranks(3, _three_nodes_body, str(tmp_path), lost)
    ranks = ["rank00000.safetensors", "rank00001.safetensors", "rank00002.safetensors"]
    # with k=2 every node held every part (the rank files, and the objects file of the plain values)
    assert all(r["held"] == results[0]["held"] and set(ranks) <= set(r["held"]) for r in results), results
    sent = [r["moved"]["files_sent"] for r in results]
    assert sum(sent) == 2 * (len(results[0]["held"])) and all(r["moved"]["files_received"] >= 2 for r in results)
    survivor = ({0, 1, 2} - set(lost)).pop()
    moves = results[0]["moves"]
    assert sorted(moves) == sorted(lost) and all(src == survivor for n in lost for _, src in moves[n])
    assert all(r["equal"] and set(results[0]["held"]) <= set(r["files"]) for r in results)
    assert not any(f.startswith(".") for r in results for f in r["files"])


def _ranged_body(rank, world, base):
    """Node 1's disk lost; its ranks read their own shards and a few small replicated tensors
    that the save's dedup put in node 0's files: those files come over in the ranges read only,
    under a hidden name, and the same load is bitwise; a load reading more of them (the whole
    of ``w``) fails on a chunk's checksum instead of reading the holes as data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpdcp_runner import dcp
    from hpdcp_runner.dcp.tools import Comm, node_tier

    fast = _node_dir(base, rank)
    comm = Comm.create()
    nodes = node_tier.Nodes.discover(comm)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(11)
    w = torch.randn(1024, 512)  # 512 KiB a rank
    small = {f"r{i}": torch.randn(300 + i) for i in range(8)}  # replicated: written once, by any rank
    state = {"w": distribute_tensor(w, mesh, [Shard(0)]), **small}
    path, _ = _save_and_spread(nodes, fast, state, 1)
    comm.agree("saved", lambda: None)
    if rank == 2:
        shutil.rmtree(os.path.dirname(fast))
    comm.agree("lost", lambda: None)
    plan = node_tier.plan_restore(node_tier.survey(comm, nodes, fast, "step_{step}")["step_3"], nodes, False)

    def target():
        return {"w": torch.distributed.tensor.zeros(1024, 512, device_mesh=mesh, placements=[Shard(0)]),
                **{k: torch.zeros_like(v) for k, v in small.items()}}

    def run(p):
        job = node_tier.Background(30)
        job.submit(lambda c: node_tier.fetch(c, nodes, fast, p, c.group))
        assert job.close() == []

    run(plan.restrict({n: () for n in range(nodes.count)}, always=plan.essential))  # what every copy needs
    wanted = node_tier.wanted_files(lambda: dcp.load(target(), checkpoint_id="fast/step_3",
                                                     storage_reader=node_tier.NodeLocalReader(path, probe=True)))
    got = comm.all_gather_json(wanted, "wanted")
    by_node, ranges = node_tier.wanted_by_node(nodes, got, plan.files)
    rest = plan.restrict(by_node, ranges=ranges)
    rest = node_tier.replace(rest, moves={n: tuple(m for m in mv if m[0] not in plan.essential)
                                          for n, mv in rest.moves.items()})
    run(rest)
    loaded = target()
    dcp.load(loaded, checkpoint_id="fast/step_3", storage_reader=node_tier.NodeLocalReader(path))
    whole = {"w": torch.zeros(1024, 512)} if rank >= 2 else {}  # (node 1 reads it: nothing broadcast from 0)
    try:
        dcp.load(whole, checkpoint_id="fast/step_3", storage_reader=node_tier.NodeLocalReader(path), strict=False)
        refused = ""
    except Exception as e:  # agreed on every rank
        refused = f"{type(e).__name__}: {e}"
    return {"equal": torch.equal(loaded["w"].to_local(), state["w"].to_local())
            and all(torch.equal(loaded[k], v) for k, v in small.items()),
            "ranges": {str(n): sorted(r) for n, r in rest.ranges.items()}, "files": sorted(os.listdir(path)),
            "summary": rest.summary(nodes), "refused": refused}


def test_a_file_read_little_of_is_fetched_in_the_ranges_read(tmp_path):
    results = run_ranks(4, _ranged_body, str(tmp_path))
    assert all(r["equal"] for r in results)
    ranged = results[0]["ranges"]
    assert list(ranged) == ["1"] and ranged["1"], ranged  # node 1 only, some of node 0's files
    for name in ranged["1"]:
        assert name in ("rank00000.safetensors", "rank00001.safetensors")
        assert f".{name}.ranges" in results[2]["files"] and name not in results[2]["files"]
    assert "rank00002.safetensors" in results[2]["files"] and "rank00003.safetensors" in results[2]["files"]
    node1 = list(results[0]["summary"].values())[1]
    assert node1["of them in part"] == len(ranged["1"])
    assert all("checksum" in r["refused"] for r in results), [r["refused"] for r in results]


def test_wanted_by_node_merges_ranks_and_keeps_a_file_wanted_whole_whole():
    from hpdcp_runner.dcp.tools import node_tier

    nodes = node_tier.Nodes((0, 0, 1, 1), ("h#0", "h#1"))
    sizes = {"a": 100 << 20, "b": 100 << 20, "c": 10}
    per_rank = [{"a": None},  # node 0: all of a
                {"b": [[0, 10]]},
                {"a": [[0, 1 << 20]], "b": [[5 << 20, 6 << 20]]},  # node 1: a little of a and b
                {"a": [[(1 << 20) + 100, 2 << 20]], "b": None, "c": [[0, 10]]}]  # b whole on rank 3
    wanted, ranges = node_tier.wanted_by_node(nodes, per_rank, sizes)
    assert wanted == {0: {"a", "b"}, 1: {"a", "b", "c"}}
    assert ranges == {0: {"b": ((0, 10),)}, 1: {"a": ((0, 2 << 20),)}}  # joined; c: all of it is read
    assert node_tier.wanted_by_node(nodes, [None, {"a": None}, {"a": None}, {"a": None}], sizes)[0] == \
        {0: None, 1: {"a"}}


def test_a_file_only_the_durable_copy_holds_is_read_from_it_once():
    from hpdcp_runner.dcp.tools import node_tier

    plan = node_tier.RestorePlan("s", 3, "d", {"a": 10, "b": 10, "c": 10},
                                 {0: (("a", -1), ("b", -1)), 1: (("a", -1), ("b", -1), ("c", 0)), 2: (("a", -1),)},
                                 ranges={0: {"a": ((0, 4),)}, 1: {"b": ((0, 4),)}})
    shared = plan.share_durable_reads()
    # a: node 0 wants part of it, node 1 the whole (reads it), node 2 the whole (gets it from 1);
    # b: node 0 reads it whole, node 1 gets its part from node 0
    assert shared.moves == {0: (("a", 1), ("b", -1)), 1: (("a", -1), ("b", 0), ("c", 0)), 2: (("a", 1),)}
    only_parts = node_tier.RestorePlan("s", 3, "d", {"a": 10}, {0: (("a", -1),), 1: (("a", -1),)},
                                       ranges={0: {"a": ((0, 4),)}, 1: {"a": ((5, 9),)}})
    assert only_parts.share_durable_reads().moves == only_parts.moves  # nobody holds it whole: each reads its own
