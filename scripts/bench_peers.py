"""Ours beside the checkpointing libraries a PyTorch user would pick, in one run on one state and disk.

    pip install -e ".[peers]"      # torch-checkpointing (Meta), pinned
    # ByteCheckpoint pins torch<=2.5: into a directory of its own, never the project's environment
    pip install --no-deps --target /tmp/bcp bytecheckpoint==0.0.2 mmh3 universal-pathlib cachetools grpcio protobuf==3.20.3
    OMP_NUM_THREADS=1 python scripts/bench_peers.py --reps 5 --scale 0.125 --bytecheckpoint-path /tmp/bcp
    OMP_NUM_THREADS=1 python scripts/bench_peers.py --reps 5 --scale 0.125 --train-steps 40 --train-only

The script runs each group of libraries as its own torchrun job (ours, torch DCP and
torch-checkpointing in one; ByteCheckpoint, whose gRPC coordinator and background services do
not share a process with the others, in another, with its directory on that job's path only)
and merges the results into one table.

Peers, each in the mode its documentation recommends, with its version printed:

* torch.distributed.checkpoint (torch's own): ``FileSystemWriter`` with ``thread_count`` 1 and 2,
  the better of the two counted; async: ``async_save`` (its thread executor);
* torch-checkpointing 0.1.1 (``CheckpointManager``, a ``DefaultResharder`` on every item so a
  checkpoint can be loaded under another sharding): sync saves through
  ``SyncCheckpointSaverConfig``, async through its default ``AsyncCheckpointSaverConfig``
  (host staging, a spawned writer process). On this machine kind it needs two things from the
  user: ``use_direct_io=False`` (O_DIRECT writes fail on this file system) and a CPU all-gather
  in place of its metadata exchange, which builds CUDA tensors (here: ``all_gather_object`` on
  the job's gloo group). It never fsyncs: its saves end in the page cache, so its save times
  are set beside the page-cache bound, ours beside the durable one;
* ByteCheckpoint 0.0.2 (the NSDI'25 paper's code): it pins torch <= 2.5 but runs on torch 2.13
  installed with ``--no-deps`` beside its own dependencies; its FSDP2 checkpointer
  (``framework="fsdp2"``) saves and loads an FSDP2 module, so it runs the sharded cases only (a
  row says n/a for the others). Its first save starts its coordinator (an untimed warm-up). It
  finds its host by a UDP connect to 8.8.8.8, which fails without a route out and leaves its
  coordinator silent: its job gets a ``sitecustomize`` sending that connect to the loopback.
  Without ``--bytecheckpoint-path`` its column says it was not run.

Cases (2 ranks, the state of ``bench_vs_torch_dcp.py``: 15 big matrices, 64 medium, 2000 small
vectors, fp32; ``--scale`` scales the big ones' rows): save of Shard(0) DTensors (sharded), of
plain tensors on both ranks (replicated) and of an LLM-like training state (``llm_state``: a
32-layer Llama-shaped model and its AdamW moments and steps), warm load of each, reshard Shard(0) ->
Shard(1) on the same 2 ranks, and the time an async save blocks the caller (``--layouts``: which
states). The states take turns at being timed first. Every load is checked element by element.
Times are the max over ranks; medians with min-max over ``--reps``; ratio = best peer's median /
ours. A peer that fails is a row with its error, never a missing row. ``hpdcp_runner (no
fsync)`` is our save without fsync, like for like with a library that never syncs. The bounds of
the same disk, measured right after each of our saves (this disk drifts within a run): the
durable write (sequential writes + fdatasync) and the page-cache write (no fdatasync) of the bytes
our save wrote on each rank, and a row of our save's time over that durable bound, paired.

``--train-steps N``: what async saves cost a training loop, each library in the same loop over
the sharded state (``train_loop``: a fixed compute per step, the optimizer's in-place update of
every shard being saved, a gradient all-reduce; an async save every ``--train-every`` steps, the
next one waiting for the last; ours as the runner saves, ``staging="background"``, the loop waiting
for the staging copy just before the optimizer's update, which counts as blocking). Per library and repetition: the median step of a loop with no
saves (run just before, the same library's turn), the median step that ran while a persist was
in flight (on any rank), their ratio, the median time ``async_save`` blocked the loop, and what a
save cost the loop in all (the steps beside its persist over the loop without saves, plus its
blocking, per save: a short intense persist and a long gentle one compared by their total). The
first save and the steps up to the second are warm-up, left out. ByteCheckpoint's async save
returns no handle, so when its persist ends is unknown: its rows say so.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from torch.distributed.device_mesh import DeviceMesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_torch_dcp import check, durable_write, settle, timed, warm, workload, zeros_like_sd  # noqa: E402

from hpdcp_runner import dcp  # noqa: E402


def llm_state(scale: float, mesh: DeviceMesh | None) -> dict:
    """An LLM-like training state, flat as the libraries take it: a Llama-shaped model of 32 layers
    (hidden ``2048 * scale``, MLP 2.75x that, vocabulary 4096, norms) and AdamW's state for each
    weight (``exp_avg``, ``exp_avg_sq`` and a scalar ``step``), every weight and moment a Shard(0)
    DTensor as FSDP2 keeps them (plain tensors without a mesh), each step a plain scalar tensor: a
    thousand tensors, large matrices beside hundreds of tiny values, as a training job's
    checkpoint is (``--scale`` narrows the model, never its depth)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    hidden = max(64, int(2048 * scale) // 64 * 64)
    ffn, vocab, layers = int(hidden * 2.75), 4096, 32
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        at = f"model.layers.{i}."
        shapes.update({f"{at}self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"})
        shapes.update({f"{at}mlp.gate_proj.weight": (ffn, hidden), f"{at}mlp.up_proj.weight": (ffn, hidden),
                       f"{at}mlp.down_proj.weight": (hidden, ffn), f"{at}input_layernorm.weight": (hidden,),
                       f"{at}post_attention_layernorm.weight": (hidden,)})
    g = torch.Generator().manual_seed(0)
    place = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if mesh is not None else (lambda t: t)
    sd: dict = {}
    for name, shape in shapes.items():
        sd[name] = place(torch.empty(shape).uniform_(generator=g))
        sd[f"optim.state.{name}.exp_avg"] = place(torch.empty(shape).uniform_(generator=g))
        sd[f"optim.state.{name}.exp_avg_sq"] = place(torch.empty(shape).uniform_(generator=g))
        sd[f"optim.state.{name}.step"] = torch.tensor(1000.0)
    return sd


def page_cache_write(path: str, nbytes: int) -> None:
    """The same writes as ``durable_write`` without the fdatasync: what a save that never syncs
    is bounded by."""
    buf = memoryview(bytearray(b"\x5a" * min(nbytes, 16 << 20)))
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            n = min(left, len(buf))
            f.write(buf[:n])
            left -= n


class Pending:
    """An async save in flight: ``done()`` (None when the library gives no handle) and ``wait()``."""

    def __init__(self, fut: Any) -> None:
        self.fut = fut

    def done(self) -> bool | None:
        return None if self.fut is None else bool(self.fut.done())

    def wait(self) -> None:
        if self.fut is not None:
            self.fut.result()

    def wait_staged(self) -> None:
        """Before the loop changes the state: a save whose staging copy runs beside the step
        (ours, ``staging="background"``) is waited for here; the others staged in the call."""
        if hasattr(self.fut, "wait_staged"):
            self.fut.wait_staged()


class TorchCheckpointing:
    """torch-checkpointing's ``CheckpointManager`` (see the module docstring)."""

    name = "torch-checkpointing"

    def __init__(self) -> None:
        import torch_checkpointing as tc
        from torch_checkpointing import metadata_manager
        from torch_checkpointing.default_resharder import DefaultResharder
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        def gather_on_cpu(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
            out: list[Any] = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(out, data, group=process_group)
            return dict(enumerate(out))

        # its metadata exchange builds CUDA tensors; on CPU the same exchange over gloo
        metadata_manager.DefaultMetadataManager._all_gather_pickled_data = gather_on_cpu
        self.version = tc.__version__
        storage = LocalFileSystemStorageConfig(use_direct_io=False)

        def manager(save_config: Any) -> Any:
            # a reused manager caches its sharding metadata and writes it with its first save
            # only; a fresh one per checkpoint keeps every checkpoint reshardable
            return tc.CheckpointManager.Config(default=tc.ItemSpec(resharder=DefaultResharder()), save=save_config,
                                               storage_config=storage).build()

        self._sync = lambda: manager(tc.SyncCheckpointSaverConfig())
        # one async manager for the run, as a training loop keeps one: its writer process is
        # started once (by the untimed warm-up save), not per checkpoint
        self._async = manager(tc.AsyncCheckpointSaverConfig())

    def save(self, sd: dict, path: str) -> None:
        m = self._sync()
        try:
            m.save(path, {"model": sd})
        finally:
            m.close()

    def load(self, tgt: dict, path: str) -> None:
        m = self._sync()
        try:
            m.load(path, into={"model": tgt})
        finally:
            m.close()

    def async_save(self, sd: dict, path: str) -> "Pending":
        """Blocks until the state is staged (the caller may change it again): its ``save``
        returns before staging ends, so the blocking part includes the staging future it keeps
        (a private attribute: the library exposes no public wait for it). Ours and torch DCP's
        ``async_save`` return once staged."""
        fut = self._async.save(path, {"model": sd})
        staging = getattr(self._async, "_staging_future", None)
        if staging is not None:
            staging.result()
        return Pending(fut)

    def close(self) -> None:
        self._async.close()


class TorchDCP:
    name = "torch DCP"

    def __init__(self, threads: int) -> None:
        self.threads, self.version = threads, torch.__version__.split("+")[0]
        self.name = f"torch DCP tc={threads}"

    def save(self, sd: dict, path: str) -> None:
        tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(path, thread_count=self.threads))

    def load(self, tgt: dict, path: str) -> None:
        tdcp.load(tgt, storage_reader=tdcp.FileSystemReader(path))

    def async_save(self, sd: dict, path: str) -> "Pending":
        return Pending(tdcp.async_save(sd, storage_writer=tdcp.FileSystemWriter(path, thread_count=self.threads)))


class Ours:
    name = "hpdcp_runner"

    def __init__(self, mode: str = "thread") -> None:
        self.version, self.mode = "this tree", mode
        if mode != "thread":
            self.name = f"hpdcp_runner ({mode})"

    def save(self, sd: dict, path: str) -> None:
        if self.mode == "no fsync":  # like for like with a library that never syncs (torch-checkpointing)
            dcp.save(sd, storage_writer=dcp.open_writer(path, fsync=False))
        else:
            dcp.save(sd, checkpoint_id=path)

    def load(self, tgt: dict, path: str) -> None:
        dcp.load(tgt, checkpoint_id=path)

    def async_save(self, sd: dict, path: str) -> "Pending":
        # cache_plan: what the runner's saves use (dcp.cache_plan=true): a save of the layout of the
        # last one skips planning, which otherwise runs beside the training loop
        return Pending(dcp.async_save(sd, checkpoint_id=path, mode=self.mode, cache_plan=True))

    def loop_save(self, sd: dict, path: str) -> "Pending":
        """In the training loop, as the runner saves (``dcp.async_staging=background``): the call
        returns once the staged structure exists, the copy runs beside the step, and the loop
        waits for it (``wait_staged``) only before the optimizer changes the state."""
        return Pending(dcp.async_save(sd, checkpoint_id=path, mode=self.mode, cache_plan=True, staging="background"))

    def supports(self, case: str) -> str | None:
        if self.mode == "no fsync":
            return None if case.endswith(" save") else "(the save only: its load is hpdcp_runner's)"
        if self.mode != "thread" and case not in ("async save, blocking", "train"):
            return "(the sync save and load of hpdcp_runner)"
        return None


class ByteCheckpoint:
    """ByteCheckpoint's FSDP2 checkpointer (``bytecheckpoint.save/load(..., framework="fsdp2")``):
    the state as an FSDP2 module whose parameters are the workload's tensors (``fully_shard``:
    Shard(0) DTensors, as our sharded case). Its replicated and Shard(1) layouts are not what an
    FSDP2 checkpointer takes: those rows say so. Its coordinator is a gRPC server in a spawned
    process, started by the first save (an untimed warm-up here, as its docs call it a one-time
    cost); it finds its host by a UDP connect to 8.8.8.8, sent to the loopback address by the
    ``sitecustomize`` the orchestrator puts first on its path."""

    name = "ByteCheckpoint"

    def __init__(self) -> None:
        import bytecheckpoint

        self.bcp = bytecheckpoint
        self.version = getattr(getattr(bytecheckpoint, "version", None), "__version__", None) or "0.0.2"
        self._models: dict[int, Any] = {}

    def _module(self, sd: dict) -> Any:
        from torch import nn
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        if id(sd) not in self._models:
            m = nn.Module()
            m.p = nn.ParameterList([nn.Parameter(v.full_tensor() if isinstance(v, DTensor) else v.clone())
                                    for v in sd.values()])
            mesh = next(v.device_mesh for v in sd.values() if isinstance(v, DTensor))
            fully_shard(m, mesh=mesh)
            self._models[id(sd)] = (m, sd)
        return self._models[id(sd)][0]

    def supports(self, case: str) -> str | None:
        if case.startswith("replicated"):
            return "n/a: its FSDP2 checkpointer holds Shard(0) parameters only"
        if case.startswith("LLM-like"):
            return "n/a: its FSDP2 checkpointer takes a module and its optimizer, not a state's scalar steps"
        if case.startswith("reshard"):
            return "n/a: its FSDP2 checkpointer loads into Shard(0) parameters only"
        if case == "train":
            return "n/a: its async save returns no handle, so the steps beside its persist are not known"
        return None

    def save(self, sd: dict, path: str) -> None:
        self.bcp.save(path, {"model": self._module(sd)}, framework="fsdp2")

    def load(self, tgt: dict, path: str) -> None:
        m = self._module(tgt)
        self.bcp.load(path, {"model": m}, framework="fsdp2")
        with torch.no_grad():  # back into the workload's DTensors, for the check
            for v, p_ in zip(tgt.values(), m.parameters()):
                v.to_local().copy_(p_.to_local())

    def async_save(self, sd: dict, path: str) -> "Pending":
        self.bcp.save(path, {"model": self._module(sd)}, framework="fsdp2", fast_saving=True)
        return Pending(None)  # (it returns no handle: when its persist ends is not known here)


LAYOUTS = ("sharded", "replicated", "LLM-like")
TRAIN_CASES = ("train: step, loop without saves", "train: step beside a persist",
               "train: step beside a persist / without saves", "train: blocking per save",
               "train: loop time lost per save")
GROUPS = {"main": ("hpdcp_runner", "torch DCP", "torch-checkpointing"), "bytecheckpoint": ("ByteCheckpoint",)}


def _peers(group: str, threads: int) -> tuple[list[Any], dict[str, str]]:
    """The libraries of this job that run here, and why each of the others does not."""
    makers: dict[str, Callable[[], list[Any]]] = {
        "hpdcp_runner": lambda: [Ours(), Ours("process"), Ours("no fsync")], "torch DCP": lambda: [TorchDCP(1), TorchDCP(threads)],
        "torch-checkpointing": lambda: [TorchCheckpointing()], "ByteCheckpoint": lambda: [ByteCheckpoint()]}
    libs: list[Any] = []
    failed = {}
    for name in GROUPS[group]:
        try:
            libs += makers[name]()
        except Exception as e:  # a row with its error, never a missing row
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return libs, failed


SITECUSTOMIZE = """# written by scripts/bench_peers.py for ByteCheckpoint's job only: it finds its host by a UDP
# connect to 8.8.8.8, which fails without a route out (its coordinator then never answers)
import socket
_connect = socket.socket.connect
def _loopback(self, addr, *a):
    if self.type == socket.SOCK_DGRAM and isinstance(addr, tuple) and addr[0] == "8.8.8.8":
        addr = ("127.0.0.1", addr[1])
    return _connect(self, addr, *a)
socket.socket.connect = _loopback
"""


def train_loop(lib: Any, sd: dict, args: Any, path: str | None) -> dict[str, list[float]]:
    """A training loop over the sharded state: each step a fixed compute (``--train-matmuls``
    384x384 matmuls), the optimizer's in-place update of every local shard being saved, and a
    gradient all-reduce (the ranks step together). With ``path``, an async save every
    ``--train-every`` steps (the next waits for the last to finish, as a loop that keeps one in
    flight). Per step, the max over ranks of its time (a save step's without its blocking part)
    and whether a persist was in flight at its start on any rank. The first save and the steps
    up to the second are warm-up (a writer thread or process starting), left out."""
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(dist.get_rank())
    group = args.grad_group
    a = torch.randn(384, 384, generator=g) / 20
    shards = [v.to_local() if isinstance(v, DTensor) else v for v in sd.values()]
    every = args.train_every
    times, busy, blocking = [], [], []
    pending = None
    first_counted = every + every // 2 if path else 0
    for i in range(args.train_steps):
        t0, blocked = time.perf_counter(), 0.0
        if path and i % every == every // 2:
            if pending is not None:
                pending.wait()
            b0 = time.perf_counter()
            pending = getattr(lib, "loop_save", lib.async_save)(sd, f"{path}-{i}")
            blocked = time.perf_counter() - b0
        in_flight = pending is not None and pending.done() is not True
        x = a
        for _ in range(args.train_matmuls):
            x = torch.tanh(x @ a)
        if pending is not None:  # (the optimizer's update changes what is being saved)
            w0 = time.perf_counter()
            pending.wait_staged()
            blocked += time.perf_counter() - w0
        if path and i % every == every // 2 and i >= first_counted:
            blocking.append(blocked)
        with torch.no_grad():
            for t in shards:
                t.mul_(0.9999)
        dist.all_reduce(x[:1, :1].contiguous(), group=group)
        if i >= first_counted:
            times.append(time.perf_counter() - t0 - blocked)
            busy.append(float(in_flight))
    if pending is not None:
        pending.wait()
    t = torch.tensor(times, dtype=torch.float64)
    b = torch.tensor(busy, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(b, op=dist.ReduceOp.MAX, group=group)
    bl = torch.tensor(blocking, dtype=torch.float64)
    dist.all_reduce(bl, op=dist.ReduceOp.MAX, group=group)
    over = [x for x, f in zip(t.tolist(), b.tolist()) if f]
    free = [x for x, f in zip(t.tolist(), b.tolist()) if not f]
    return {"over": over, "free": free, "blocking": bl.tolist(), "all": t.tolist()}


def worker(args: Any) -> None:
    """One torchrun job: the cases of one group of libraries, results as JSON (rank 0)."""
    import json

    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(ws)))
    libs, failed = _peers(args.worker, args.dcp_threads)
    base = os.path.join(args.dir or tempfile.gettempdir(), f"hpdcp-peers-{os.environ.get('MASTER_PORT', '0')}")
    times: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, dict[str, str]] = {}
    bounds: dict[str, list[float]] = {}

    def case(what: str, lib: Any, fn: Callable[[], None]) -> bool:
        if lib.name in errors.get(what, {}):
            return False
        why = getattr(lib, "supports", lambda c: None)(what)
        if why:
            errors.setdefault(what, {})[lib.name] = why
            return False
        try:
            times.setdefault(what, {}).setdefault(lib.name, []).append(timed(fn))
            return True
        except Exception as e:
            if rank == 0:
                traceback.print_exc()
            errors.setdefault(what, {})[lib.name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            return False

    def bound(layout: str, path: str, ours: float) -> None:
        """The disk's bounds for the bytes our save just wrote on this rank, measured right after
        it (the disk's state drifts over a run: a case timed after others is slower for every
        library that syncs), and our save's time over the durable one, paired."""
        mine = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.startswith(f"rank{rank:05d}"))
        for kind, write in (("durable", durable_write), ("page cache", page_cache_write)):
            settle()
            t = timed(lambda: write(f"{path}-bound-{rank}", mine))
            os.unlink(f"{path}-bound-{rank}")
            bounds.setdefault(f"{layout} {kind}", []).append(t)
            if kind == "durable":
                times.setdefault(f"{layout} save / durable bound", {}).setdefault("hpdcp_runner", []).append(ours / t)
        settle()

    for rep in range(0 if args.train_only else args.reps):
        root = f"{base}/rep{rep}"
        order = libs if rep % 2 == 0 else libs[::-1]
        # each state first, second and third in turn: a case run after others pays for their
        # writes (its fsyncs slower though every dirty page was written back), so none always does
        turn = rep % len(args.layouts)
        for layout in args.layouts[turn:] + args.layouts[:turn]:
            sd = llm_state(args.scale, mesh) if layout == "LLM-like" else workload(args.scale, layout, mesh)
            for lib in order:
                path = f"{root}/{layout}-{lib.name.replace(' ', '_').replace('=', '')}"
                if rep == 0 and args.worker == "bytecheckpoint" and layout == "sharded":
                    lib.save(sd, f"{path}-warmup")  # its coordinator's start: a one-time cost, untimed
                settle()
                if case(f"{layout} save", lib, lambda: lib.save(sd, path)):
                    if lib.name == "hpdcp_runner":
                        bound(layout, path, times[f"{layout} save"][lib.name][-1])
                    warm(path)
                tgt = zeros_like_sd(sd)
                if case(f"{layout} load, warm", lib, lambda: lib.load(tgt, path)):
                    check(sd, tgt)
                if layout == "sharded":
                    ref1 = workload(args.scale, "sharded", mesh, dim=1)
                    tgt = zeros_like_sd(ref1)
                    if case("reshard S0->S1, warm", lib, lambda: lib.load(tgt, path)):
                        check(ref1, tgt)
                    if rep == 0:  # warm-up, untimed: a writer thread or process started, buffers allocated
                        try:
                            lib.async_save(sd, f"{path}-warmup-async").wait()
                        except Exception:
                            pass
                        dist.barrier()
                    settle()
                    waits: list[Pending] = []
                    case("async save, blocking", lib, lambda: waits.append(lib.async_save(sd, f"{path}-async")))
                    for w in waits:
                        w.wait()
                    dist.barrier()
            del sd
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    # the loop's gradient all-reduce on a group of its own, as a training job's data-parallel group
    # is: the libraries' background collectives use the default group
    args.grad_group = dist.new_group(backend="gloo") if args.train_steps else None
    for rep in range(args.reps if args.train_steps else 0):  # the training loop, each library beside a loop without saves
        root = f"{base}/train{rep}"
        state = workload(args.scale, "sharded", mesh)
        for lib in (libs if rep % 2 == 0 else libs[::-1]):
            why = getattr(lib, "supports", lambda c: None)("train")
            if why:
                for c in TRAIN_CASES:
                    errors.setdefault(c, {})[lib.name] = why
                continue
            settle()
            plain = train_loop(lib, state, args, None)
            settle()
            try:
                got = train_loop(lib, state, args, f"{root}/{lib.name.replace(' ', '_').replace('=', '')}")
            except Exception as e:
                if rank == 0:
                    traceback.print_exc()
                for c in TRAIN_CASES:
                    errors.setdefault(c, {})[lib.name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                continue
            base_step = statistics.median(plain["all"])
            for c, v in (("train: step, loop without saves", base_step),
                         ("train: step beside a persist", statistics.median(got["over"]) if got["over"] else None),
                         ("train: step beside a persist / without saves",
                          statistics.median(got["over"]) / base_step if got["over"] else None),
                         ("train: blocking per save", statistics.median(got["blocking"]) if got["blocking"] else None),
                         # what a save costs the loop in all: the steps beside its persist, over what
                         # they take without saves, plus its blocking; per save
                         ("train: loop time lost per save",
                          (sum(got["over"]) - len(got["over"]) * base_step + sum(got["blocking"])) / len(got["blocking"])
                          if got["blocking"] else None)):
                if v is not None:
                    times.setdefault(c, {}).setdefault(lib.name, []).append(v)
        del state
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    for lib in libs:
        getattr(lib, "close", lambda: None)()
    if rank == 0:
        with open(args.results, "w") as f:
            json.dump({"times": times, "errors": errors, "bounds": bounds, "failed": failed, "world_size": ws,
                       "libs": [[lib.name, lib.version] for lib in libs]}, f)
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


def main() -> None:
    """Without ``--worker``: the orchestrator. Each group of libraries runs as its own torchrun job
    (ByteCheckpoint's background services and the others' do not share one process group), and
    the results are merged into one table."""
    import json
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.125, help="scales the big matrices' rows (1 = 1 GiB in all)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--dcp-threads", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS,
                    help="the states whose save and load are timed (default: all)")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also run a training loop of this many steps per library (0: not run)")
    ap.add_argument("--train-every", type=int, default=8, help="an async save every this many steps")
    ap.add_argument("--train-only", action="store_true", help="only the training loop (with --train-steps)")
    ap.add_argument("--train-matmuls", type=int, default=24, help="the compute of one step")
    ap.add_argument("--bytecheckpoint-path", default=None,
                    help="a directory holding bytecheckpoint and its dependencies (pip install --no-deps --target), "
                         "put on its job's PYTHONPATH only")
    ap.add_argument("--out", default=None, help="append the markdown table here")
    ap.add_argument("--worker", choices=sorted(GROUPS), help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    merged: dict[str, Any] = {"times": {}, "errors": {}, "bounds": {}, "failed": {}, "libs": []}
    with tempfile.TemporaryDirectory(prefix="hpdcp-peers-") as tmp:
        for group in GROUPS:
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            if group == "bytecheckpoint":
                if not args.bytecheckpoint_path:
                    merged["failed"]["ByteCheckpoint"] = ("not installed here: it pins torch<=2.5; pass "
                                                          "--bytecheckpoint-path (see the module docstring)")
                    continue
                with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
                    f.write(SITECUSTOMIZE)
                env["PYTHONPATH"] = os.pathsep.join([tmp, args.bytecheckpoint_path, env.get("PYTHONPATH", "")])
            results = os.path.join(tmp, f"{group}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", __file__,
                   "--worker", group, "--results", results, "--reps", str(args.reps), "--scale", str(args.scale),
                   "--dcp-threads", str(args.dcp_threads), "--train-steps", str(args.train_steps),
                   "--train-every", str(args.train_every), "--train-matmuls", str(args.train_matmuls),
                   "--layouts", *args.layouts] \
                + (["--train-only"] if args.train_only else []) \
                + (["--dir", args.dir] if args.dir else [])
            r = subprocess.run(cmd, env=env)
            if r.returncode or not os.path.exists(results):
                for name in GROUPS[group]:
                    merged["failed"][name] = f"its job exited {r.returncode}"
                continue
            with open(results) as f:
                got = json.load(f)
            for key in ("times", "errors"):
                for c, per in got[key].items():
                    merged[key].setdefault(c, {}).update(per)
            for k, v in got["bounds"].items():
                merged["bounds"].setdefault(k, v)
            merged["failed"].update(got["failed"])
            merged["libs"] += got["libs"]
            merged["world_size"] = got["world_size"]
    text = report(args, merged)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


def _cell(xs: list[float] | None) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def report(args: Any, m: dict) -> str:
    cases = ([] if args.train_only else [c for c in (
        "sharded save", "replicated save", "LLM-like save", "sharded load, warm", "replicated load, warm",
        "LLM-like load, warm", "reshard S0->S1, warm", "async save, blocking") if c.split(" ")[0] in args.layouts
        or ("sharded" in args.layouts and c.split(" ")[0] in ("reshard", "async"))]) \
        + (list(TRAIN_CASES) if args.train_steps else [])
    names = [n for n, _ in m["libs"]] + [n for n in m["failed"] if n not in {x for x, _ in m["libs"]}]
    ws = m.get("world_size", args.nproc)
    size = sum(t.numel() * t.element_size() for t in workload(args.scale, "replicated", None).values()) / 2**30
    llm = llm_state(args.scale, None)
    llm_size = sum(t.numel() * t.element_size() for t in llm.values()) / 2**30
    versions = ", ".join(f"{n} {v}" for n, v in m["libs"] if n != "torch DCP tc=1")
    train = (f" --train-steps {args.train_steps} --train-every {args.train_every} --train-matmuls {args.train_matmuls}"
             + (" --train-only" if args.train_only else "") if args.train_steps else "")
    nproc = f" --nproc {args.nproc}" if args.nproc != 2 else ""
    layouts = f" --layouts {' '.join(args.layouts)}" if list(args.layouts) != list(LAYOUTS) else ""
    lines = [f"Command: `OMP_NUM_THREADS=1 python scripts/bench_peers.py --reps {args.reps}{nproc} --scale {args.scale}{layouts}{train}"
             + (" --bytecheckpoint-path <dir>" if args.bytecheckpoint_path else "") + "`", "",
             f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, gloo on CPU, "
             f"{ws} ranks, local disk; state {size:.3f} GiB (LLM-like: {llm_size:.3f} GiB in {len(llm)} tensors, "
             f"{sum(1 for t in llm.values() if t.dim() == 0)} of them scalars). Versions: {versions}."
             + (" Not run: " + "; ".join(f"{k} ({v})" for k, v in m["failed"].items()) if m["failed"] else ""), "",
             "Seconds: median (min-max) over repetitions, max over ranks. Ratio = the best peer's median / ours "
             "(> 1: we are faster).", "",
             "| case | " + " | ".join(names) + " | best peer | ratio |",
             "|---|" + "---|" * (len(names) + 2)]
    for c in cases:
        row, peers = [], []
        for n in names:
            err = m["errors"].get(c, {}).get(n) or ("not run" if n in m["failed"] else None)
            xs = m["times"].get(c, {}).get(n)
            if err or not xs:
                row.append(err or "-")
                continue
            row.append(_cell(xs))
            if not n.startswith("hpdcp_runner"):
                peers.append((statistics.median(xs), n))
        ours = m["times"].get(c, {}).get("hpdcp_runner")
        best = min(peers) if peers else None
        ratio = f"**{best[0] / statistics.median(ours):.2f}x**" if best and ours else "-"
        lines.append(f"| {c} | " + " | ".join(row) + f" | {best[1] if best else '-'} | {ratio} |")
    for layout in (() if args.train_only else args.layouts):
        xs = m["times"].get(f"{layout} save / durable bound", {}).get("hpdcp_runner")
        if xs:
            lines.append(f"| {layout} save: ours / the durable bound measured right after it | {_cell(xs)} |"
                         + " |" * (len(names) + 1))
    lines.append("")
    b = m["bounds"]
    for layout in (() if args.train_only else args.layouts):
        lines.append(f"- {layout} save, the bounds of this disk for the bytes our save wrote per rank, measured "
                     f"right after each of our saves: durable write "
                     f"{_cell(b.get(f'{layout} durable'))} s, page-cache write {_cell(b.get(f'{layout} page cache'))} s "
                     f"(torch-checkpointing never fsyncs: its saves end in the page cache)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
