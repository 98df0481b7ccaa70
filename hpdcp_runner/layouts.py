r"""Layout config -> DeviceMesh + placements per parameter, applied to full reference tensors.

Every rank holds the same deterministic full tensors, so placing is local slicing (no
collectives); the slicing follows DTensor's ``Shard`` rule (``torch.chunk`` sizes).

Beyond ``R`` / ``S<d>`` a rule may say a tensor is fused (``parts``: the sizes of the tensors
concatenated along ``parts_dim``, e.g. q, k and v), in which case every part is placed as if it
were its own tensor and the rank holds its piece of each, concatenated (a ``FusedShard``); and a
mesh dimension may be ``E``: experts placed expert-parallel, whole experts per rank, either a
stacked ``[experts, ...]`` tensor (split along dim 0) or one key per expert (the pattern names
its index ``(?P<expert>\d+)``; only the ranks owning that expert hold the key). Sizes may be
numbers or expressions over the model's ``config.json`` (``num_key_value_heads*head_dim``).
"""

from __future__ import annotations

import ast
import math
import os
import re
from typing import Callable, Any, Iterable, Mapping

import torch

from .dcp import ConfigError, FlatShard, FusedShard, LocalShard
from .dcp.tools import Box, decompose_flat_interval, narrow, split_piece, whole
from .paths import find_conf_dir

CATCH_ALL = (".*", ".+", "(.*)", "^.*$")
PLACEMENT = re.compile(r"^(R|E|S-?\d+)$")


def preset_names() -> list[str]:
    """The layouts under ``conf/layout/`` (what ``job.source.layout`` may name)."""
    d = os.path.join(find_conf_dir(), "layout")
    return sorted(n[:-5] for n in os.listdir(d) if n.endswith(".yaml")) if os.path.isdir(d) else []


def mesh_shape(layout: Any, world_size: int) -> tuple[int, ...]:
    dims = list(layout.mesh)
    known = math.prod(d for d in dims if d != -1)
    return tuple(world_size // known if d == -1 else d for d in dims)


def problems(layout: Any, world_size: int) -> list[str]:
    out = []
    if layout.kind == "auto":  # checked once made concrete (resolve_auto), when the source is known
        if layout.parallel is not None and layout.parallel not in {p for ps in FAMILY_PARALLEL.values() for p in ps}:
            out.append(f"parallel: {layout.parallel!r} is not tp, fsdp_tp, ep or ep_tp")
        if layout.family is not None and layout.family not in FAMILY_PARALLEL:
            out.append(f"family: {layout.family!r} is not one of {', '.join(FAMILY_PARALLEL)}")
        return out
    if layout.kind not in ("plain", "dtensor", "flat"):
        out.append(f"kind: {layout.kind!r} is not plain, dtensor, flat or auto")
    dims = list(layout.mesh)
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims) or not dims:
        out.append(f"mesh: {dims} must be positive sizes with at most one -1")
    else:
        known = math.prod(d for d in dims if d != -1)
        if (world_size % known) if -1 in dims else (known != world_size):
            out.append(f"mesh: {dims} does not fit world size {world_size}")
    for i, rule in enumerate(layout.rules):
        try:
            re.compile(rule.pattern)
        except re.error as e:
            out.append(f"rules[{i}].pattern: bad regex {rule.pattern!r} ({e})")
        if len(rule.placements) != len(dims):
            out.append(f"rules[{i}].placements: {list(rule.placements)} needs one entry per mesh dim ({len(dims)})")
        bad = [p for p in rule.placements if not PLACEMENT.match(str(p))]
        if bad:
            out.append(f"rules[{i}].placements: {bad} are not R, E or S<dim>")
        if [str(p) for p in rule.placements].count("E") > 1:
            out.append(f"rules[{i}].placements: {list(rule.placements)}: experts (E) go over one mesh dim")
        if (getattr(rule, "parts", None) or "E" in [str(p) for p in rule.placements]) and layout.kind != "dtensor":
            out.append(f"rules[{i}]: parts and E need kind: dtensor")
        if getattr(rule, "parts", None) is not None and not list(rule.parts):
            out.append(f"rules[{i}].parts: empty; give the sizes of the fused tensors, or leave parts out")
    if layout.kind == "flat":
        if len(dims) != 1:
            out.append("mesh: flat layouts use a 1-D mesh")
        if layout.flat_units and len(layout.flat_units) != world_size:
            out.append(f"flat_units: {list(layout.flat_units)} needs one entry per rank ({world_size})")
        if any(u < 0 for u in layout.flat_units) or (layout.flat_units and sum(layout.flat_units) == 0):
            out.append(f"flat_units: {list(layout.flat_units)} must be non-negative with a positive sum")
    return out


# -- layout=auto: a family's rule table, recognised from config.json or the keys ----------------
FAMILY_OF_MODEL_TYPE = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2",
                     "granite", "internlm2", "yi", "deepseek", "smollm3", "ministral"), "llama"),
    **dict.fromkeys(("phi3", "phimoe_dense"), "phi3"),
    "gpt2": "gpt2",
    **dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe"), "moe"),
    # fused q/k/v that transformers gives no plan for; falcon and gpt_bigcode by their attention
    # (``family_of_config``)
    "bloom": "bloom", "persimmon": "bloom", "mpt": "mpt", "falcon": "falcon", "gpt_bigcode": "bigcode",
    **dict.fromkeys(("opt", "biogpt", "xglm"), "opt"), "stablelm": "llama",
}
FAMILY_PARALLEL = {"llama": ("tp", "fsdp_tp"), "phi3": ("tp", "fsdp_tp"), "gpt2": ("tp", "fsdp_tp"),
                   "titan": ("tp", "fsdp_tp"), "moe": ("ep", "ep_tp"), "bloom": ("tp", "fsdp_tp"),
                   "falcon_gqa": ("tp", "fsdp_tp"), "falcon_mq": ("tp", "fsdp_tp"), "mpt": ("tp", "fsdp_tp"),
                   "bigcode": ("tp", "fsdp_tp"), "bigcode_mq": ("tp", "fsdp_tp"), "opt": ("tp", "fsdp_tp")}
_KEY_SIGNS = (("moe", re.compile(r"\.experts\.(\d+\.)?(w[123]|gate_up_proj|gate_proj|down_proj)\b")),
              ("phi3", re.compile(r"\.qkv_proj\.weight$")), ("gpt2", re.compile(r"\.c_attn\.weight$")),
              ("titan", re.compile(r"(^|\.)(tok_embeddings|attention\.wq)\.weight$")),
              ("llama", re.compile(r"\.q_proj\.weight$")))


#: keys only a Megatron-Core checkpoint read under its own names has (no config.json given)
_MEGATRON_NAMES = ("decoder.layers.", "embedding.word_embeddings.")


def family_of_config(raw_config: Mapping[str, Any]) -> str | None:
    """The preset family of a ``config.json``'s ``model_type``, by its attention where one type
    stores q/k/v in several ways: Falcon's new decoder architecture fuses them per key/value group,
    its classic multi-head attention per head (as BLOOM), multi-query attention (Falcon-7B,
    StarCoder) as all query heads then one key and one value head. The flags are read with
    transformers' defaults (``save_pretrained`` leaves defaults out of ``config.json``)."""
    mt = raw_config.get("model_type")
    fam = FAMILY_OF_MODEL_TYPE.get(mt) if isinstance(mt, str) else None
    if fam == "falcon":
        if raw_config.get("new_decoder_architecture", False):
            return "falcon_gqa"
        return "falcon_mq" if raw_config.get("multi_query", True) else "bloom"
    if fam == "bigcode":
        return "bigcode_mq" if raw_config.get("multi_query", True) else "bigcode"
    return fam


def recognise_family(raw_config: Mapping[str, Any] | None, keys: Iterable[str]) -> tuple[str | None, str]:
    """(family, how it was recognised): config.json's ``model_type`` first, else the key names."""
    mt = (raw_config or {}).get("model_type")
    if mt in FAMILY_OF_MODEL_TYPE:
        return family_of_config(raw_config or {}), f"config.json model_type {mt!r}"
    keys = list(keys)
    for fam, sign in _KEY_SIGNS:
        hit = next((k for k in keys if sign.search(k)), None)
        if hit:
            why = f"key {hit!r}" + (f" (config.json model_type {mt!r} is not one we know)" if mt else "")
            return fam, why
    return None, f"config.json model_type {mt!r}" if mt else "no config.json and no key we know"


def resolve_auto(layout: Any, raw_config: Mapping[str, Any] | None, keys: Iterable[str] | Mapping[str, Any],
                 load_preset: Callable[[str], Any], make_layout: Callable[[dict], Any] | None = None,
                 ranks: int | None = None) -> tuple[Any, str, dict | None]:
    """``layout=auto`` made concrete. With a ``config.json`` whose family transformers gives a
    parallel plan: rules derived from that plan (``hf_plan``), planned for ``ranks``. Else the
    preset ``<family>_<parallel>`` (the family named by ``layout.family``, by ``model_type``, or,
    with no config.json at all, by the key names). A ``model_type`` with neither a plan nor a
    preset is refused by name: a guess from key names once replicated most of such a model.
    ``load_preset`` / ``make_layout``: the config's loaders (the config module imports this one,
    never the reverse). Returns the layout, one line saying what placed it, and the plan's report
    (None for a preset)."""
    mt = (raw_config or {}).get("model_type")
    plan_missing = None
    if not layout.family and isinstance(mt, str) and make_layout is not None:
        from .hf_plan import PlanUnavailable, plan_rules

        shapes = {k: tuple(getattr(v, "shape", ())) for k, v in keys.items()} if isinstance(keys, Mapping) else {}
        try:
            fields, note, report = plan_rules(raw_config, shapes, layout.parallel, list(layout.mesh), ranks or 1)
        except PlanUnavailable as e:
            plan_missing = str(e)
        else:
            if report["unmapped"] and layout.strict is not False:
                raise ConfigError(f"{note}; but {len(report['unmapped'])} weight(s) the plan splits cannot be placed "
                                  f"from this checkpoint's keys, e.g. {report['unmapped'][0]}; name a layout "
                                  f"(layout=<name> or layout.file=...), or set layout.strict=false to keep them whole")
            out = make_layout(fields)
            out.strict, out.config = layout.strict, layout.config
            return out, note, report
    if layout.family:
        fam, why = layout.family, "layout.family"
    elif isinstance(mt, str) and mt not in FAMILY_OF_MODEL_TYPE:
        raise ConfigError(f"layout=auto: the {mt!r} family (config.json model_type) has no parallel plan we can use "
                          f"({plan_missing or 'transformers was not consulted'}) and no preset of ours; name a layout "
                          f"(layout=<name>, layout.file=<your rules>, docs/write_a_layout.md), a family whose "
                          f"preset fits (layout.family=<{'|'.join(FAMILY_PARALLEL)}>), or layout=fsdp (every weight "
                          f"split along dim 0: no family needed)")
    else:
        keys = keys if isinstance(keys, Mapping) else list(keys)  # (read twice below)
        megatron = next((k for k in keys if k.startswith(_MEGATRON_NAMES)), None) if mt is None else None
        if megatron is not None:
            raise ConfigError(f"layout=auto: the checkpoint has Megatron-Core's own names (e.g. {megatron!r}: layers "
                              f"stacked, QKV fused), which no layout places; give the model's Hugging Face config.json "
                              f"(job.hf_files_from=<its directory> or layout.config=<file>) to read it under its "
                              f"family's names")
        fam, why = recognise_family(raw_config, keys)
    if fam is None:
        raise ConfigError(f"layout=auto: cannot tell the model family ({why}); name it with layout.family="
                          f"<{'|'.join(FAMILY_PARALLEL)}> or pick a layout (layout=<name>)")
    if fam not in FAMILY_PARALLEL:
        raise ConfigError(f"layout.family: {fam!r} is not one of {', '.join(FAMILY_PARALLEL)}")
    parallel = layout.parallel or FAMILY_PARALLEL[fam][0]
    if parallel not in FAMILY_PARALLEL[fam]:
        raise ConfigError(f"layout.parallel: {parallel!r} is not offered for the {fam} family "
                          f"(recognised from {why}); choose {' or '.join(FAMILY_PARALLEL[fam])}")
    name = f"{fam}_{parallel}"
    out = load_preset(name)
    if list(layout.mesh):
        out.mesh = list(layout.mesh)
    out.strict, out.config = layout.strict, layout.config
    note = f"layout=auto: the {fam} family (from {why}) -> {name}, mesh {list(out.mesh)}"
    if plan_missing and not layout.family:
        note += f" (no plan: {plan_missing})"
    return out, note, None


# -- model config values a rule may use -----------------------------------------------------------
def config_values(raw: Mapping[str, Any] | None) -> dict[str, int]:
    """The integers of a Hugging Face ``config.json`` a rule can name, plus the ones families
    leave implicit: ``head_dim`` (hidden / heads), ``num_key_value_heads`` (= heads, no GQA), and
    GPT-2's ``n_embd`` / ``n_head`` / ``n_inner``, MPT's ``d_model`` / ``n_heads`` and XGLM's
    ``attention_heads`` under the common names too."""
    if not raw:
        return {}
    text = raw.get("text_config")
    src = (dict(text) if isinstance(text, Mapping) else {}) | {k: v for k, v in raw.items() if k != "text_config"}
    # only sizes: a hostile or broken config (zero or negative heads, huge numbers) names nothing
    v = {k: x for k, x in src.items() if isinstance(x, int) and not isinstance(x, bool) and 0 < x < 1 << 40}
    for common, gpt2 in (("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
                         ("num_hidden_layers", "n_layer"), ("hidden_size", "d_model"),
                         ("num_attention_heads", "n_heads"), ("num_hidden_layers", "n_layers"),  # (MPT's)
                         ("num_attention_heads", "attention_heads"), ("num_hidden_layers", "num_layers")):  # (XGLM's)
        if common not in v and gpt2 in v:
            v[common] = v[gpt2]
    if "intermediate_size" not in v and "hidden_size" in v and src.get("model_type") == "gpt2":
        v["intermediate_size"] = v.get("n_inner") or 4 * v["hidden_size"]
    if "moe_intermediate_size" in v or "intermediate_size" in v:  # one expert's hidden width
        v.setdefault("moe_expert_size", v.get("moe_intermediate_size", v.get("intermediate_size")))
    if "num_attention_heads" in v:
        v.setdefault("num_key_value_heads", v["num_attention_heads"])
        if "hidden_size" in v:
            v.setdefault("head_dim", v["hidden_size"] // v["num_attention_heads"])
    return v


def read_model_config(path: str | None) -> tuple[dict | None, str | None]:
    """``config.json`` at ``path`` (a file, or a directory holding one; local or ``s3://``), or
    (None, None) when there is none."""
    if not path:
        return None, None
    from .dcp.tools import locate, parse_json, read_side_file

    loc = locate(path)
    if path.endswith(".json") or loc.is_file():
        where, name = loc.parent(), loc.name
    else:
        where, name = loc, "config.json"  # (a directory that is not there holds none: None below)
    f = f"{where.url.rstrip('/')}/{name}"

    try:
        data = read_side_file(where.url, name)
    except OSError as e:
        raise ConfigError(f"layout.config: cannot read {f}: {e.strerror or e}") from None
    raw = None if data is None else parse_json(data, f"layout.config: {f}", ConfigError)  # strict, depth-bounded
    if data is None:
        return None, None
    if not isinstance(raw, dict):
        raise ConfigError(f"layout.config: {f} is not a JSON object")
    return raw, f


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.FloorDiv: lambda a, b: a // b}


MAX_EXPRESSION_CHARS = 200
MAX_VALUE = 1 << 50  # no tensor dimension comes near it


def evaluate(expr: Any, values: Mapping[str, int], what: str) -> int:
    """An int, or an expression of config names, ints, + - * // (parsed, never executed), at most
    ``MAX_EXPRESSION_CHARS`` long and every value inside ``MAX_VALUE`` (a layout file is
    untrusted input: no unbounded parsing, recursion or big-number arithmetic)."""
    if isinstance(expr, int) and not isinstance(expr, bool):
        if abs(expr) > MAX_VALUE:
            raise ConfigError(f"{what}: {expr} is out of range (at most {MAX_VALUE})")
        return expr
    text = str(expr)
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ConfigError(f"{what}: an expression of {len(text)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ConfigError(f"{what}: {text!r} is not a number or an expression like "
                          f"num_key_value_heads*head_dim") from None

    def walk(n: ast.AST) -> int:
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.Name):
            if n.id not in values:
                have = "no config.json was found (set layout.config=<path to config.json>)" if not values else \
                    f"the model's config.json has no integer {n.id!r}"
                raise ConfigError(f"{what}: {text!r} needs {n.id!r}, but {have}")
            return values[n.id]
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            a, b = walk(n.left), walk(n.right)
            if isinstance(n.op, ast.FloorDiv) and b == 0:
                raise ConfigError(f"{what}: {text!r} divides by zero")
            out = _OPS[type(n.op)](a, b)
            if abs(out) > MAX_VALUE:
                raise ConfigError(f"{what}: {text!r} grows past {MAX_VALUE}")
            return out
        raise ConfigError(f"{what}: {text!r} may only use config names, integers and + - * //")

    return walk(tree)


class _Rule:
    """One compiled layout rule (sizes resolved lazily: only a rule that matches needs config)."""

    def __init__(self, i: int, conf: Any, layout_name: str) -> None:
        self.i, self.conf = i, conf
        self.regex = re.compile(conf.pattern)
        self.placements = [str(p) for p in conf.placements]
        self.per_expert = "E" in self.placements and "expert" in self.regex.groupindex
        self.parts = list(getattr(conf, "parts", None) or [])
        self.parts_dim = int(getattr(conf, "parts_dim", 0) or 0)
        self.unit = getattr(conf, "unit", None)
        self.replicate_few = bool(getattr(conf, "replicate_few", False))
        self.experts = getattr(conf, "experts", None)
        self.where = f"layout {layout_name!r} rules[{i}] (pattern {conf.pattern!r})"


class Placer:
    """Applies one layout on this rank. ``model_config``: the model's ``config.json`` (for rule
    sizes given as expressions); ``keys``: every tensor key, to count per-expert keys."""

    def __init__(self, layout: Any, rank: int, world_size: int, device: str = "cpu", *,
                 model_config: Mapping[str, Any] | None = None, keys: Iterable[str] | None = None) -> None:
        self.layout, self.rank, self.world_size, self.device = layout, rank, world_size, device
        self.shape = mesh_shape(layout, world_size)
        self._mesh = None
        self.values = config_values(model_config)
        self._rules = [_Rule(i, r, layout.name) for i, r in enumerate(layout.rules)]
        self._keys = list(keys) if keys is not None else None
        self._expert_counts: dict[int, int] = {}  # per rule, evaluated once:
        self._sizes: dict[int, list[int]] = {}
        self._units: dict[int, int] = {}
        self._match_cache: dict[str, int | None] = {}

    @property
    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh(self.device, torch.arange(self.world_size).reshape(self.shape))
        return self._mesh

    def rule_for(self, fqn: str) -> int | None:
        """Index of the first rule whose pattern matches ``fqn`` in full, or None."""
        if fqn not in self._match_cache:
            self._match_cache[fqn] = next((r.i for r in self._rules if r.regex.fullmatch(fqn)), None)
        return self._match_cache[fqn]

    def placements_for(self, fqn: str, ndim: int) -> list[str]:
        i = self.rule_for(fqn)
        if i is None:
            return ["R"] * len(self.shape)
        rule = self._rules[i]
        pl = rule.placements
        if ndim == 0:  # a scalar (e.g. an optimizer step under its parameter's rule) cannot be split
            return ["R" if p != "E" or not rule.per_expert else "E" for p in pl]
        bad = [p for p in pl if p not in ("R", "E") and _dim(p, ndim) is None]
        if bad:
            raise ConfigError(f"{rule.where} with placements {list(pl)} cannot apply to {fqn!r}: it has {ndim} "
                              f"dimension(s), so {bad[0]} does not exist; narrow the pattern or add an earlier rule "
                              f"for it")
        return list(pl)

    def unmatched(self, fqns: Any) -> list[str]:
        """The tensors no rule names (what ``layout.strict`` refuses)."""
        return [f for f in fqns if self.rule_for(f) is None]

    def partly_split(self, shapes: Mapping[str, Any]) -> dict[str, tuple[list[str], list[str]]]:
        """Blocks whose weight matrices a layout splits only in part: ``{block: (split, left)}``,
        where ``split`` are the block's weights a rule of their own places differently from the
        default (the catch-all's placement, or replication) and ``left`` those the default takes.
        A tensor-parallel forward cannot run such a block (DeepSeek-V2's ``q_a_proj`` replicated
        while its ``o_proj`` is split by rows): the data round-trips, the placement is not usable.
        A block is a weight's key less its last two parts (``...layers.0.self_attn``)."""
        default_i = next((r.i for r in self._rules if r.conf.pattern in CATCH_ALL), None)
        default = self._rules[default_i].placements if default_i is not None else ["R"] * len(self.shape)
        blocks: dict[str, tuple[list[str], list[str]]] = {}
        for fqn, shape in shapes.items():
            parts = fqn.split(".")
            if len(shape) < 2 or parts[-1] != "weight" or len(parts) < 3:
                continue
            i = self.rule_for(fqn)
            specific = i is not None and i != default_i
            split, left = blocks.setdefault(".".join(parts[:-2]), ([], []))
            if specific and self._rules[i].placements != default:
                split.append(fqn)
            elif not specific:
                left.append(fqn)
        return {b: (s, sorted(l)) for b, (s, l) in sorted(blocks.items()) if s and l}

    def clashing_rules(self, fqn: str) -> tuple[int, int] | None:
        """(first, other) when a later rule also matches ``fqn`` and would place it differently
        (what ``layout.strict`` refuses: the order of the rules decides it silently). A later
        catch-all (``.*``) is the default for the rest, not a rival."""
        i = self.rule_for(fqn)
        if i is None:
            return None
        mine = self._rules[i]
        for r in self._rules[i + 1:]:
            if r.conf.pattern in CATCH_ALL:  # "everything else": a default, not a rival
                continue
            if r.regex.fullmatch(fqn) and (r.placements, r.parts, r.parts_dim, r.unit) != \
                    (mine.placements, mine.parts, mine.parts_dim, mine.unit):
                return i, r.i
        return None

    def describe_rule(self, fqn: str) -> dict:
        """What a rule adds to its placements for ``fqn`` (fused parts, experts), for inspect."""
        i = self.rule_for(fqn)
        if i is None:
            return {}
        r, out = self._rules[i], {}
        if r.parts:
            out["parts"] = self._part_sizes(r)
            out["parts_dim"] = r.parts_dim
        if r.unit is not None:
            out["unit"] = self._unit(r)
        if r.replicate_few:
            out["replicate_few"] = True
        if r.per_expert:
            out["expert"] = int(r.regex.fullmatch(fqn).group("expert"))
        return out

    # -- geometry -------------------------------------------------------------------------------
    def holds(self, fqn: str, rank: int | None = None) -> bool:
        """False when ``rank`` (default this one) holds nothing of ``fqn``: a per-expert key
        whose expert another expert-parallel group owns."""
        return self._owner_ok(fqn, self.rank if rank is None else rank)

    def _owner_ok(self, fqn: str, rank: int) -> bool:
        if self.layout.kind != "dtensor":
            return True
        i = self.rule_for(fqn)
        if i is None or not self._rules[i].per_expert:
            return True
        rule = self._rules[i]
        expert = int(rule.regex.fullmatch(fqn).group("expert"))
        count = self._expert_count(rule)
        coord = self.coordinate(rank)
        for mesh_dim, p in enumerate(rule.placements):
            if p != "E":
                continue
            n = self.shape[mesh_dim]
            if count % n:
                raise ConfigError(f"{rule.where}: {count} experts do not divide by the expert-parallel size {n} "
                                  f"(mesh dim {mesh_dim} of {list(self.shape)}), so {fqn!r} has no whole-expert owner")
            if expert >= count:
                raise ConfigError(f"{rule.where}: {fqn!r} is expert {expert}, but the rule counts {count} experts")
            if expert // (count // n) != coord[mesh_dim]:
                return False
        return True

    def _part_sizes(self, rule: _Rule) -> list[int]:
        """A rule's part sizes, evaluated once (they do not depend on the tensor)."""
        if rule.i not in self._sizes:
            self._sizes[rule.i] = [evaluate(p, self.values, f"{rule.where}: parts") for p in rule.parts]
        return self._sizes[rule.i]

    def _unit(self, rule: _Rule) -> int:
        if rule.i not in self._units:
            self._units[rule.i] = evaluate(rule.unit, self.values, f"{rule.where}: unit")
        return self._units[rule.i]

    def _expert_count(self, rule: _Rule) -> int:
        if rule.i not in self._expert_counts:
            if rule.experts is not None:
                n = evaluate(rule.experts, self.values, f"{rule.where}: experts")
            elif self._keys is not None:
                found = {m.group("expert") for m in map(rule.regex.fullmatch, self._keys) if m}
                n = len(found)
            else:
                raise ConfigError(f"{rule.where}: per-expert keys need the expert count: add experts: <number or "
                                  f"config name, e.g. num_local_experts>")
            self._expert_counts[rule.i] = n
        return self._expert_counts[rule.i]

    def local_numel(self, fqn: str, shape: tuple[int, ...]) -> int:
        """Elements :meth:`empty` allocates on this rank for a tensor of ``shape`` (no allocation)."""
        shape = tuple(int(d) for d in shape)
        if self.layout.kind == "plain" or not shape:
            return math.prod(shape)
        if self.layout.kind == "flat":
            a, b = self._flat_cuts(math.prod(shape), self.rank)
            return b - a
        return sum(b.numel for b in self.boxes(fqn, shape, self.rank))

    def empty(self, fqn: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        """An uninitialised load target for a tensor of ``shape``: this rank's own shard only
        (never the full tensor), as a DTensor / FlatShard / FusedShard / plain tensor per the
        layout; None when this rank holds none of it (another group's expert)."""
        shape = tuple(int(d) for d in shape)
        if self.layout.kind == "plain" or not shape:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if self.layout.kind == "flat":
            a, b = self._flat_cuts(math.prod(shape), self.rank)
            return FlatShard(torch.empty(b - a, dtype=dtype, device=self.device), shape, a)
        return self._wrap(fqn, shape, lambda box: torch.empty(box.sizes, dtype=dtype, device=self.device))

    def _wrap(self, fqn: str, shape: tuple[int, ...], local_of: Any) -> Any:
        """This rank's shard of ``fqn`` with its data from ``local_of(box)``, in the form the
        rule needs: a DTensor when one placement per mesh dim describes it, else explicit."""
        if not self._owner_ok(fqn, self.rank):
            return None
        boxes = self.boxes(fqn, shape, self.rank)
        i = self.rule_for(fqn)
        rule = self._rules[i] if i is not None else None
        if rule is not None and rule.parts:  # one box per part (boxes checked parts_dim)
            local = torch.cat([local_of(b) for b in boxes], dim=rule.parts_dim)
            return FusedShard(local, shape, boxes, rule.parts_dim)
        (box,) = boxes
        if rule is not None and rule.per_expert:  # held by this expert group only: no mesh to name
            return LocalShard(local_of(box), box.offsets, shape)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        placements = [Replicate() if p == "R" else Shard(0 if p == "E" else _dim(p, len(shape)))
                      for p in self.placements_for(fqn, len(shape))]
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local_of(box), self.mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=stride)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of ``rank`` (row-major over the mesh shape), no mesh needed."""
        coord = []
        for size in reversed(self.shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def boxes(self, fqn: str, shape: tuple[int, ...], rank: int) -> list[Box]:
        """The boxes of a tensor of ``shape`` that ``rank`` holds under this layout (pure: the
        same geometry ``place`` uses, for offline imports that write rank files directly); a
        fused tensor gives one box per part, another group's expert none."""
        shape = tuple(int(d) for d in shape)
        if self.layout.kind == "plain" or not shape:
            return [whole(shape)]
        if self.layout.kind == "flat":
            a, b = self._flat_cuts(math.prod(shape), rank)
            return decompose_flat_interval(shape, a, b)
        if not self._owner_ok(fqn, rank):
            return []
        i = self.rule_for(fqn)
        rule = self._rules[i] if i is not None else None
        placements = self.placements_for(fqn, len(shape))
        coord = self.coordinate(rank)
        if rule is None or not rule.parts:  # a unit without parts counts on parts_dim (whole heads)
            return [self._box(rule, fqn, shape, placements, coord, self._unit_dim(rule, fqn, shape, placements), 0)]
        d = rule.parts_dim + len(shape) if rule.parts_dim < 0 else rule.parts_dim
        if not 0 <= d < len(shape):
            raise ConfigError(f"{rule.where}: parts_dim {rule.parts_dim} does not exist in {fqn!r} "
                              f"({len(shape)} dimension(s))")
        sizes = self._part_sizes(rule)
        if sum(sizes) != shape[d] or any(n < 0 for n in sizes):
            raise ConfigError(f"{rule.where}: parts {sizes} add up to {sum(sizes)}, but {fqn!r} has {shape[d]} "
                              f"along dim {d} (shape {list(shape)})")
        out, start = [], 0
        for k, n in enumerate(sizes):
            part = shape[:d] + (n,) + shape[d + 1:]
            b = self._box(rule, fqn, part, placements, coord, d, k)
            out.append(Box(b.offsets[:d] + (b.offsets[d] + start,) + b.offsets[d + 1:], b.sizes))
            start += n
        return out

    @staticmethod
    def _unit_dim(rule: _Rule | None, fqn: str, shape: tuple[int, ...], placements: list[str]) -> int | None:
        """The dim a rule's ``unit`` counts on (``parts_dim``), checked to be one the placements
        split: a unit is honoured or refused, never ignored."""
        if rule is None or rule.unit is None:
            return None
        d = rule.parts_dim + len(shape) if rule.parts_dim < 0 else rule.parts_dim
        split = {_dim(p, len(shape)) for p in placements if p not in ("R", "E")}
        if not 0 <= d < len(shape) or (split and d not in split):
            raise ConfigError(f"{rule.where}: unit {rule.conf.unit!r} counts along parts_dim {rule.parts_dim}, but its "
                              f"placements {list(placements)} split {fqn!r} (shape {list(shape)}) along dim(s) "
                              f"{sorted(x for x in split if x is not None)}; set parts_dim to the split dim")
        return d

    def _box(self, rule: _Rule | None, fqn: str, shape: tuple[int, ...], placements: list[str],
             coord: tuple[int, ...], parts_dim: int | None, part: int) -> Box:
        """One tensor's (or one part's) box: the mesh dims split it in order, DTensor's way."""
        offs, sizes = [0] * len(shape), list(shape)
        for mesh_dim, p in enumerate(placements):
            if p == "R" or (p == "E" and rule is not None and rule.per_expert):
                continue
            n, c = self.shape[mesh_dim], coord[mesh_dim]
            d = 0 if p == "E" else _dim(p, len(shape))
            unit = 1
            if p == "E" and sizes[0] % n:
                raise ConfigError(f"{rule.where}: {fqn!r} stacks {sizes[0]} experts, which do not divide by the "
                                  f"expert-parallel size {n} (mesh dim {mesh_dim} of {list(self.shape)})")
            if d == parts_dim and rule.unit is not None:
                unit = self._unit(rule)
                few = sizes[d] // unit if unit > 0 and not sizes[d] % unit else 0
                if rule.replicate_few and 0 < few < n and not n % few:  # key/value heads fewer than the ranks
                    offs[d] += c * few // n * unit
                    sizes[d] = unit
                    continue
                if unit <= 0 or sizes[d] % unit or (sizes[d] // unit) % n:
                    raise ConfigError(
                        f"{rule.where}: part {part} of {fqn!r} is {sizes[d]} wide, {sizes[d] / unit:g} units of "
                        f"{unit} (heads), which do not divide by {n} ranks (mesh dim {mesh_dim} of "
                        f"{list(self.shape)})")
            start, size = split_piece(sizes[d] // unit, n, c)
            offs[d] += start * unit
            sizes[d] = size * unit
        return Box(tuple(offs), tuple(sizes))

    def place(self, fqn: str, full: torch.Tensor) -> Any:
        """This rank's shard of a full tensor (None: another expert group's expert)."""
        full = full.to(self.device)
        if self.layout.kind == "plain" or full.dim() == 0:
            return full.clone()
        if self.layout.kind == "flat":
            return self._flat(full)
        return self._wrap(fqn, tuple(full.shape), lambda box: narrow(full, box.offsets, box.sizes).clone())

    def _flat_cuts(self, n: int, rank: int) -> tuple[int, int]:
        units = list(self.layout.flat_units) or [1] * self.world_size
        total = sum(units)
        return n * sum(units[:rank]) // total, n * sum(units[: rank + 1]) // total

    def _flat(self, full: torch.Tensor) -> FlatShard:
        a, b = self._flat_cuts(full.numel(), self.rank)
        return FlatShard(full.reshape(-1)[a:b].clone(), full.shape, a)


def _dim(p: str, ndim: int) -> int | None:
    d = int(p[1:])
    d = d + ndim if d < 0 else d
    return d if 0 <= d < ndim else None


def place_state(full_sd: Any, placer: Placer, prefix: str = "") -> Any:
    """Place every tensor leaf of a nested reference state dict; other leaves are copied. A
    tensor this rank holds none of (another expert group's expert) is left out of the dict."""
    if isinstance(full_sd, dict):
        out = {k: place_state(v, placer, f"{prefix}{k}.") for k, v in full_sd.items()}
        return {k: v for k, v in out.items() if v is not None or not isinstance(full_sd[k], torch.Tensor)}
    if isinstance(full_sd, list):
        return [place_state(v, placer, f"{prefix}{i}.") for i, v in enumerate(full_sd)]
    if isinstance(full_sd, torch.Tensor):
        return placer.place(prefix[:-1], full_sd)
    return full_sd
