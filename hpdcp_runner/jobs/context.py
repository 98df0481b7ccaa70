"""What every job gets: the validated config, rank info, the run dir, metrics and engine calls
with the configured knobs."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from typing import Any, Callable, Iterator

import torch

from .. import dcp
from .. import runtime
from ..config import Config, checkpoint_series, load_preset, make_layout
from ..engine_options import EngineOptions, engine_options
from ..dcp.tools import (apply_retention, check_together, Comm, detect_format, get_logger, configure_object_store,
                         join_location, local_pieces,
                         METADATA_FILE, resolve_location, series_extra, series_outsiders)
from ..dcp import open_reader, open_writer, rename_keys
from ..layouts import Placer, problems as layout_problems, read_model_config, resolve_auto
from ..metrics import Metrics
from ..progress import Bars
from ..runtime import RankInfo


@dataclasses.dataclass(frozen=True)
class KeySelection:
    """``job.include`` / ``job.exclude`` (regexes, ``re.search``): ``only``, one predicate on a
    key (None when the job sets neither), and ``named``, how messages name the filter
    (``job.include='...'``)."""

    only: Callable[[str], bool] | None
    named: str

    @classmethod
    def of(cls, job: Any) -> "KeySelection":
        inc, exc = getattr(job, "include", None), getattr(job, "exclude", None)
        named = " ".join(f"job.{k}={getattr(job, k)!r}" for k in ("include", "exclude")
                         if getattr(job, k, None) is not None)
        if inc is None and exc is None:
            return cls(None, named)
        i = re.compile(inc).search if inc is not None else None
        x = re.compile(exc).search if exc is not None else None
        return cls(lambda k: (i is None or bool(i(k))) and not (x is not None and x(k)), named)


class JobContext:
    def __init__(self, cfg: Config, plain: dict, info: RankInfo, run_dir: str,
                 engine: EngineOptions | None = None) -> None:
        self.cfg, self.plain, self.info, self.run_dir = cfg, plain, info, run_dir
        #: every engine knob, parsed once by the config validation; jobs read them from here
        self.engine = engine or engine_options(cfg)
        self.metrics = Metrics()
        #: the keys the job keeps (``job.include`` / ``job.exclude``) and how messages name them
        self.keys = KeySelection.of(cfg.job)
        #: the progress bars and lines (rank 0, a terminal: ``runtime.progress``)
        self.bars = Bars(info.rank, info.world_size, cfg.runtime.progress)
        self.comm = Comm.create(None, self.engine.timeout_s)
        #: checkpoints named like the series that are not its members (name -> why), from retention
        self.outsiders: dict[str, str] = {}
        #: the model's config.json (raw) and where it came from, once a source is known
        self.model_config: dict | None = None
        self.model_config_from: str | None = None
        self.generation_config: dict | None = None
        #: what layout=auto recognised and picked (for the summary)
        self.layout_note: str | None = None
        #: layout=auto from a family's plan: what it split, replicated and could not place (hf_plan)
        self.layout_plan: dict | None = None
        #: what the job's result says about the layout it placed a source under (see place_facts)
        self.layout_result: dict = {}
        #: a foreign source's detected format, by path (see _megatron_names)
        self._formats: dict[str, str] = {}
        configure_object_store(self.engine.store)  # s3:// paths anywhere in this job use dcp.storage.*

    # -- paths ------------------------------------------------------------------------------
    def abspath(self, p: str) -> str:
        """A user-given path: relative paths are from the directory the command was run in, as
        with every CLI tool (Hydra's run directory is only for the run's own outputs). A URI
        (``s3://bucket/prefix``) stays a URI; an unsupported scheme is refused."""
        return resolve_location(p, runtime.launch_dir())

    @property
    def checkpoint_dir(self) -> str:
        """``checkpoint.dir``, or ``<run dir>/checkpoints`` when it is not set."""
        d = self.cfg.checkpoint.dir
        return self.abspath(d) if d else os.path.join(self.run_dir, "checkpoints")

    @property
    def series(self) -> tuple[str, str, int | None]:
        """(name this job writes, its series pattern, its step) from ``checkpoint.name``/``step``."""
        return checkpoint_series(self.cfg.checkpoint.name, self.cfg.checkpoint.step)

    def checkpoint_path(self, name: str | None = None) -> str:
        """``checkpoint.path`` if given (and no ``name``), else ``checkpoint.dir/<name>`` (default:
        the name ``checkpoint.name`` resolves to)."""
        if self.cfg.checkpoint.path and name is None:
            return self.abspath(self.cfg.checkpoint.path)
        return join_location(self.checkpoint_dir, name or self.series[0])

    def placer(self, layout: Any = None, keys: Any = None) -> Placer:
        return Placer(layout or self.cfg.layout, self.info.rank, self.info.world_size, self.info.device,
                      model_config=self.model_config, keys=keys)

    def find_model_config(self, source: str | None, md: dcp.Metadata | None = None, *,
                          every_rank: bool = True) -> None:
        """The model's ``config.json`` for layout rules sized by it: ``layout.config``, else the
        source directory's own, else the one our checkpoint recorded, else ``job.hf_files_from``.
        With ``every_rank`` (all ranks call it) rank 0 reads it and the others are given it: one
        request to a store, not one per rank."""
        if every_rank and self.info.world_size > 1:
            got = self.comm.agree_root("read the model's config.json", lambda: list(self._model_configs(source, md)))
        else:
            got = self._model_configs(source, md)
        self.model_config, self.model_config_from, self.generation_config = got

    def _model_configs(self, source: str | None, md: dcp.Metadata | None) -> tuple[dict | None, str | None,
                                                                                    dict | None]:
        """``_model_config`` and the ``generation_config.json`` beside it (or recorded with it):
        both travel in the checkpoints this job writes, so an HF export has both."""
        raw, where = self._model_config(source, md)
        gen = None
        if where is not None and where.endswith("/config.json"):
            gen = read_model_config(where[:-len("config.json")] + "generation_config.json")[0]
        elif raw is not None and md is not None and isinstance(md.extra.get("generation_config"), dict):
            gen = dict(md.extra["generation_config"])
        return raw, where, gen

    def _model_config(self, source: str | None, md: dcp.Metadata | None) -> tuple[dict | None, str | None]:
        lay = self.cfg.layout
        if lay.config:
            path = self.abspath(lay.config)  # a local path or an s3:// one
            raw, where = read_model_config(path)
            if raw is None:
                raise dcp.ConfigError(f"layout.config: no config.json at {path}")
        else:
            raw, where = read_model_config(source)
            if raw is None and md is not None and isinstance(md.extra.get("model_config"), dict):
                raw, where = dict(md.extra["model_config"]), f"{source} (recorded at save)"
            files_from = getattr(self.cfg.job, "hf_files_from", None)
            if raw is None and files_from:
                raw, where = read_model_config(self.abspath(files_from))
        return raw, where

    def use_source_layout(self, md: dcp.Metadata, source: str | None, ranks: int | None = None,
                          every_rank: bool = True) -> None:
        """Before placing a source's tensors: find its config.json and make ``layout=auto``
        concrete (the family's preset), checked at ``ranks`` (default this world size).
        ``every_rank``: false where only rank 0 runs it (inspect)."""
        self.find_model_config(source, md, every_rank=every_rank)
        if self.cfg.layout.kind != "auto":
            return
        self.cfg.layout, self.layout_note, self.layout_plan = resolve_auto(
            self.cfg.layout, self.model_config, md.tensors, load_preset, make_layout, ranks or self.info.world_size)
        bad = layout_problems(self.cfg.layout, ranks or self.info.world_size)
        if bad:
            raise dcp.ConfigError(f"{self.layout_note}: " + "; ".join(bad))

    # -- engine calls with the configured knobs ----------------------------------------------
    def save(self, state: Any, path: str, phase: str = "save", overwrite: bool | None = None,
             series: tuple[str, int | None] | None = None, key: str = "checkpoint.dir",
             writer: dcp.StorageWriter | None = None) -> dcp.Metadata:
        """``dcp.save`` with the configured knobs; ``series`` = (pattern, step) records the
        checkpoint as a member of that series (for retention and resume=latest). The model's
        config.json, when one is known, is recorded too, so later layouts sized by it find it.
        ``writer``: where the bytes go when ``path`` only names the checkpoint (a node-local tier)."""
        e = self.engine
        writer = writer or open_writer(path, fsync=e.fsync, store_options=e.store)
        c = writer.counters
        with self.metrics.phase(phase), self.user_errors(key), \
                self.bars.byte_progress(phase, lambda: (c.bytes_written, c.files_written), c):
            md = dcp.save(state, storage_writer=writer, checkpoint_id=path,
                          planner=dcp.SAVE_PLANNERS[e.planner](),
                          overwrite=self.cfg.checkpoint.overwrite if overwrite is None else overwrite,
                          allow_pickle=e.allow_pickle, verify_replicas=e.verify_replicas, timeout=e.timeout_s,
                          cache_plan=e.cache_plan, format_version=e.format_version, extra=self._extra(series))
        self.metrics.add(writer.counters.as_dict(), f"{phase}.")
        return md

    def async_save(self, state: Any, path: str, phase: str = "async_save", callback: Any = None,
                   overwrite: bool | None = None,
                   series: tuple[str, int | None] | None = None,
                   key: str = "checkpoint.dir", writer: dcp.StorageWriter | None = None) -> dcp.AsyncSaveResponse:
        """``dcp.async_save`` with the configured knobs; ``phase`` times only the blocking part.
        ``callback(metadata)`` runs in the background after the commit (never after a failure)."""
        e = self.engine
        writer = writer or open_writer(path, fsync=e.fsync, store_options=e.store)

        def done(md: dcp.Metadata) -> None:
            self.metrics.add(writer.counters.as_dict(), f"{phase}.")
            if callback is not None:
                callback(md)

        with self.metrics.phase(phase), self.user_errors(key):
            return dcp.async_save(state, storage_writer=writer, checkpoint_id=path,
                                  planner=dcp.SAVE_PLANNERS[e.planner](),
                                  overwrite=self.cfg.checkpoint.overwrite if overwrite is None else overwrite,
                                  allow_pickle=e.allow_pickle, verify_replicas=e.verify_replicas, timeout=e.timeout_s,
                                  cache_plan=e.cache_plan, format_version=e.format_version, callback=done,
                                  extra=self._extra(series), mode=e.async_mode, staging=e.async_staging)

    def _extra(self, series: tuple[str, int | None] | None) -> dict | None:
        extra = dict(series_extra(*series)) if series else {}
        if self.model_config is not None:
            extra["model_config"] = self.model_config
        if self.generation_config is not None:
            extra["generation_config"] = self.generation_config
        return extra or None

    def reader(self, path: str, foreign: bool = False) -> dcp.StorageReader:
        """A reader of ``path`` with the storage knobs; ``foreign``: in ``job.source.format``
        (auto: ours, Hugging Face or torch DCP by the files present), else our format."""
        source = getattr(self.cfg.job, "source", None)
        fmt = source.format if foreign and source is not None else "hpdcp"
        weights = source.weights if foreign and source is not None else "fp32"
        hf_config, config_source = self._megatron_names(path, fmt) if foreign else (None, "")
        return open_reader(path, fmt, allow_pickle=self.engine.allow_pickle, store_options=self.engine.store,
                           weights=weights, hf_config=hf_config, config_source=config_source,
                           **self.engine.reader.kwargs())

    def format_of(self, path: str, fmt: str) -> str:
        """``fmt``, or for ``auto`` the format the files at ``path`` show (detected once per path:
        a job opens its source several times)."""
        if fmt != "auto":
            return fmt
        if path not in self._formats:
            self._formats[path] = detect_format(path)
        return self._formats[path]

    def megatron_under_its_own_names(self, path: str) -> bool:
        """The source at ``path`` is a Megatron-Core checkpoint and no config.json names its
        weights (``layout.config``, ``job.hf_files_from``): it reads under Megatron's own names."""
        source = getattr(self.cfg.job, "source", None)
        fmt = source.format if source is not None else "auto"
        return fmt in ("auto", "megatron") and \
            not (self.cfg.layout.config or getattr(self.cfg.job, "hf_files_from", None)) and \
            self.format_of(path, fmt) == "megatron"

    def _megatron_names(self, path: str, fmt: str) -> tuple[dict | None, str]:
        """A Megatron-Core checkpoint reads under Hugging Face names when the model's config.json
        is known (``layout.config``, else ``job.hf_files_from``): (that config, where), else
        (None, '') and Megatron's own names."""
        where = self.cfg.layout.config or getattr(self.cfg.job, "hf_files_from", None)
        if not where or self.format_of(path, fmt) != "megatron":
            return None, ""
        raw, found = read_model_config(self.abspath(where))
        if raw is None:
            key = "layout.config" if self.cfg.layout.config else "job.hf_files_from"
            raise dcp.ConfigError(f"{key}: no config.json at {self.abspath(where)} (needed to name the Megatron "
                                  f"checkpoint's weights)")
        return raw, found or where

    def source_renames(self) -> list:
        source = getattr(self.cfg.job, "source", None)
        return [(r["pattern"], r["replace"]) for r in source.rename or []] if source is not None else []

    def source_metadata(self, path: str, key: str = "job.source.path") -> dcp.Metadata:
        """A user's checkpoint described as it will load (format and renames applied): rank 0
        reads it, every rank parses it; an error is raised on every rank."""
        reader = self.reader(path, foreign=True)
        try:
            with self.user_errors(key):
                got, pin = self.comm.agree_root("read source metadata",
                                                lambda: [reader.read_metadata_text(), reader.pin()])
                reader.attach_pin(pin)  # every rank parses (and opens the index of) what rank 0 read
                source = f"{path} (as {reader.format_name})" if reader.format_name != "hpdcp" else \
                    join_location(path, METADATA_FILE)
                md = dcp.Metadata.from_json(got, source=source, open_file=reader.open_file)
                # targets are built from this: the files must hold what it claims (rank 0 checks)
                self.comm.agree_root("check source files", lambda: reader.check_claims(md))
                return rename_keys(md, self.source_renames(), source=f"{path} (job.source.rename)")
        finally:
            reader.close()

    def target_from_metadata(self, md: dcp.Metadata, path: str, only: Callable[[str], bool] | None = None,
                             key: str = "job.source.path", copies: int = 1) -> dict:
        """The load target for a user's checkpoint (every tensor ``only`` admits, placed by
        ``layout=``), after every rank checked that its shards (``copies`` of them: the caller
        builds more) fit in the memory it has."""
        from ..targets import local_bytes, state_from_metadata

        self.use_source_layout(md, path)
        placer = self.placer(keys=md.tensors)
        keys = None if only is None else {k for k in md.tensors if only(k)}
        need = local_bytes(md, placer, keys) * copies
        with self.user_errors(key):
            check_together(self.comm, need, placer.device, f"its shards of {path} under layout "
                           f"{self.cfg.layout.name!r} ({len(md.tensors) if keys is None else len(keys)} tensors)",
                           "run on more hosts, pick a layout that shards more (layout=...), or load part of it "
                           "(job.include=<regex>)")
            state = state_from_metadata(md, placer, strict=self.cfg.layout.strict, only=only)
        self.layout_result = self.place_facts(md, placer, keys)
        return state

    def place_facts(self, md: dcp.Metadata, placer: Placer, keys: Any = None) -> dict:
        """For the summary and metrics.json: the layout as used (recognised by auto, overridden on
        the command line, sized by which config.json) and what no rule named, replicated on
        every rank (count, bytes, the first names), so nothing is replicated by surprise."""
        from ..dcp.tools import dtype_from_name

        out: dict = {}
        if self.layout_note:
            out["layout_recognised"] = self.layout_note
        if self.layout_plan:  # layout=auto from the family's plan: what it split and kept whole
            plan = self.layout_plan
            out["layout_plan"] = {"family": plan["family"], "parallel": plan["parallel"],
                                  "transformers": plan["transformers"], "weights_split": len(plan["split"]),
                                  "elements_split": plan["elements_split"], "elements": plan["elements"],
                                  "kv_replicated": plan["replicated_kv"][:8], "no_plan_entry": len(plan["no_entry"])}
        if self.cfg.layout.file:
            out["layout_file"] = self.cfg.layout.file
        overridden = layout_overrides()
        if overridden:
            out["layout_overridden"] = overridden
        if self.model_config_from:
            out["model_config"] = self.model_config_from
        if self.cfg.layout.kind == "dtensor":
            names = placer.unmatched(sorted(k for k, t in md.tensors.items() if t.shape and (keys is None or k in keys)))
            if names:
                nbytes = sum(math.prod(md.tensors[k].shape) * dtype_from_name(md.tensors[k].dtype).itemsize
                             for k in names)
                out["unmatched"] = {"tensors": len(names), "bytes": nbytes, "first": names[:5],
                                    "placed": "replicated on every rank (layout.strict=true refuses them)"}
                if self.info.rank == 0:
                    get_logger(__name__).warning(
                        "layout %s: %d tensor(s), %d bytes, match no rule and are replicated on every rank, e.g. %s",
                        self.cfg.layout.name, len(names), nbytes, ", ".join(names[:3]))
            partial = placer.partly_split({k: t.shape for k, t in md.tensors.items() if keys is None or k in keys})
            if partial:
                from ..targets import partly_split_text

                block, (split, left) = next(iter(partial.items()))
                out["partly_split"] = {"blocks": len(partial), "first": block, "split": split, "left": left}
                if self.info.rank == 0:
                    guessed = " (its family was recognised from key names only)" if self.layout_note and \
                        "(from key " in self.layout_note else ""
                    get_logger(__name__).warning("layout %s%s %s (accepted: layout.strict=false)",
                                                 self.cfg.layout.name, guessed, partly_split_text(partial))
        return out

    def load(self, state: Any, path: str, phase: str = "load", strict: bool = True,
             key: str = "checkpoint.path", foreign: bool = False,
             reader: dcp.StorageReader | None = None) -> dcp.LoadResult:
        """``dcp.load`` with the configured knobs; ``foreign``: ``path`` is a user's checkpoint read
        in ``job.source.format`` with ``job.source.rename``; ``reader``: one of the caller's own."""
        e = self.engine
        reader = reader or self.reader(path, foreign)
        c = reader.counters
        with self.metrics.phase(phase), self.user_errors(key), \
                self.bars.byte_progress(phase, lambda: (reader.bytes_moved() + c.extra.get("bytes_received", 0),
                                                   c.files_opened), c):
            res = dcp.load(state, storage_reader=reader, checkpoint_id=path, planner=dcp.LOAD_PLANNERS[e.planner](),
                           strict=strict, allow_pickle=e.allow_pickle, allow_cast=e.allow_cast, timeout=e.timeout_s,
                           broadcast=e.broadcast, rename=self.source_renames() if foreign else ())
        self.metrics.add(dict(res.counters), f"{phase}.")
        return res

    def apply_retention(self, directory: str, series: str, just_committed: str) -> list[str]:
        """Keep the newest ``checkpoint.keep_last`` checkpoints of ``series`` in ``directory``
        (rank 0); ``just_committed`` is never deleted."""
        if self.cfg.checkpoint.keep_last <= 0 or self.info.rank != 0:
            return []
        removed = apply_retention(directory, self.cfg.checkpoint.keep_last, series=series, keep=[just_committed])
        self.outsiders = {n: why for n, why in series_outsiders(directory, series)}
        return removed

    @contextlib.contextmanager
    def user_errors(self, key: str) -> Iterator[None]:
        """Engine errors a user fixes from the command line say which config ``key`` to change."""
        try:
            yield
        except dcp.CheckpointExistsError as e:
            line = _first_line(e)
            what = line.split(";")[0].rstrip(". ")  # without the engine's keyword hint
            # what an overwrite does to the old one depends on the output (a committed checkpoint,
            # a directory renamed into place, a bucket's plain files): the engine says which
            how = re.search(r"\(([^()]*)\)\s*$", line)
            named, other = ("", "checkpoint.name / checkpoint.dir") if key == "checkpoint.dir" else (f" ({key})", key)
            note = f" ({how.group(1)})" if how else ""
            raise dcp.CheckpointExistsError(
                f"{what}{named}. To replace it, add checkpoint.overwrite=true{note}, or pick another {other}.") from None
        except (dcp.CheckpointNotFoundError, dcp.StorageAccessError) as e:
            raise type(e)(f"{_first_line(e)} (check {key})") from None
        except dcp.PickleNotAllowedError as e:
            raise dcp.PickleNotAllowedError(_first_line(e)) from None


def section_overrides(section: str, ignored: tuple[str, ...] = ()) -> list[str]:
    """The ``<section>.*`` overrides given on the command line but ``ignored`` keys, for the
    summary: the preset used is then not the one its name says."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task
    except Exception:  # not under Hydra (jobs called directly)
        return []
    return [o for o in task if o.lstrip("+~").startswith(section + ".") and
            o.lstrip("+~").split("=", 1)[0] not in ignored]


def layout_overrides() -> list[str]:
    """The ``layout.*`` overrides that change the layout (rules, mesh...), for the summary."""
    return section_overrides("layout", ("layout.strict", "layout.config", "layout.parallel", "layout.family",
                                        "layout.file"))


def _first_line(e: BaseException) -> str:
    """The cause of an agreed error, without the per-rank wrapping or the Python keyword hint."""
    failures = getattr(e, "failures", None)
    text = next(iter(failures.values())) if failures else str(e)
    return text.split("; pass overwrite=True")[0].rstrip(".")


def compare_state(got: Any, expect: Any, prefix: str = "", skip: frozenset[str] = frozenset()) -> list[str]:
    """Problems comparing a loaded state with its placed reference, shard by shard, bitwise.
    ``skip``: keys the load did not fill (``job.strict=false`` left them as they were)."""
    from ..dcp.tools import TENSOR_LEAVES

    if isinstance(expect, dict):
        if not isinstance(got, dict) or set(got) != set(expect):
            return [f"{prefix or '<root>'}: structure differs"]
        return [p for k in expect for p in compare_state(got[k], expect[k], f"{prefix}{k}.", skip)]
    if isinstance(expect, list):
        if not isinstance(got, list) or len(got) != len(expect):
            return [f"{prefix[:-1]}: list differs"]
        return [p for i, (g, e) in enumerate(zip(got, expect)) for p in compare_state(g, e, f"{prefix}{i}.", skip)]
    key = prefix[:-1]
    if key in skip:
        return []
    if isinstance(expect, TENSOR_LEAVES):
        gp, ep = local_pieces(got), local_pieces(expect)
        if [b for b, _ in gp] != [b for b, _ in ep]:
            return [f"{key}: local boxes differ"]
        if any(g.dtype != e.dtype or not torch.equal(g.cpu(), e.cpu()) for (_, g), (_, e) in zip(gp, ep)):
            return [f"{key}: values differ from the reference"]
        return []
    return [] if got == expect and type(got) is type(expect) else [f"{key}: {got!r} != {expect!r}"]
