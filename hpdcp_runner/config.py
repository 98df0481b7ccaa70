"""The runner's structured config: dataclass schemas in Hydra's ConfigStore, size parsing and
cross-field validation that reports every problem at once."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .dcp import ConfigError
from .paths import find_conf_dir

if TYPE_CHECKING:
    from .engine_options import EngineOptions

JOB_HELP = {
    "save": "build the model= state under layout= and save it (checkpoint.dir/checkpoint.name; keep_last)",
    "load": "load checkpoint.path into the model= state under layout= and check every shard bit for bit "
            "(job.source.path=: any checkpoint as it is)",
    "reshard": "load a checkpoint (job.source.path: ours, Hugging Face or torch DCP) under layout= at this "
               "world size, save it (job.output_format=hpdcp|hf), verify it",
    "inspect": "list a checkpoint's tensors, dtypes, shapes, chunks and files (job.format=table|json); "
               "with layout= (job.ranks=N) the rule and shard of each tensor",
    "verify": "recompute every checksum of checkpoint.path (or job.source.path); non-zero exit naming every problem",
    "bench": "time save and load (job.repeats after job.warmup); job.peer=true runs torch DCP beside it",
    "train": "train a small GPT-like model, checkpoint every job.save_every steps, resume=latest",
    "transform": "offline conversions, one process: transform=merge_hf|import|from_torch_dcp|to_torch_dcp",
}
JOBS = tuple(JOB_HELP)
TRANSFORMS = ("merge_hf", "import", "to_torch_dcp")
SOURCE_FORMATS = ("auto", "hf", "safetensors", "pt", "torch_dcp", "hyper_parallel")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_TRAILING_DIGITS = re.compile(r"(\d+)\Z")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def checkpoint_series(name: str, step: int) -> tuple[str, str, int | None]:
    """``checkpoint.name`` -> (the name to write, its series pattern, its step).

    ``step_{step}`` is a pattern; a literal name ending in digits (``step_5``) belongs to the
    series with the digits as ``{step}`` (our own configured name, never a name found on disk);
    any other name (``best``) is a series of one.
    """
    if "{step}" in name:
        return name.replace("{step}", str(step)), name, step
    m = _TRAILING_DIGITS.search(name)
    if m:
        return name, name[:m.start()] + "{step}" + name[m.end():], int(m.group(1))
    return name, name, None


def parse_size(value: Any, key: str = "size") -> int:
    """``64MiB`` / ``6MB`` / ``1GiB`` / ``4096`` -> bytes. Booleans and negatives are errors."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size such as 64MiB or an integer, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: a size cannot be negative, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{key}: {value!r} is not a size (use e.g. 64MiB, 6MB, 1GiB or a byte count)")
    number, unit = float(m.group(1)), (m.group(2) or "B").lower()
    n = number * _UNITS[unit]
    if n != int(n):
        raise ConfigError(f"{key}: {value!r} is not a whole number of bytes")
    return int(n)


Size = Union[int, str]


@dataclass
class PlannerConf:
    name: str = "standard"  # standard | minimum_rank


@dataclass
class StorageConf:
    """``dcp.storage``: how checkpoints are read and written on every store (conf/storage/default.yaml)."""

    name: str = "default"
    files_kept: int = 8
    fsync: bool = True
    verify_checksums: bool = True
    max_metadata_bytes: Size = "256MiB"
    shared: bool = False  # declare network/shared storage: replica broadcast pays off on one node too
    max_read_bytes_per_s: Optional[Size] = None  # per-process read cap (token bucket), to simulate slow storage
    # partial-chunk reads: a gap between two kept runs up to this long is read through (one request)
    # rather than split; auto = the measured per-request cost x read bandwidth (docs/benchmarks.md)
    read_gap_bytes: Size = "auto"
    max_request_bytes: Size = "16MiB"  # the most one read request (and a scratch window) carries
    # object stores (s3://, gs://, az://); credentials come from each cloud's environment
    # (AWS_*, GOOGLE_*, AZURE_STORAGE_*), never from the config
    endpoint: Optional[str] = None  # overrides AWS_ENDPOINT_URL / GOOGLE_BASE_URL / AZURE_STORAGE_ENDPOINT
    region: Optional[str] = None  # S3 only: overrides AWS_REGION
    allow_http: Optional[bool] = None  # overrides <AWS|GOOGLE|AZURE>_ALLOW_HTTP (an http:// endpoint)
    part_size: Size = "16MiB"  # multipart upload part; a rank buffers about part_size x concurrency
    concurrency: int = 8  # parts uploaded / ranged GETs in flight per rank
    max_retries: int = 5  # per request, with exponential backoff (5xx, throttling, dropped connections)
    # a request with no answer for this long fails (a dead or hung endpoint: the job ends naming
    # it instead of waiting); retries of one request stop once this much time has passed
    request_timeout_s: float = 15.0
    retry_timeout_s: float = 25.0
    # a store that ignores conditional writes is refused (two saves of one name could both succeed
    # and one be lost); true runs there anyway, with a warning: never two saves of one name at once
    unconditional_ok: bool = False
    # two ranges of an object closer than this are one GET; auto = the measured request latency x
    # one connection's bandwidth (a gap is read through when that is cheaper than a request)
    coalesce_bytes: Size = "auto"
    read_buffer_bytes: Size = "256MiB"  # the most a rank fetches ahead before copying out
    orphan_grace_s: float = 900.0  # abandoned/superseded saves untouched this long are deleted by later saves
    # foreign checkpoints (Hugging Face, torch DCP, ...) record few or no checksums: each object read
    # whole is checked against the MD5 the store keeps (S3/GCS ETags). auto: a mismatch fails the
    # load unless this store's ETags are not MD5s (encrypted objects); strict: always fails; off
    store_digests: str = "auto"


@dataclass
class BroadcastConf:
    mode: str = "auto"  # always | never | auto (across nodes, or shared/slow storage)
    batch_bytes: Size = "8MiB"  # shards below this are packed; 0 disables packing
    max_in_flight: int = 4
    share_reads: bool = True  # a chunk several ranks need parts of is read once, its parts sent (under mode)


@dataclass
class DcpConf:
    planner: PlannerConf = field(default_factory=PlannerConf)
    storage: StorageConf = field(default_factory=StorageConf)
    broadcast: BroadcastConf = field(default_factory=BroadcastConf)
    timeout_s: float = 300.0
    allow_pickle: bool = False
    allow_cast: bool = False
    verify_replicas: bool = False
    # repeated saves of one structure on one group reuse their plan (digest-checked: any change
    # in keys, shapes, dtypes or placements is planned in full)
    cache_plan: bool = True
    # 2: the chunk table in chunk_index.safetensors, read in part by each loading rank; 1: all of
    # it in metadata.json, for readers older than format version 2
    format_version: int = 2
    # async saves: thread = files written by a thread of the training process; process = by a
    # persisting process per rank (shared-memory staging), off the training process's GIL
    async_mode: str = "thread"
    # process mode: how long a job waits, before its first step, for the persisting process to
    # finish starting. 0: never (a save made while it starts is written by a thread instead, so
    # its start-up never lands on the training loop); more: every save goes through the process
    persist_start_wait_s: float = 0.0
    # process mode: the persisting process runs this much nicer than training (0-19), so its
    # writes and checksums yield the cores to the steps; 0: the same priority
    persist_nice: int = 10
    # async saves: background = the host copy runs while the next step's forward and backward
    # run (the train job waits for it just before its optimizer step, the first point where the
    # state changes); now = the copy is made before async_save returns
    async_staging: str = "background"


@dataclass
class RuleConf:
    pattern: str = ".*"  # re.fullmatch on the tensor's dotted key
    placements: list[str] = field(default_factory=lambda: ["R"])  # per mesh dim: R | S<dim> | E (experts)
    # a fused tensor: the sizes of its parts along parts_dim (ints or config.json expressions such
    # as num_key_value_heads*head_dim); each part is placed as its own tensor, pieces concatenated
    parts: Optional[list[Any]] = None
    parts_dim: int = 0
    unit: Optional[Any] = None  # parts split only on multiples of this (head_dim: whole heads per rank)
    # a part of fewer units than the ranks splitting it (1 key/value head, 4 ranks), ranks a multiple
    # of them: each unit held whole by ranks/units consecutive ranks, as tensor-parallel runtimes
    # replicate key/value heads (else such a part is an error)
    replicate_few: bool = False
    experts: Optional[Any] = None  # E on one key per expert: how many experts (default: counted from the keys)
    why: Optional[str] = None  # what made this rule (layout=auto: the family's plan entry), shown by inspect


@dataclass
class LayoutConf:
    name: str = "replicated"
    kind: str = "plain"  # plain (replicated tensors) | dtensor | flat (ragged flat shards)
    mesh: list[int] = field(default_factory=lambda: [-1])  # -1: the rest of the world size
    rules: list[RuleConf] = field(default_factory=list)  # first match wins; no match -> replicate
    flat_units: list[int] = field(default_factory=list)  # kind=flat: relative share per rank (empty: even)
    # null: a block split only in part, or a weight the family's plan splits that auto cannot place,
    # is an error; true: also every tensor that no rule names (listing all of them); false: none is
    strict: Optional[bool] = None
    # the model's config.json (file or directory), for rule sizes named by config fields; null:
    # the source's own (a Hugging Face directory, or the one our checkpoints record)
    config: Optional[str] = None
    # layout=auto: the family's rule table picked from config.json's model_type (or the keys)
    # auto: null = recognise it; or llama | phi3 | gpt2 | moe | titan | bloom | falcon_gqa | falcon_mq |
    # mpt | bigcode | bigcode_mq | opt
    family: Optional[str] = None
    parallel: Optional[str] = None  # auto: tp | fsdp_tp | ep | ep_tp (null: tp, or ep for moe)
    # a layout YAML of your own (name, kind, mesh, rules): read over this one at start-up
    file: Optional[str] = None


@dataclass
class ModelConf:
    name: str = "tiny"
    kind: str = "transformer"  # transformer | peer | mlp_adamw
    vocab: int = 64
    hidden: int = 16
    layers: int = 2
    ffn: int = 40
    dtype: str = "float32"
    big_rows: int = 4096  # peer workload: rows of the 15 big tensors
    seed: int = 0
    heads: int = 4  # train: attention heads (hidden must divide)
    seq_len: int = 16  # train: tokens per sequence
    dropout: float = 0.0  # train: dropout probability (seeded from the global training RNG)


@dataclass
class FastTierConf:
    """``checkpoint.fast_tier``: saves commit to a fast directory first (a local NVMe or RAM disk
    that every rank of the job sees) and return; every ``drain_every``-th is then copied, verified,
    to ``checkpoint.dir`` (the durable tier: a bucket or a shared file system) in the background."""

    dir: Optional[str] = None  # null: no fast tier (saves go to checkpoint.dir directly)
    keep_last: int = 2  # checkpoints kept in the fast tier (0 keeps all); checkpoint.keep_last is the durable tier's
    drain_every: int = 1  # every k-th save is also copied to checkpoint.dir
    # the directory is each node's own disk (the same path on every node, seen by that node
    # only): each node holds its ranks' files, replicated to `replicas` other nodes
    node_local: bool = False
    replicas: int = 1  # node_local: how many other nodes hold a copy of each node's part (< nodes)


@dataclass
class CheckpointConf:
    dir: Optional[str] = None  # null: <run dir>/checkpoints; relative paths: from the launch directory
    # a name, or a series pattern with {step} (step_{step}); a trailing number names the step (step_5)
    name: str = "step_{step}"
    step: int = 0  # save: the step of {step}, recorded in the checkpoint's metadata
    path: Optional[str] = None  # explicit checkpoint to read (load/inspect/verify); default dir/name
    keep_last: int = 0  # 0 keeps every checkpoint of the series (checkpoint.name's pattern)
    overwrite: bool = False
    resume: Optional[str] = None  # train: null | latest | <checkpoint path>
    rank_state: str = "reseed"  # train: per-rank RNG when the world size changed: reseed | error
    fast_tier: FastTierConf = field(default_factory=FastTierConf)  # train: a fast tier drained to checkpoint.dir


@dataclass
class RuntimeConf:
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "cpu"  # cpu | cuda
    timeout_s: float = 300.0
    progress: bool = True
    nproc_per_node: Optional[int] = None  # hydra/launcher=hpdcp_torchrun: workers per point (sweepable)


@dataclass
class SourceConf:
    # a checkpoint to read as it is (reshard, load, bench, inspect, verify): the state is built
    # from its own metadata and placed by layout=; model= plays no part
    path: Optional[str] = None
    layout: str = "tp"  # reshard without source.path: the layout the demo source is written in
    # auto | hpdcp | hf | torch_dcp (needs dcp.allow_pickle=true) | deepspeed | megatron (torch_dist needs
    # dcp.allow_pickle=true; the legacy mp_rank_* archives do not)
    format: str = "auto"
    # a DeepSpeed checkpoint's weights: fp32 (its fp32 master copy, as zero_to_fp32 gives) | module
    # (the module's own, in the dtype it trained in; ZeRO 1/2 only)
    weights: str = "fp32"
    # [{pattern: <regex>, replace: <text>}, ...]: applied in order to the checkpoint's keys at load
    # (None, not an empty list: OmegaConf cannot merge a list default under the Optional job node)
    rename: Optional[list[Any]] = None


@dataclass
class JobConf:
    """What every job has. Each job has its own schema below (``conf/job/<name>.yaml`` names it),
    so a key of another job (``job.steps`` on a reshard) is an error naming it, not ignored."""

    name: str = MISSING
    fail_on_rank: Optional[int] = None  # fault injection for tests and drills: this rank raises


@dataclass
class SaveJob(JobConf):
    pass


@dataclass
class ReadingJob(JobConf):
    """A job that reads an existing checkpoint (``job.source``: a user's, any format)."""

    source: SourceConf = field(default_factory=SourceConf)


@dataclass
class LoadJob(ReadingJob):
    verify: bool = True
    strict: bool = True  # false loads the keys the state and the checkpoint share and reports the rest
    include: Optional[str] = None  # only state keys matching this regex (re.search), e.g. '^model\.'
    exclude: Optional[str] = None  # and none matching this one, e.g. '^optim\.'


@dataclass
class ReshardJob(ReadingJob):
    verify: bool = True
    output: Optional[str] = None  # where the resharded checkpoint goes
    output_format: str = "hpdcp"  # hpdcp | hf (Hugging Face shards + index, from_pretrained-ready)
    include: Optional[str] = None  # only tensors whose key matches this regex (re.search)
    exclude: Optional[str] = None  # and none matching this one, e.g. '^optim\.'
    # output_format=hf: a model+optimizer checkpoint gives only the model's weights, under the
    # model's own names (optimizer state found by its structure; what is left out is reported);
    # false writes every tensor
    model_only: bool = True
    dtype: Optional[str] = None  # output_format=hf: cast floating tensors (e.g. bfloat16)
    # output_format=hf: cap per model-*.safetensors file (a size: bytes or 64MiB-style)
    hf_max_shard_size: str = "5GB"
    # output_format=hf: directory whose config.json / tokenizer files travel with the output
    # (default: the source, when it is a Hugging Face directory)
    hf_files_from: Optional[str] = None
    # stack: one key per expert (...experts.<e>.w1.weight) read into stacked [experts, ...]
    # tensors (...experts.w1.weight); unstack: the reverse (back to the family's own names)
    experts: Optional[str] = None


@dataclass
class InspectJob(ReadingJob):
    format: str = "table"  # table | json
    ranks: Optional[int] = None  # show the layout= shards for this many ranks
    picture: Optional[str] = None  # also draw the layout to this PNG (each rank's boxes by colour)


@dataclass
class VerifyJob(ReadingJob):
    pass


@dataclass
class BenchJob(ReadingJob):
    include: Optional[str] = None  # job.source.path: time only the tensors matching this regex
    exclude: Optional[str] = None  # and none matching this one
    warmup: int = 1
    repeats: int = 3
    peer: bool = False  # run torch.distributed.checkpoint side by side
    verify: bool = True


@dataclass
class TrainJob(JobConf):
    steps: int = 20  # train up to this global step
    save_every: int = 5  # checkpoint every K steps (0: never)
    async_save: bool = True  # async_save (stage, persist in the background) or a blocking save
    units: int = 8  # micro-batches per global batch (fixed: the gradient does not depend on the world size)
    micro_batch: int = 4  # sequences per micro-batch
    lr: float = 0.01
    compare_losses: Optional[str] = None  # losses.json of a reference run: report (and require) a match
    loss_rtol: float = 0.0  # tolerance of that match, relative per step; 0 = bitwise
    kill_after_step: Optional[int] = None  # drill: SIGKILL one rank after this step (first attempt only)
    kill_rank: Optional[int] = None  # the rank killed (default: the last)


@dataclass
class TransformJob(JobConf):
    pass  # its options are the transform= group


JOB_SCHEMAS: dict[str, type] = {"save": SaveJob, "load": LoadJob, "reshard": ReshardJob, "inspect": InspectJob,
                                "verify": VerifyJob, "bench": BenchJob, "train": TrainJob, "transform": TransformJob}


@dataclass
class TransformConf:
    kind: str = "merge_hf"  # merge_hf | import | to_torch_dcp
    src: Optional[str] = None  # merge_hf/to_torch_dcp: our checkpoint; import: the foreign checkpoint
    dst: Optional[str] = None  # the output directory (created atomically)
    source_format: str = "auto"  # import: auto | hf | safetensors | pt | torch_dcp | hyper_parallel
    max_shard_size: Size = "5GB"  # merge_hf: cap per model-*.safetensors file
    dtype: Optional[str] = None  # merge_hf: cast floating tensors (e.g. bfloat16)
    single_file: bool = False  # merge_hf: one model.safetensors whatever the size
    include: Optional[str] = None  # regex (re.search) a tensor name must match
    exclude: Optional[str] = None  # regex that drops a tensor name (e.g. ^optim\.)
    # merge_hf: a model+optimizer checkpoint gives only the model's weights under the model's own
    # names (what is left out is reported); false writes every tensor
    model_only: bool = True
    # merge_hf: the Hugging Face directory whose config.json / tokenizer files travel with the output
    files_from: Optional[str] = None
    # [{pattern: <re.sub pattern>, replace: <replacement>}, ...] applied in order to kept names
    rename: list[Any] = field(default_factory=list)
    world_size: int = 1  # import: number of rank files
    layout: str = "fsdp"  # import: the layout preset (conf/layout) the rank files follow
    allow_pickle: bool = False  # torch_dcp / hyper_parallel sources: their metadata is a pickle
    overwrite: bool = False


@dataclass
class Config:
    dcp: DcpConf = field(default_factory=DcpConf)
    layout: LayoutConf = field(default_factory=LayoutConf)
    model: ModelConf = field(default_factory=ModelConf)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    runtime: RuntimeConf = field(default_factory=RuntimeConf)
    job: Any = None  # one of JOB_SCHEMAS, checked against it in validate_all
    transform: TransformConf = field(default_factory=TransformConf)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="hpdcp_schema", node=Config)
    for name, schema in JOB_SCHEMAS.items():
        cs.store(group="job", name=f"{name}_schema", node=schema)
    cs.store(group="layout", name="layout_schema", node=LayoutConf)
    cs.store(group="model", name="model_schema", node=ModelConf)
    cs.store(group="transform", name="transform_schema", node=TransformConf)
    cs.store(group="planner", name="planner_schema", node=PlannerConf, package="dcp.planner")
    cs.store(group="storage", name="storage_schema", node=StorageConf, package="dcp.storage")


def to_plain(cfg: DictConfig) -> dict:
    """Resolved plain dict of the user config (no ``hydra`` node)."""
    d = OmegaConf.to_container(cfg, resolve=True)
    d.pop("hydra", None)
    return d


def _positive_size(value: Any, key: str) -> list[str]:
    """The problem with a size that must be positive, if any."""
    try:
        return [f"{key}: must be positive"] if parse_size(value, key) == 0 else []
    except ConfigError as e:
        return [str(e)]


def _rename_problems(rules: Any, key: str) -> list[str]:
    """Each bad ``[{pattern, replace}]`` rule, checked by the engine's own compile_rules."""
    from .dcp.tools import compile_rules

    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, dict) or set(r) != {"pattern", "replace"} or not all(isinstance(v, str) for v in r.values()):
            out.append(f"{key}[{i}]: must be {{pattern: <regex>, replace: <text>}}, got {r!r}")
            continue
        try:
            compile_rules([r])
        except ConfigError as e:
            out.append(f"{key}[{i}]: bad rule {r['pattern']!r} -> {r['replace']!r} ({str(e).split(': ', 1)[-1]})")
    return out


def _transform_problems(c: Config, world_size: int) -> list[str]:
    from .dcp.tools import DTYPES
    from . import layouts

    t, out = c.transform, []
    if world_size != 1:
        out.append(f"job.name: transform runs as one process (python -m hpdcp_runner +job=transform), "
                   f"not under {world_size} ranks")
    if t.kind not in TRANSFORMS:
        out.append(f"transform.kind: {t.kind!r} is not one of {', '.join(TRANSFORMS)}")
    for key in ("src", "dst"):
        if not getattr(t, key):
            out.append(f"transform.{key}: required (a path)")
    if t.source_format not in SOURCE_FORMATS:
        out.append(f"transform.source_format: {t.source_format!r} is not one of {', '.join(SOURCE_FORMATS)}")
    out += _positive_size(t.max_shard_size, "transform.max_shard_size")
    if t.dtype is not None and t.dtype not in DTYPES:
        out.append(f"transform.dtype: {t.dtype!r} is not a dtype ({', '.join(sorted(DTYPES))})")
    for key in ("include", "exclude"):
        pat = getattr(t, key)
        if pat is not None:
            try:
                re.compile(pat)
            except re.error as e:
                out.append(f"transform.{key}: bad regex {pat!r} ({e})")
    out += _rename_problems(t.rename, "transform.rename")
    if t.world_size < 1:
        out.append(f"transform.world_size: must be >= 1, got {t.world_size}")
    elif t.kind == "import":
        if t.layout not in layouts.preset_names():
            out.append(f"transform.layout: unknown layout {t.layout!r} (choose {', '.join(layouts.preset_names())})")
        else:
            out += [f"transform.layout ({t.layout}).{p}" for p in layouts.problems(load_preset(t.layout),
                                                                                   t.world_size)]
    return out


def _source_problems(c: Config) -> list[str]:
    """job.source.format / rename and the reshard output options."""
    from .dcp.tools import FORMATS

    j, out = c.job, []
    source = getattr(j, "source", None)
    if source is not None:
        if source.format not in FORMATS:
            out.append(f"job.source.format: {source.format!r} is not one of {', '.join(FORMATS)}")
        if source.weights not in ("fp32", "module"):
            out.append(f"job.source.weights: {source.weights!r} is not one of fp32, module")
        out += _rename_problems(source.rename or [], "job.source.rename")
    if isinstance(j, ReshardJob):
        if j.output_format not in ("hpdcp", "hf"):
            out.append(f"job.output_format: {j.output_format!r} is not hpdcp or hf")
        out += _positive_size(j.hf_max_shard_size, "job.hf_max_shard_size")
        if j.experts not in (None, "stack", "unstack"):
            out.append(f"job.experts: {j.experts!r} is not stack or unstack")
        elif j.experts and (not j.source.path or j.output_format != "hpdcp"):
            out.append("job.experts: stacks or unstacks the experts of job.source.path into hpdcp output; for "
                       "Hugging Face, unstack into hpdcp first, then export that (job.output_format=hf)")
        from . import layouts

        if not j.source.path and j.source.layout not in layouts.preset_names():
            out.append(f"job.source.layout: unknown layout {j.source.layout!r} "
                       f"(choose {', '.join(layouts.preset_names())})")
    if isinstance(j, InspectJob):
        if j.ranks is not None and j.ranks < 1:
            out.append(f"job.ranks: must be >= 1, got {j.ranks}")
        if j.format not in ("table", "json"):
            out.append(f"job.format: {j.format!r} is not table or json")
    for key in ("include", "exclude"):
        pat = getattr(j, key, None)
        if pat is not None:
            try:
                re.compile(pat)
            except re.error as e:
                out.append(f"job.{key}: bad regex {pat!r} ({e})")
    if isinstance(j, ReshardJob) and j.dtype is not None:
        from .dcp.tools import DTYPES

        if j.dtype not in DTYPES:
            out.append(f"job.dtype: {j.dtype!r} is not a dtype ({', '.join(sorted(DTYPES))})")
        elif j.output_format != "hf":
            out.append("job.dtype: casts Hugging Face output only (job.output_format=hf); an hpdcp reshard keeps "
                       "the dtypes as saved")
    if isinstance(j, BenchJob):
        if j.peer and importlib.util.find_spec("numpy") is None:
            out.append("job.peer: the torch.distributed.checkpoint side needs numpy: pip install numpy")
        if j.repeats < 1 or j.warmup < 0:
            out.append("job.repeats/job.warmup: repeats must be >= 1 and warmup >= 0")
    return out


def _train_problems(c: Config) -> list[str]:
    out = []
    if c.layout.kind == "flat":
        out.append("layout.kind: the train job needs a plain or dtensor layout (flat shards are not trainable parameters)")
    for i, r in enumerate(c.layout.rules):
        if r.parts or "E" in [str(p) for p in r.placements]:
            out.append(f"layout.rules[{i}]: the train job's synthetic model has no fused or expert tensors; "
                       f"fused parts and E place checkpoints (reshard, load, bench), not its parameters")
    if c.model.kind != "transformer":
        out.append(f"model.kind: the train job trains model.kind=transformer (e.g. model=tiny), not {c.model.kind!r}")
    elif c.model.heads < 1 or c.model.hidden % c.model.heads:
        out.append(f"model.heads: {c.model.heads} must divide model.hidden={c.model.hidden}")
    if not 0.0 <= c.model.dropout < 1.0:
        out.append(f"model.dropout: must be in [0, 1), got {c.model.dropout}")
    if c.model.seq_len < 1:
        out.append(f"model.seq_len: must be >= 1, got {c.model.seq_len}")
    for key in ("steps", "units", "micro_batch"):
        if getattr(c.job, key) < 1:
            out.append(f"job.{key}: must be >= 1, got {getattr(c.job, key)}")
    if c.job.save_every < 0:
        out.append(f"job.save_every: must be >= 0 (0: never), got {c.job.save_every}")
    if c.job.loss_rtol < 0:
        out.append(f"job.loss_rtol: must be >= 0, got {c.job.loss_rtol}")
    if c.checkpoint.rank_state not in ("reseed", "error"):
        out.append(f"checkpoint.rank_state: {c.checkpoint.rank_state!r} is not reseed or error")
    return out


def _tier_problems(c: Config) -> list[str]:
    from .dcp.tools import locate

    t, out = c.checkpoint.fast_tier, []
    if t.keep_last < 0:
        out.append(f"checkpoint.fast_tier.keep_last: must be >= 0 (0 keeps all), got {t.keep_last}")
    if t.drain_every < 1:
        out.append(f"checkpoint.fast_tier.drain_every: must be >= 1 (every k-th save is drained), got {t.drain_every}")
    if t.replicas < 0:
        out.append(f"checkpoint.fast_tier.replicas: must be >= 0, got {t.replicas}")
    if t.dir is None:
        return out
    try:
        fast = locate(t.dir)
        fast.local_dir("not a local directory (the fast tier is a local NVMe or RAM disk; the store goes in "
                       "checkpoint.dir, the durable tier)")
    except ConfigError as e:
        out.append(f"checkpoint.fast_tier.dir: {e}")
        fast = None
    if c.job is not None and c.job.name != "train":
        out.append(f"checkpoint.fast_tier.dir: only the train job saves through tiers (this is the {c.job.name} job); "
                   f"drop the key")
    if c.checkpoint.dir and fast is not None and _same_place(c.checkpoint.dir, fast):
        out.append("checkpoint.fast_tier.dir: the same directory as checkpoint.dir (the durable tier); pick another")
    return out


def _same_place(path: str, loc: Any) -> bool:
    from .dcp.tools import locate

    try:
        return locate(path).url == loc.url
    except ConfigError:  # (a scheme no store serves: named by its own check)
        return False


def _checkpoint_problems(c: Config) -> list[str]:
    name, out = c.checkpoint.name, []
    plain = name.replace("{step}", "")
    if not name or "/" in name or "\\" in name or name.startswith(".") or "{" in plain or "}" in plain \
            or name.count("{step}") > 1 or name in ("..",):
        out.append(f"checkpoint.name: {name!r} must be a plain directory name, optionally with one {{step}} "
                   f"field (e.g. step_{{step}}); it cannot start with '.' or contain '/'")
    if c.checkpoint.step < 0:
        out.append(f"checkpoint.step: must be >= 0, got {c.checkpoint.step}")
    if c.job is not None and c.job.name == "train" and not out and "{step}" not in checkpoint_series(name, 0)[1]:
        out.append(f"checkpoint.name: the train job writes one checkpoint per step: use a pattern with {{step}} "
                   f"(e.g. step_{{step}}), not {name!r}")
    return out


def validate_all(cfg: DictConfig, world_size: int) -> tuple[Config, "EngineOptions"]:
    """Re-check against the schema (``+key=`` bypasses struct mode) and cross-check fields.

    Raises one ConfigError listing every problem with its full key.
    """
    problems: list[str] = []
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), to_plain(cfg))
    except OmegaConfBaseException as e:
        full_key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"invalid config: {full_key or '?'}: {msg}") from None
    c: Config = OmegaConf.to_object(merged)
    from . import layouts

    if c.layout.file:
        c.layout = layout_from_file(c.layout)

    if c.job is None:
        problems.append(f"job: no job given; pick one with +job=<name>: {', '.join(JOBS)}")
    elif not isinstance(c.job, dict) or c.job.get("name") not in JOB_SCHEMAS:
        name = c.job.get("name") if isinstance(c.job, dict) else c.job
        problems.append(f"job.name: unknown job {name!r} (jobs: {', '.join(JOBS)})")
    else:  # the job's own schema: another job's key is an error naming it
        try:
            c.job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JOB_SCHEMAS[c.job["name"]]), c.job))
        except OmegaConfBaseException as e:
            key = getattr(e, "key", None) or getattr(e, "full_key", None) or "?"
            raise ConfigError(f"invalid config: job.{key}: {str(e).splitlines()[0]} (the {c.job['name']} job "
                              f"has no such key; its keys: {', '.join(_job_keys(c.job['name']))})") from None
    try:  # every engine knob: parsed and checked here, once
        from .engine_options import engine_options  # (it imports this module's sizes)

        options = engine_options(c)
    except ConfigError as e:
        problems += str(e).split("\n")
        options = None
    for key, value in (("dcp.timeout_s", c.dcp.timeout_s), ("runtime.timeout_s", c.runtime.timeout_s)):
        if value <= 0:
            problems.append(f"{key}: must be positive seconds, got {value}")
    problems += _checkpoint_problems(c)
    if c.checkpoint.keep_last < 0:
        problems.append(f"checkpoint.keep_last: must be >= 0 (0 keeps all), got {c.checkpoint.keep_last}")
    problems += _tier_problems(c)
    if c.runtime.backend not in ("auto", "gloo", "nccl"):
        problems.append(f"runtime.backend: {c.runtime.backend!r} is not auto, gloo or nccl")
    if c.runtime.device not in ("cpu", "cuda"):
        problems.append(f"runtime.device: {c.runtime.device!r} is not cpu or cuda")
    if c.runtime.backend == "nccl" and c.runtime.device == "cpu":
        problems.append("runtime.backend: nccl cannot carry CPU tensors; use runtime.device=cuda or backend gloo")
    # inspect only describes a layout, at job.ranks ranks when given
    inspect = isinstance(c.job, InspectJob)
    layout_ws = c.job.ranks if inspect and c.job.ranks else world_size
    hint = " (inspect: add job.ranks=<N> to show the layout at N ranks)" if inspect and not c.job.ranks else ""
    problems += [f"layout.{p}{hint if 'world size' in p else ''}" for p in layouts.problems(c.layout, layout_ws)]
    if c.layout.kind == "auto" and not (getattr(c.job, "source", None) is not None and c.job.source.path):
        problems.append("layout: auto picks the rule table of the checkpoint's model family, so it needs "
                        "job.source.path=<checkpoint> (or pick a layout: layout=<name>)")
    if c.model.dtype not in ("float32", "bfloat16", "float16"):
        problems.append(f"model.dtype: {c.model.dtype!r} is not float32, bfloat16 or float16")
    if c.model.kind not in ("transformer", "peer", "mlp_adamw"):
        problems.append(f"model.kind: {c.model.kind!r} is not transformer, peer or mlp_adamw")
    if c.job is not None:
        if c.job.name in ("inspect", "verify") and not (c.checkpoint.path or c.job.source.path):  # ReadingJobs
            problems.append(f"checkpoint.path: the {c.job.name} job needs checkpoint.path=<checkpoint dir> "
                            f"(or job.source.path=)")
        problems += _source_problems(c)
        if c.job.name == "train":
            problems += _train_problems(c)
        if c.job.name == "transform":
            problems += _transform_problems(c, world_size)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    return c, options


def _job_keys(name: str) -> list[str]:
    from dataclasses import fields

    return [f.name for f in fields(JOB_SCHEMAS[name]) if f.name != "name"]


def validate(cfg: DictConfig, world_size: int) -> Config:
    """:func:`validate_all` without the engine options (tests, tools)."""
    return validate_all(cfg, world_size)[0]


def layout_from_file(layout: LayoutConf) -> LayoutConf:
    """``layout.file``: a user's layout YAML (the schema of ``conf/layout/*.yaml``) read over the
    composed layout; relative paths are from the launch directory. Its name defaults to the
    file's. A key the schema lacks, or a wrong type, is one error naming the file and the key."""
    from . import runtime

    from .user_files import field_names, load_yaml_mapping, unknown_field

    path = os.path.normpath(os.path.join(runtime.launch_dir(), os.path.expanduser(layout.file)))
    data, lines = load_yaml_mapping(path, "layout.file")  # bounded; errors name lines, never content
    data.pop("defaults", None)
    fields = field_names(LayoutConf)
    for key in data:
        if key not in fields:
            raise unknown_field(path, "layout.file", key, lines.get(str(key)), fields)
    rule_fields = field_names(RuleConf)
    for i, rule in enumerate(data.get("rules") or []):
        for key in rule if isinstance(rule, dict) else ():
            if key not in rule_fields:
                raise unknown_field(path, "layout.file", key, None, rule_fields, f"rules[{i}].")
    raw = OmegaConf.create(data)
    base = OmegaConf.structured(layout)
    base.name = os.path.splitext(os.path.basename(path))[0]
    try:
        out = OmegaConf.to_object(OmegaConf.merge(base, raw))
    except OmegaConfBaseException as e:
        raise ConfigError(f"layout.file: {path}: {getattr(e, 'full_key', None) or '?'}: "
                          f"{str(e).splitlines()[0]} (a rule has pattern, placements, parts, parts_dim, unit, "
                          f"experts)") from None
    out.file = path
    return out


def make_layout(fields: dict) -> "LayoutConf":
    """A LayoutConf from plain fields (``layout=auto`` built from a family's plan), checked by the schema."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LayoutConf), fields))


def load_preset(name: str) -> "LayoutConf":
    """A layout from ``conf/layout/<name>.yaml`` as a LayoutConf (used by reshard's source layout)."""
    raw = OmegaConf.load(os.path.join(find_conf_dir(), "layout", f"{name}.yaml"))
    raw.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LayoutConf), raw))
