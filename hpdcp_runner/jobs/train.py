"""train: a small GPT-like model trained deterministically, checkpointed every K steps, resumable.

Checkpoints hold the model, the FQN-keyed optimizer state, the step, the data position, the
global RNG and the loss history, plus each rank's own torch RNG under ``rank_state.rank<N>``.
``checkpoint.resume=latest`` continues from the newest *committed* checkpoint in
``checkpoint.dir`` (staging, trash and unfinished directories are never used), under any layout
and world size.

State that cannot be resharded, and the rule for it when the world size changes:
* the data position is global (samples consumed); each rank's share is recomputed from it and
  the new world size, so it remaps exactly;
* the global RNG (data order, dropout seeds) is one replicated stream: restored as is;
* the per-rank torch RNG states: restored rank by rank at the same world size; otherwise
  ``checkpoint.rank_state=reseed`` (default) reseeds rank r from (model.seed, step, r) and says
  so in a warning and in the result, and ``checkpoint.rank_state=error`` refuses to resume.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from typing import Any, Iterator

import torch

from .. import dcp
from ..dcp import (CheckpointNotFoundError, ConfigError, CorruptCheckpointError, HpdcpError, KeyMismatchError,
                   MetadataError)
from ..dcp.tools import (save_in_flight, get_logger, join_location, list_checkpoints, node_tier, series_outsiders,
                         unrecorded_checkpoints)
from ..config import checkpoint_series
from ..tiers import Tiers
from ..training import Trainer, build_model
from .context import JobContext

log = get_logger(__name__)


def _state(tr: Trainer, rank: int, losses: dict[int, float], with_rank_state: bool = True) -> dict[str, Any]:
    state: dict[str, Any] = {
        "model": tr.model.state_dict(),
        "optim": dcp.get_optim_state_dict(tr.model, tr.opt),
        "train": {"step": tr.step, "data_position": tr.data_position, "rng": tr.rng.get_state(),
                  "losses": [[s, v] for s, v in sorted(losses.items())]},
    }
    if with_rank_state:
        state["rank_state"] = {f"rank{rank}": {"torch_rng": torch.get_rng_state()}}
    return state


def _resume_candidates(ctx: JobContext, tiers: Tiers | None = None) -> Iterator[str]:
    """``checkpoint.resume``: a path, or ``latest`` = the newest checkpoint of this job's series
    (``checkpoint.name``) in ``checkpoint.dir`` by recorded step, never by a number in a name;
    with a fast tier, the newest whole one in either tier (``tiers.Tiers.whole``). For
    ``latest`` the older ones follow, newest first: what the resume falls back to when the one
    it chose fails its checksums (a path given by the user has no fallback)."""
    resume = ctx.cfg.checkpoint.resume
    if not resume:
        return
    if resume != "latest":
        yield ctx.abspath(resume)
        return
    if tiers is not None:
        found = False
        for cand in tiers.whole():
            found = True
            log.info("checkpoint.resume=latest: resuming from %s (the %s tier)", cand.path, cand.tier)
            yield cand.path
        if not found:
            log.info("checkpoint.resume=latest: no whole checkpoint of series %r in %s or %s; starting at step 0",
                     ctx.series[1], tiers.fast, tiers.durable)
        return
    ckdir, series = ctx.checkpoint_dir, ctx.series[1]
    entries = list_checkpoints(ckdir, series)
    if not entries:
        legacy = unrecorded_checkpoints(ckdir, series)
        if legacy:
            raise ConfigError(f"checkpoint.resume=latest: {ckdir} holds {', '.join(legacy[:5])} named like the series "
                              f"{series!r} but recording no series or step (written by another tool or an older "
                              f"version); resume one of them by path: checkpoint.resume=<path>")
        log.info("checkpoint.resume=latest: no committed checkpoint of series %r in %s; starting at step 0",
                 series, ckdir)
    for e in reversed(entries):
        log.info("checkpoint.resume=latest: resuming from %s", e.path)
        yield e.path


#: what makes a resume try the next newest copy: that copy's bytes or files are bad, nothing else
_TRY_NEXT = (CorruptCheckpointError, MetadataError, CheckpointNotFoundError)


def _resume(ctx: JobContext, tr: Trainer, losses: dict[int, float],
            tiers: Tiers | None) -> tuple[str | None, str | None, list[dict[str, str]]]:
    """(the checkpoint resumed from, what happened to the per-rank state, the copies skipped).
    A copy that fails while it loads (a checksum, a file gone) is skipped for the next whole
    one, newest first, saying so: the durable tier's copy of the same step after a fast copy
    with a flipped byte. Every rank agrees before moving on (the load's failure is agreed too)."""
    skipped: list[dict[str, str]] = []
    latest = ctx.cfg.checkpoint.resume == "latest"
    for path in _resume_candidates(ctx, tiers):
        try:
            return path, _restore(ctx, tr, path, losses, tiers), skipped
        except _TRY_NEXT as e:
            if not latest:
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            log.warning("checkpoint.resume=latest: %s failed while loading (%s); trying the next newest whole copy",
                        path, why[:500])
            skipped.append({"path": path, "error": why[:500]})
    if skipped:
        raise HpdcpError(f"checkpoint.resume=latest: every copy failed while loading; the newest, {skipped[0]['path']}: "
                         f"{skipped[0]['error']}")
    return None, None, skipped


def _restore(ctx: JobContext, tr: Trainer, path: str, losses: dict[int, float], tiers: Tiers | None = None) -> str:
    """Load ``path`` into the trainer; returns what happened to the per-rank state."""
    rank, ws = ctx.info.rank, ctx.info.world_size
    saved_ws = dcp.read_metadata(path).world_size
    same = saved_ws == ws
    if not same and ctx.cfg.checkpoint.rank_state == "error":
        raise HpdcpError(f"{path} was saved by {saved_ws} ranks and this run has {ws}: per-rank RNG states cannot be "
                         f"resharded (checkpoint.rank_state=error); resume with {saved_ws} ranks or set "
                         f"checkpoint.rank_state=reseed")
    target = _state(tr, rank, {}, with_rank_state=same)
    try:
        res = ctx.load(target, path, phase="train.resume", strict=same, key="checkpoint.resume",
                       reader=tiers.reader_for(path) if tiers is not None else None)
    except KeyMismatchError as e:
        raise KeyMismatchError(f"{path} does not fit this job's state (model, optimizer and training state of "
                               f"layout={ctx.cfg.layout.name}, model={ctx.cfg.model.name}): {e}", e.missing,
                               e.unexpected) from None
    if not same:
        stray = [k for k in res.unexpected_keys if not k.startswith("rank_state.")]
        if res.missing_keys or stray:
            raise KeyMismatchError(f"{path}: missing {list(res.missing_keys)[:10]}, unexpected {stray[:10]}",
                                   list(res.missing_keys), stray)
    dcp.set_optim_state_dict(tr.model, tr.opt, target["optim"])
    t = target["train"]
    tr.step, tr.data_position = int(t["step"]), int(t["data_position"])
    tr.rng.set_state(t["rng"])
    losses.update({int(s): float(v) for s, v in t["losses"]})
    if same:
        torch.set_rng_state(target["rank_state"][f"rank{rank}"]["torch_rng"])
        return "restored"
    torch.manual_seed(ctx.cfg.model.seed * 1_000_003 + tr.step * 4099 + rank)
    log.warning("per-rank RNG states of %s (saved by %d ranks) cannot be resharded to %d ranks: reseeded rank %d "
                "from (model.seed, step, rank)", path, saved_ws, ws, rank)
    return f"reseeded (saved by {saved_ws} ranks, resumed on {ws})"


def _files_read(ctx: JobContext, tr: Trainer, path: str) -> dict[str, Any] | None:
    """The files of ``path`` this rank's resume would read, with the byte ranges it reads (a
    node-local tier fetches only those): the same load, stopped where it checks its files, before
    any byte moves."""
    same = dcp.read_metadata(path).world_size == ctx.info.world_size
    target = _state(tr, ctx.info.rank, {}, with_rank_state=same)
    return node_tier.wanted_files(lambda: ctx.load(target, path, phase="train.restore_probe", strict=False,
                                                   key="checkpoint.resume",
                                                   reader=node_tier.NodeLocalReader(path, probe=True)))


def _compare(reference: str, losses: dict[int, float], rtol: float) -> dict[str, Any]:
    """Compare the losses this run computed with a reference run's, step by step."""
    try:
        with open(reference) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"job.compare_losses: cannot read {reference}: {e}") from None
    ref = {int(s): float(v) for s, v in (doc.get("losses") or doc.get("result", {}).get("losses") or {}).items()}
    common = sorted(set(ref) & set(losses))
    if not losses:
        raise ConfigError("job.compare_losses: this run computed no steps (it resumed at or past job.steps)")
    if not common:
        raise ConfigError(f"job.compare_losses: {reference} has none of the steps this run computed "
                          f"({min(losses)}..{max(losses)})")
    diffs = {s: abs(losses[s] - ref[s]) for s in common}
    worst = max(diffs.values())
    ok = all(d <= rtol * abs(ref[s]) for s, d in diffs.items())
    return {"compared_steps": f"{common[0]}..{common[-1]}", "bitwise": worst == 0.0, "loss_max_abs_diff": worst,
            "reproduced": ok, "loss_rtol": rtol}


def run(ctx: JobContext) -> dict:
    c, job = ctx.cfg, ctx.cfg.job
    rank, ws = ctx.info.rank, ctx.info.world_size
    model = build_model(c.model, ctx.placer())
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.01, foreach=False)
    tr = Trainer(model, opt, c.model, units=job.units, micro_batch=job.micro_batch, heads=c.model.heads,
                 seq_len=c.model.seq_len, dropout=c.model.dropout, rank=rank, world_size=ws, seed=c.model.seed)
    torch.manual_seed(c.model.seed * 1_000_003 + rank)
    ckdir = ctx.checkpoint_dir
    losses: dict[int, float] = {}
    tiers = Tiers(ctx) if c.checkpoint.fast_tier.dir else None
    if tiers is not None and tiers.node_local:
        tiers.probe = lambda path: _files_read(ctx, tr, path)
    try:
        with ctx.metrics.phase("train.restore"):  # finding, fetching (node-local tier) and loading
            resumed_from, rank_state, skipped = _resume(ctx, tr, losses, tiers)
        start = tr.step
        if job.async_save and job.save_every:
            dcp.start_async_persist(ctx.engine.async_mode, ctx.engine.persist_start_wait_s, ctx.engine.persist_nice)
        timeline: dict[str, list] = {"steps": [], "saves": [], "committed": []}
        _loop(ctx, tr, losses, ckdir, tiers, timeline)
        drains = tiers.finish() if tiers is not None else None
    except BaseException:
        if tiers is not None:
            tiers.close(timeout=ctx.engine.timeout_s)
        raise
    result: dict[str, Any] = {"start_step": start, "final_step": tr.step, "resumed_from": resumed_from,
                              "rank_state": rank_state, "resume_skipped": skipped, "save_mode": f"async ({ctx.engine.async_mode})" if job.async_save else "sync",
                              "final_loss": losses.get(tr.step),
                              "save_writers": dict(Counter(m for _, m in timeline.get("writers", []))),
                              "checkpoints": [e.name for e in list_checkpoints(ckdir, ctx.series[1])]}
    outsiders = series_outsiders(ckdir, ctx.series[1]) if rank == 0 else []
    if outsiders:  # named like the series but not in it: never resumed from, never deleted
        result["not_in_series"] = [f"{n}: {why}" for n, why in outsiders]
    if rank == 0:
        path = os.path.join(ctx.run_dir, "losses.json")
        with open(path, "w") as f:
            json.dump({"losses": {str(s): v for s, v in sorted(losses.items())}, "layout": c.layout.name,
                       "world_size": ws}, f, indent=1)
        result["losses_file"] = path
        # steps: [step, seconds, 1 if a save or drain ran beside it]; saves: [step, seconds the loop
        # was blocked, of which copying the state (async)]; committed: [step, seconds from the save's start to its commit (with tiers:
        # the fast tier's)]; durable: [name, seconds from the save's start to the bucket's commit]
        path = os.path.join(ctx.run_dir, "timeline.json")
        with open(path, "w") as f:
            json.dump({**timeline, "durable": [[n, d.get("durable_after_s")] for n, d in (drains or {}).items()]}, f)
        result["timeline_file"] = path
    if tiers is not None:
        result.update(tiers=tiers.listing(), drains=drains)
        if tiers.node_local:
            result.update(node_tier={"nodes": list(tiers.nodes.names), "replicas": tiers.replicas,
                                     "replication": tiers.replication, "restored": tiers.restored,
                                     "set_aside": tiers.set_aside})
        failed = [n for n, d in (drains or {}).items() if "error" in d]
        if failed:
            exists = "CheckpointExistsError" in drains[failed[0]]["error"]
            hint = " (to replace what is there, add checkpoint.overwrite=true, or pick another checkpoint.dir)" \
                if exists else ""
            raise HpdcpError(f"the drains of {', '.join(failed)} to {tiers.durable} (checkpoint.dir) failed: "
                             f"{drains[failed[0]]['error']}{hint}; they are only in the fast tier {tiers.fast}")
    if job.compare_losses:
        cmp = _compare(ctx.abspath(job.compare_losses), {s: v for s, v in losses.items() if s > start}, job.loss_rtol)
        result.update(cmp)
        if not cmp["reproduced"]:
            raise HpdcpError(f"the losses differ from {job.compare_losses} by up to {cmp['loss_max_abs_diff']:.3g} "
                             f"(tolerance: relative {job.loss_rtol})")
    return result


def _busy(tiers: Tiers | None) -> bool:
    """A checkpoint is being written or drained in the background now."""
    return save_in_flight() or (tiers is not None and (bool(tiers.drainer.busy()) or
                                                       (tiers.worker is not None and tiers.worker.busy())))


def _loop(ctx: JobContext, tr: Trainer, losses: dict[int, float], ckdir: str, tiers: Tiers | None,
          timeline: dict[str, list]) -> None:
    """The training steps and their saves; ``timeline`` gets each step's seconds and whether a
    save or drain ran beside it, and each save's blocking seconds (what a benchmark compares)."""
    job, rank, ws = ctx.cfg.job, ctx.info.rank, ctx.info.world_size
    pending: dcp.AsyncSaveResponse | None = None
    kill_rank = job.kill_rank if job.kill_rank is not None else ws - 1
    start = tr.step
    for _ in ctx.bars.progress(range(start, job.steps), "train", total=job.steps - start):
        busy = _busy(tiers)
        hook = tr.before_update
        t0 = time.perf_counter()
        with ctx.metrics.phase("train.step"):
            loss = tr.train_step()
        # a step's seconds leave out its wait for a background staging copy (that save's blocking)
        took = time.perf_counter() - t0 - getattr(hook, "seconds", 0.0)
        timeline["steps"].append([tr.step, round(took, 6), int(busy or _busy(tiers))])
        losses[tr.step] = loss
        log.info("step %d loss %.6f", tr.step, loss)
        if job.save_every and tr.step % job.save_every == 0:
            t0 = time.perf_counter()
            pending = _checkpoint(ctx, tr, losses, ckdir, pending, tiers, timeline)
            staged = pending.staging_seconds if pending is not None else None
            timeline["saves"].append([tr.step, round(time.perf_counter() - t0, 6), staged])
            if pending is not None:  # what wrote it (a process-mode save made while its process started: a thread)
                timeline.setdefault("writers", []).append([tr.step, pending.mode])
                tr.before_update = _staging_wait(ctx, tr, pending, timeline["saves"][-1])
        # the drill kills once: a restarted attempt (torchrun --max-restarts, a requeue) runs on
        if job.kill_after_step == tr.step and rank == kill_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                                   "0") == "0":
            log.warning("job.kill_after_step=%d: SIGKILL to rank %d", tr.step, rank)
            os.kill(os.getpid(), signal.SIGKILL)
    if pending is not None:  # after the last step: the job waits, training does not
        with ctx.metrics.phase("train.final_commit_wait"):
            pending.result()


def _staging_wait(ctx: JobContext, tr: Trainer, pending: dcp.AsyncSaveResponse, entry: list) -> Any:
    """The next step's wait, just before its optimizer step, for a save staged in the background
    (``dcp.async_staging=background``): part of that save's blocking, in its timeline entry and
    in ``train.save_blocking``. Nothing to wait for when staged before ``async_save`` returned."""
    if ctx.engine.async_staging != "background":
        return None

    def wait() -> None:
        tr.before_update = None
        t0 = time.perf_counter()
        with ctx.metrics.phase("train.save_blocking"), ctx.metrics.phase("train.staging_wait"):
            pending.wait_staged()
        wait.seconds = time.perf_counter() - t0
        entry[1] = round(entry[1] + wait.seconds, 6)

    wait.seconds = 0.0
    return wait


def _checkpoint(ctx: JobContext, tr: Trainer, losses: dict[int, float], ckdir: str,
                pending: dcp.AsyncSaveResponse | None, tiers: Tiers | None,
                timeline: dict[str, list]) -> dcp.AsyncSaveResponse | None:
    """Save ``step_<n>`` (to the fast tier when there is one); async saves first collect the
    previous one's outcome (raising its failure). Retention (and a tier's drain) runs only after
    a commit, never after a failed save."""
    if not ctx.cfg.job.async_save:
        return _save(ctx, tr, losses, ckdir, pending, tiers, timeline)
    # everything an async save costs the loop: the wait for the previous save to commit, then the
    # staging copy (train.save_blocking, the job's objective, holds both)
    with ctx.metrics.phase("train.save_blocking"):
        return _save(ctx, tr, losses, ckdir, pending, tiers, timeline)


def _save(ctx: JobContext, tr: Trainer, losses: dict[int, float], ckdir: str, pending: dcp.AsyncSaveResponse | None,
          tiers: Tiers | None, timeline: dict[str, list]) -> dcp.AsyncSaveResponse | None:
    started = time.perf_counter()
    if pending is not None:
        with ctx.metrics.phase("train.save_wait"):
            pending.result()
    series = ctx.series[1]
    name = checkpoint_series(series, tr.step)[0]
    path, writer = tiers.target(name) if tiers is not None else (join_location(ckdir, name), None)
    state = _state(tr, ctx.info.rank, losses)
    step, index = tr.step, tr.step // ctx.cfg.job.save_every

    def committed(md: Any = None) -> None:
        timeline["committed"].append([step, round(time.perf_counter() - started, 6)])
        if tiers is not None:
            tiers.committed(name, step, index, started, token=writer.staging_token if writer is not None else None)
        else:
            ctx.apply_retention(ckdir, series, name)

    key = "checkpoint.fast_tier.dir" if tiers is not None else "checkpoint.dir"
    if ctx.cfg.job.async_save:
        return ctx.async_save(state, path, phase="train.save_staging", series=(series, tr.step), callback=committed,
                              key=key, writer=writer)
    ctx.save(state, path, phase="train.save", series=(series, tr.step), key=key, writer=writer)
    committed()
    return None
