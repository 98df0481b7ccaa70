r"""``layout=auto`` from a Hugging Face family's own parallel plans (transformers >= 5).

transformers ships, per family, a tensor-parallel plan (``base_model_tp_plan``: module ->
``colwise`` / ``rowwise`` / ``embedding_rowwise`` / ``packed_colwise`` ...) and an
expert-parallel plan (``base_model_ep_plan``: ``grouped_gemm`` on stacked experts). The plans
name the modules as transformers builds them in memory; the checkpoint names weights as
``save_pretrained`` wrote them (experts one key per expert, fused in memory by the family's
conversion mapping). This module builds the family's model on the meta device (no memory, no
weights, no remote code), asks transformers which model parameter each file key loads into and
through which operations (stacking experts, concatenating gate and up), and turns the plan's
style for that parameter into a rule for the file key: column/row splits, vocabulary-parallel
embeddings, packed projections split per part, experts whole per rank.

Heads are units: a split dimension of an attention weight that counts heads (``head_dim`` from
``config.json``, or hidden / heads; key/value heads apart from query heads) is split on whole
heads; key/value heads fewer than the ranks are replicated (what tensor-parallel runtimes do)
and said so; any other split that would cut a head is refused naming the weight.

Only the runner imports this (transformers is the optional ``interop`` extra).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

from .dcp import ConfigError

#: styles that shard a parameter; every other style the plans use keeps it whole on every rank
#: (they change what a module's forward communicates, not where its weights live)
COLWISE = {"colwise", "colwise_gather_output", "colwise_rep", "unit_colwise", "local_colwise"}
ROWWISE = {"rowwise", "rowwise_split_input", "rowwise_rep", "unit_rowwise", "local_rowwise"}
PACKED = {"packed_colwise": "col", "packed_rowwise": "row"}
EMBEDDING = {"embedding_rowwise": 0, "embedding_colwise": 1}
EXPERTS = {"grouped_gemm"}
ATTENTION = re.compile(r"(^|\.)[^.]*(attn|attention)[^.]*\.")
SUFFIX = r"(\..+)?"  # optimizer state keyed by parameter name follows its parameter


@dataclasses.dataclass(frozen=True)
class Split:
    """One mesh dimension's placement of a model parameter: ``kind`` R, S (dim ``dim``) or E
    (whole experts, dim ``dim`` counts them); ``parts`` > 1: packed, each part split on its own."""

    kind: str
    dim: int = 0
    parts: int = 1
    unit: int = 1  # cut only on multiples of this (interleaved gate/up pairs)


R = Split("R")


@dataclasses.dataclass
class PlannedRule:
    """A rule for one file key (before grouping keys that share it into one pattern)."""

    placements: list[str]
    parts: list[int] | None = None
    parts_dim: int = 0
    unit: int | None = None
    replicate_few: bool = False  # fused q/k/v: key/value heads fewer than the ranks held whole
    per_expert: bool = False  # E over keys, one per expert (the expert number is in the key)
    experts: int | None = None  # how many (the stacked dim of the model parameter they fill)
    why: str = ""


class PlanUnavailable(Exception):
    """transformers is not installed, or knows no plan for this family (fall back to presets)."""


def _transformers():
    try:
        import transformers  # noqa: F401
        from transformers import CONFIG_MAPPING
    except ImportError as e:
        raise PlanUnavailable("transformers is not installed (pip install 'hpdcp_runner[interop]')") from e
    return transformers, CONFIG_MAPPING


def family_plans(model_type: str) -> tuple[dict, dict]:
    """(tensor-parallel plan, expert-parallel plan) a family's config class declares ({} if none)."""
    _, mapping = _transformers()
    try:
        cls = mapping[model_type]
    except KeyError:
        raise PlanUnavailable(f"transformers {_version()} does not know model_type {model_type!r}") from None
    return dict(getattr(cls, "base_model_tp_plan", None) or {}), dict(getattr(cls, "base_model_ep_plan", None) or {})


def _version() -> str:
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return "(not installed)"


def _meta_model(raw: Mapping[str, Any]):
    """The family's model built on the meta device from ``config.json`` (no weights, no memory;
    a causal-LM head where the family has one, since that is what most checkpoints hold)."""
    import torch

    transformers, mapping = _transformers()
    from transformers import AutoModel, AutoModelForCausalLM

    mt = raw.get("model_type")
    layers = [v for k, v in _walk(raw) if k == "num_hidden_layers"]
    if any(not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_LAYERS for n in layers):
        raise ConfigError(f"layout=auto: config.json num_hidden_layers {layers} is not a layer count from 1 to "
                          f"{MAX_LAYERS}")
    try:
        cls = mapping[mt]
        given = {k: v for k, v in raw.items() if k not in ("auto_map", "quantization_config")}
        # config.json writes Infinity / NaN as {"__float__": ...}; transformers' own reader decodes them
        config = cls.from_dict(getattr(cls, "_decode_special_floats", lambda d: d)(given))
    except Exception as e:  # a config this transformers cannot read is the user's to fix
        raise ConfigError(f"layout=auto: transformers {_version()} cannot read this config.json as {mt!r}: {e}") from None
    last = None
    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                return auto.from_config(config)
        except (ValueError, KeyError) as e:  # no such head for this family: try the next
            last = e
    raise PlanUnavailable(f"transformers {_version()} cannot build a {mt!r} model: {last}")


MAX_LAYERS = 1024  # the meta model is built layer by layer: a hostile config.json cannot make it hang


def _walk(d: Any):
    """Every (key, value) of a nested config.json (text and vision sub-configs too)."""
    if isinstance(d, Mapping):
        for k, v in d.items():
            yield k, v
            yield from _walk(v)


def _conversions(model) -> tuple[list, list]:
    """The family's renamings and converters, as ``save_pretrained`` reverses them (the load
    direction maps a file key to the model parameter it fills). transformers 4.x has none: its
    files name the parameters as the model does."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:
        return [], []

    conv = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return ([c for c in conv if isinstance(c, WeightRenaming) and not isinstance(c, WeightConverter)],
            [c for c in conv if isinstance(c, WeightConverter)])


def _generic(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _style(plan: Mapping[str, str], param: str) -> tuple[str | None, str | None]:
    """(style, plan entry) for a model parameter: the entry naming the parameter itself
    (``experts.gate_up_proj``) or its module (``self_attn.q_proj``), layer numbers as ``*``."""
    g = _generic(param)
    for entry in (g, g.rsplit(".", 1)[0] if "." in g else None):
        if entry is not None and entry in plan:
            return plan[entry], entry
    return None, None


def _tp_split(style: str, leaf: str, ndim: int) -> Split | None:
    """A tensor-parallel style's placement of one parameter (transformers' own rules: colwise
    shards the output dim ``ndim-2`` of weights and the bias, rowwise the input dim and keeps the
    bias whole); None for a style that keeps it whole."""
    if ndim == 0:
        return None
    if style in COLWISE:
        return Split("S", max(ndim - 2, 0))
    if style in ROWWISE:
        return None if leaf == "bias" or ndim == 1 else Split("S", ndim - 1)
    if style in PACKED:
        if ndim == 1:
            return Split("S", 0, 2) if PACKED[style] == "col" else None
        return Split("S", ndim - 2 if PACKED[style] == "col" else ndim - 1, 2)
    if style in EMBEDDING:
        return Split("S", min(EMBEDDING[style], ndim - 1))
    return None


def _expert_tp_split(param: str, ndim: int, transposed: bool = False, concatenated: bool = True) -> Split | None:
    """Tensor parallelism inside stacked experts where the plan names none: gate|up by output
    (each rank its rows of gate and of up: parts when concatenated, whole gate/up pairs when
    interleaved), down by input, their biases likewise. ``transposed``: stored ``[experts, in,
    out]`` (GPT-OSS) rather than ``[experts, out, in]``."""
    leaf = param.rsplit(".", 1)[-1]
    down = "down" in leaf or leaf == "w2"
    if ndim == 2:  # a bias [experts, out]: the output dim of gate|up, whole for down (added after the reduce)
        return None if down else (Split("S", 1, 2) if concatenated and "gate_up" in leaf else
                                  Split("S", 1, unit=2) if "gate_up" in leaf else Split("S", 1))
    if ndim != 3:
        return None
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    if down:
        return Split("S", in_dim)
    if "gate_up" not in leaf:
        return Split("S", out_dim)
    return Split("S", out_dim, 2) if concatenated else Split("S", out_dim, unit=2)


class _Family:
    """One family's plans, meta model and conversions, with the facts a rule needs."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.model_type = raw.get("model_type")
        self.model = _meta_model(raw)
        self.shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        self.meta = dict.fromkeys(self.shapes, True)  # rename_source_key asks membership only
        self.prefix = getattr(self.model, "base_model_prefix", "") or ""
        self.tp_plan = dict(getattr(self.model, "tp_plan", None) or getattr(self.model, "_tp_plan", None) or {})
        self.ep_plan = dict(getattr(self.model, "ep_plan", None) or getattr(self.model, "_ep_plan", None) or {})
        self.renamings, self.converters = _conversions(self.model)
        cfg = self.model.config
        text = getattr(cfg, "get_text_config", lambda: cfg)()
        self.heads = _int(text, "num_attention_heads")
        self.kv_heads = _int(text, "num_key_value_heads") or self.heads
        hidden = _int(text, "hidden_size")
        dims = [_int(text, n) for n in ("head_dim", "qk_head_dim", "v_head_dim")]
        if _int(text, "qk_nope_head_dim") and _int(text, "qk_rope_head_dim"):
            dims.append(_int(text, "qk_nope_head_dim") + _int(text, "qk_rope_head_dim"))
        if _int(text, "qk_nope_head_dim") and _int(text, "v_head_dim"):  # MLA's kv_b_proj: k without rope, and v
            dims.append(_int(text, "qk_nope_head_dim") + _int(text, "v_head_dim"))
        if hidden and self.heads:
            dims.append(hidden // self.heads)
        self.head_dims = sorted({d for d in dims if d}, reverse=True)

    def model_param(self, key: str) -> tuple[str | None, Any]:
        """(model parameter, converter or None) a file key loads into: the key itself as
        ``save_pretrained`` wrote it, or the same under a prefix (``model.`` of a training state)
        or with optimizer state after it (``.exp_avg``)."""
        parts = key.split(".")
        for head in range(min(4, len(parts))):
            for tail in range(min(3, len(parts) - head)):
                got = self._param(".".join(parts[head:len(parts) - tail]))
                if got[0] is not None:
                    return got
        return None, None

    def _param(self, key: str) -> tuple[str | None, Any]:
        try:
            from transformers.core_model_loading import rename_source_key
        except ImportError:  # transformers 4.x: the file's names are the model's (with or without its prefix)
            name = key if key in self.shapes else f"{self.prefix}.{key}"
            return (name, (None, None)) if name in self.shapes else (None, None)
        try:
            name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.meta)
        except Exception:  # a key transformers' own renaming cannot read: not a model parameter
            return None, None
        if name not in self.shapes:
            return None, None
        conv = next((c for c in self.converters if pattern in c.source_patterns), None) if pattern else None
        return name, (conv, pattern)

    def experts_layout(self, param: str) -> tuple[bool, bool] | None:
        """(transposed, concatenated) of a stacked experts parameter, as its module declares
        (transformers' experts interface: ``is_transposed``, ``is_concatenated``); None when the
        module says nothing."""
        try:
            mod = self.model.get_submodule(param.rsplit(".", 1)[0])
        except AttributeError:
            return None
        t, c = getattr(mod, "is_transposed", None), getattr(mod, "is_concatenated", None)
        return (t, c) if isinstance(t, bool) and isinstance(c, bool) else None

    def heads_of(self, key: str, size: int) -> tuple[int, int, str] | None:
        """(heads, head size, 'query'/'key/value') when ``size`` counts whole heads of an
        attention weight; None for any other dimension."""
        if not ATTENTION.search(key) or not self.heads:
            return None
        for hd in self.head_dims:
            if size % hd == 0:
                n = size // hd
                if n == self.heads:
                    return n, hd, "query"
                if n == self.kv_heads:
                    return n, hd, "key/value"
        return None

    def interleaved_qkv(self, key: str, size: int) -> int | None:
        """The unit of a q|k|v projection fused per head (GPT-NeoX's ``query_key_value``: each
        head's q, k and v rows together), or None."""
        if not ATTENTION.search(key) or not self.heads:
            return None
        return next((3 * hd for hd in self.head_dims if size == 3 * self.heads * hd), None)

    def fused_qkv(self, key: str, size: int) -> tuple[list[int], int] | None:
        """(the q, k, v part sizes, the head size) of a fused attention projection, or None."""
        if not self.heads or "qkv" not in key.rsplit(".", 2)[-2]:
            return None
        for hd in self.head_dims:
            if size == (self.heads + 2 * self.kv_heads) * hd:
                return [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], hd
        return None


def _int(cfg: Any, name: str) -> int:
    v = getattr(cfg, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _to_file(split: Split, model_shape: tuple[int, ...], conv: Any, pattern: str | None,
             file_ndim: int) -> tuple[str, Split | None]:
    """A model parameter's split seen from one file key that converter ``conv`` (source
    ``pattern``) turns into it: (``ok``, the file key's split) or (reason, None) when the file
    key cannot hold what the plan asks (the split is not expressible per file key)."""
    if split.kind == "R":
        return "ok", R
    if conv is None:
        return "ok", split
    dim, parts = split.dim, split.parts
    for op in reversed(conv.operations):  # undo the load-direction operations, last first
        name = type(op).__name__
        if name == "Concatenate":
            n = len(conv.source_patterns)
            if dim == op.dim and split.kind == "S":
                if parts != n and parts != 1:
                    return f"a packed split in {parts} parts of {n} concatenated weights", None
                if parts == 1 and n > 1:
                    return f"a plain split across {n} concatenated weights", None
                parts = 1
        elif name == "MergeModulelist":
            if dim == op.dim:
                if split.kind not in ("E", "S"):
                    return "a split of stacked experts", None
                return "ok", Split("E", -1, model_shape[op.dim])  # one key per expert: whole experts, by key
            if dim > op.dim:
                dim -= 1
        elif name == "Transpose":
            a, b = op.dim0, op.dim1
            dim = b if dim == a else a if dim == b else dim
        else:
            return f"transformers' {name} conversion", None
    if not 0 <= dim < file_ndim:
        return f"dim {dim} of a {file_ndim}-d weight", None
    return "ok", Split(split.kind, dim, parts, split.unit)


PARALLEL = ("tp", "fsdp_tp", "ep", "ep_tp")
#: what the plan does not split: replicated, or FSDP-sharded on dim 0 under fsdp_tp
REST = {"tp": ("R",), "ep": ("R",), "fsdp_tp": ("S0", "R"), "ep_tp": ("R", "R")}


def plan_rules(raw: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]], parallel: str | None,
               mesh: list[int] | None, ranks: int) -> tuple[dict, str, dict]:
    """``layout=auto`` from the family's plans: (layout fields, one line saying what placed it,
    a report for inspect and the summary). ``tensors``: file key -> shape; ``ranks``: the world
    size it is planned for (heads are checked against it). Raises :class:`PlanUnavailable` when
    the family has no plan (presets then), ConfigError for a plan that cannot apply."""
    mt = raw.get("model_type")
    if not isinstance(mt, str):
        raise PlanUnavailable("config.json names no model_type")
    tp_plan, ep_plan = family_plans(mt)
    if not tp_plan and not ep_plan:
        raise PlanUnavailable(f"transformers {_version()} has no parallel plan for {mt!r}")
    fam = _Family(raw)
    mapped = {k: fam.model_param(k) for k in sorted(tensors)}
    has_experts = any(_style(fam.ep_plan, name)[0] in EXPERTS for name, _ in mapped.values() if name)
    parallel = parallel or ("ep" if has_experts else "tp")
    if parallel not in PARALLEL:
        raise ConfigError(f"layout.parallel: {parallel!r} is not one of {', '.join(PARALLEL)}")
    if parallel.startswith("ep") and not has_experts:
        raise ConfigError(f"layout.parallel={parallel}: the {mt} family's plan places no experts (no expert-parallel "
                          f"plan matches its weights); choose tp or fsdp_tp")
    two_d = parallel in ("fsdp_tp", "ep_tp")
    mesh = list(mesh) if mesh else ([-1, 2] if two_d else [-1])
    if len(mesh) != (2 if two_d else 1):
        raise ConfigError(f"layout.mesh: {mesh} needs {2 if two_d else 1} dimension(s) for layout.parallel={parallel}")
    sizes = _mesh_sizes(mesh, ranks)
    planned, report = {}, {"split": [], "whole_by_plan": [], "replicated_kv": [], "unmapped": [], "no_entry": [],
                           "experts_whole_in_tp": []}
    for key, (name, how) in mapped.items():
        if name is None:
            continue
        rule = _rule_for(fam, key, name, how, tuple(tensors[key]), parallel, sizes, report)
        if rule is not None:
            planned[key] = rule
    rules = _group(planned)
    # the rest (norms, routers, what the plan leaves whole) by choice, not by omission: replicated,
    # or FSDP-sharded on dim 0 under fsdp_tp
    rules.append({"pattern": ".*", "placements": list(REST[parallel]), "why": f"{parallel}: not split by the plan"})
    total = sum(_numel(s) for s in tensors.values())
    split = sum(_numel(tensors[k]) for k in report["split"])
    report.update(elements_split=split, elements=total, parallel=parallel, family=mt, transformers=_version())
    plans = {"tp": "tensor-parallel plan", "fsdp_tp": "tensor-parallel plan (FSDP beside it)",
             "ep": "expert-parallel plan", "ep_tp": "expert- and tensor-parallel plans"}[parallel]
    note = (f"layout=auto: the {mt} family's own {plans} (transformers {_version()}), "
            f"parallel={parallel}, mesh {mesh}: {len(report['split'])} weights "
            f"split, {100 * split / total if total else 0:.0f}% of the elements")
    if report["no_entry"]:
        note += f"; {len(report['no_entry'])} weight(s) the plan has no entry for are whole on every rank"
    if report["experts_whole_in_tp"]:
        note += f"; experts whole inside their tensor-parallel group ({len(report['experts_whole_in_tp'])} weights: " \
                f"stacked as the family stores them, with no plan entry saying how to split them)"
    if report["replicated_kv"]:
        note += f"; {len(report['replicated_kv'])} key/value projection(s) replicated ({fam.kv_heads} key/value heads " \
                f"for {sizes[-1]} tensor-parallel ranks)"
    fields = {"name": f"auto:{mt}_{parallel}", "kind": "dtensor", "mesh": mesh, "rules": rules}
    return fields, note, report


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _mesh_sizes(mesh: list[int], ranks: int) -> list[int]:
    known = _numel(d for d in mesh if d != -1)
    if known <= 0 or (ranks % known if -1 in mesh else known != ranks):
        raise ConfigError(f"layout.mesh: {mesh} does not fit {ranks} ranks")
    return [ranks // known if d == -1 else d for d in mesh]


def _rule_for(fam: _Family, key: str, name: str, how: Any, shape: tuple[int, ...], parallel: str,
              sizes: list[int], report: dict) -> PlannedRule | None:
    """The rule for one file key that loads into model parameter ``name``."""
    conv, pattern = how
    mshape = fam.shapes[name]
    leaf = name.rsplit(".", 1)[-1]
    tp_style, tp_entry = _style(fam.tp_plan, name)
    ep_style, ep_entry = _style(fam.ep_plan, name)
    expert = ep_style in EXPERTS and parallel.startswith("ep")
    # the model parameter's placement on each mesh dim, in transformers' terms
    if parallel == "tp":
        model = [_tp_split(tp_style, leaf, len(mshape)) if tp_style else None]
        why = f"tp plan {tp_entry}: {tp_style}" if tp_style else None
    elif parallel == "fsdp_tp":
        model = [None, _tp_split(tp_style, leaf, len(mshape)) if tp_style else None]
        why = f"tp plan {tp_entry}: {tp_style}" if tp_style else None
    elif expert:
        # tensor parallelism inside each expert: as the plan says; else gate|up by output, down
        # by input, oriented as the experts module declares (transformers' is_transposed /
        # is_concatenated: GPT-OSS stores [experts, in, out] with gate and up interleaved) or as
        # stacking per-expert Linear weights implies; with neither, whole inside, and said
        orient = fam.experts_layout(name)
        if orient is None and conv is not None and any(type(op).__name__ == "MergeModulelist" for op in conv.operations):
            orient = (False, True)  # stacked from per-expert Linear weights: [out, in], gate and up concatenated
        inner = _tp_split(tp_style, leaf, len(mshape)) if tp_style else \
            _expert_tp_split(name, len(mshape), *orient) if orient else None
        if parallel == "ep_tp" and not tp_style and orient is None and len(shape) >= 2:
            report["experts_whole_in_tp"].append(key)
        model = [Split("E", 0)] + ([inner] if parallel == "ep_tp" else [])
        why = f"ep plan {ep_entry}: {ep_style}" + (f", tp inside experts" if parallel == "ep_tp" else "")
    elif parallel == "ep_tp":
        model = [None, _tp_split(tp_style, leaf, len(mshape)) if tp_style else None]
        why = f"tp plan {tp_entry}: {tp_style}" if tp_style else None
    else:  # ep: non-experts are replicated (the catch-all rule)
        return None
    if why is None:
        if len(shape) >= 2 and leaf == "weight":  # whole as the family's own runtime keeps it (DeepSeek's
            report["no_entry"].append(key)        # q_a_proj beside a split q_b_proj): a rule says so
            return PlannedRule(placements=list(REST[parallel]), why="no entry in the family's plan: kept whole")
        return None
    file = []
    for s in model:
        if s is None:
            file.append(R)
            continue
        ok, fs = _to_file(s, mshape, conv, pattern, len(shape))
        if fs is None:
            report["unmapped"].append(f"{key} ({why}: {ok})")
            return None
        file.append(fs)
    rule = _place(fam, key, shape, file, parallel, sizes, report, why)
    if rule is not None and any(p != "R" for p in rule.placements):
        report["split"].append(key)
    elif any(s is not None and s.kind != "R" for s in model) and key not in report["replicated_kv"]:
        report["whole_by_plan"].append(key)
    return rule


def _place(fam: _Family, key: str, shape: tuple[int, ...], file: list[Split], parallel: str, sizes: list[int],
           report: dict, why: str) -> PlannedRule:
    """Placements, parts and head units for one file key; the FSDP dimension of fsdp_tp picked
    so it never cuts the tensor-parallel dim's heads or parts."""
    out = PlannedRule(placements=[], why=why)
    tp_dim = len(file) - 1  # the tensor-parallel mesh dim (the last)
    for mesh_dim, s in enumerate(file):
        if s.kind == "R":
            out.placements.append("R")
            continue
        if s.kind == "E":
            out.placements.append("E")
            out.per_expert = s.dim == -1  # one key per expert: ``parts`` carries how many experts there are
            out.experts = s.parts if out.per_expert else None
            continue
        out.placements.append(f"S{s.dim}")
        if mesh_dim != tp_dim:
            continue
        size = shape[s.dim]
        qkv = fam.fused_qkv(key, size) if s.dim == 0 else None
        if s.parts == 1 and s.dim == 0 and _fused_gate_up(key) and size % 2 == 0:
            s = Split(s.kind, s.dim, 2)  # Phi-3's gate_up_proj: each rank its rows of gate and of up
        if s.unit > 1:  # interleaved pairs (GPT-OSS's gate/up): whole pairs per rank
            out.unit, out.parts_dim = s.unit, s.dim
            continue
        if s.parts > 1 or qkv:
            out.parts = qkv[0] if qkv else [size // s.parts] * s.parts
            out.parts_dim = s.dim
            if qkv:
                out.unit = qkv[1]
                _check_heads(fam, key, [fam.heads, fam.kv_heads], sizes[mesh_dim], report, out)
            continue
        heads = fam.heads_of(key, size)
        per_head = fam.interleaved_qkv(key, size) if heads is None else None
        if heads:
            n, hd, what = heads
            out.unit, out.parts_dim = hd, s.dim
            _check_heads(fam, key, [n], sizes[mesh_dim], report, out, what)
        elif per_head:
            out.unit, out.parts_dim = per_head, s.dim
            _check_heads(fam, key, [fam.heads], sizes[mesh_dim], report, out, "query")
    if parallel == "fsdp_tp" and out.placements[-1] != "R":
        out.placements[0] = _fsdp_dim(shape, out)
    elif parallel == "fsdp_tp" and shape:
        out.placements[0] = "S0"
    return out


def _fused_gate_up(key: str) -> bool:
    """A dense MLP's gate and up projections fused in one Linear (``gate_up_proj``), whose plan
    style (``colwise_gather_output``) would let a plain split give one rank all of gate."""
    parts = key.split(".")
    return len(parts) >= 2 and "gate_up" in parts[-2] and ".experts." not in key


def _fsdp_dim(shape: tuple[int, ...], rule: PlannedRule) -> str:
    """FSDP's shard dim beside a tensor-parallel split: dim 0 unless that dim carries heads or
    parts (then the next one), or replicated for a 1-D tensor split by heads."""
    tp = int(rule.placements[-1][1:])
    if tp != 0 or (rule.unit is None and rule.parts is None):
        return "S0"
    return "S1" if len(shape) > 1 else "R"


def _check_heads(fam: _Family, key: str, counts: list[int], ranks: int, report: dict, rule: PlannedRule,
                 what: str = "query and key/value") -> None:
    """Whole heads per rank, or key/value heads replicated when fewer than the ranks."""
    bad = [n for n in counts if n % ranks]
    if not bad:
        return
    if what == "key/value" and fam.kv_heads < ranks and ranks % fam.kv_heads == 0:
        rule.placements[-1], rule.unit, rule.parts = "R", None, None
        report["replicated_kv"].append(key)
        return
    if what == "query and key/value" and bad == [fam.kv_heads] and fam.kv_heads < ranks and \
            ranks % fam.kv_heads == 0:  # fused: the key and value parts held whole, the queries split
        rule.replicate_few = True
        report["replicated_kv"].append(key)
        return
    raise ConfigError(f"layout=auto: {key!r} holds {', '.join(map(str, bad))} {what} head(s), which do not divide by "
                      f"{ranks} tensor-parallel ranks: a split would cut a head; run on a number of ranks that divides "
                      f"the heads, or set layout.mesh so the tensor-parallel size does")


def _group(planned: Mapping[str, PlannedRule]) -> list[dict]:
    """One rule per family of keys that differ only in layer (and expert) numbers and share a
    placement; per key where they do not."""
    groups: dict[str, list[tuple[str, PlannedRule]]] = {}
    for key, rule in planned.items():
        groups.setdefault(_pattern(key, rule), []).append((key, rule))
    out = []
    for pattern, members in groups.items():
        first = members[0][1]
        if all(dataclasses.astuple(r) == dataclasses.astuple(first) for _, r in members):
            out.append(_rule_dict(pattern, first))
        else:
            out += [_rule_dict(_pattern(k, r, exact=True), r) for k, r in members]
    return out


def _pattern(key: str, rule: PlannedRule, exact: bool = False) -> str:
    """A rule pattern for ``key``: any prefix (a state nested under ``model.``), layer numbers as
    ``\\d+``, the expert number as the ``expert`` group, optimizer state after it."""
    parts = key.split(".")
    per_expert = rule.per_expert
    e_at = max((i for i, p in enumerate(parts) if p.isdigit()), default=None) if per_expert else None
    out = []
    for i, p in enumerate(parts):
        if i == e_at:
            out.append(r"(?P<expert>\d+)")
        elif p.isdigit() and not exact:
            out.append(r"\d+")
        else:
            out.append(re.escape(p))
    return r"(.*\.)?" + r"\.".join(out) + SUFFIX


def _rule_dict(pattern: str, r: PlannedRule) -> dict:
    out: dict[str, Any] = {"pattern": pattern, "placements": list(r.placements), "why": r.why}
    if r.parts:
        out["parts"], out["parts_dim"] = list(r.parts), r.parts_dim
    elif r.unit is not None:
        out["parts_dim"] = r.parts_dim
    if r.unit is not None:
        out["unit"] = r.unit
    if r.replicate_few:
        out["replicate_few"] = True
    if r.experts is not None:
        out["experts"] = r.experts
    return out
