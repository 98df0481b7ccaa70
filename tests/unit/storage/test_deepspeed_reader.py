"""DeepSpeed ZeRO checkpoints read in place (hpdcp_runner/dcp/storage/formats/deepspeed.py), on files
DeepSpeed 0.19.8 wrote (tests/fixtures/deepspeed, by scripts/write_deepspeed_fixtures.py): the
weights bitwise equal to DeepSpeed's own zero_to_fp32, the Adam moments to its ds_to_universal,
partial reads of the slices a rank keeps, and hostile files refused in one line naming the file."""

from __future__ import annotations

import os
import shutil
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from hpdcp_runner.dcp import load, open_reader
from hpdcp_runner.dcp.core.errors import (CheckpointNotFoundError, CorruptCheckpointError, HpdcpError,
                                          MetadataError, PickleNotAllowedError)
from hpdcp_runner.dcp.format.metadata import Metadata, dtype_from_name
from hpdcp_runner.dcp.storage.formats.foreign import detect_format

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "deepspeed")
CONFIGS = ["zero1_bf16", "zero2_fp32", "zero3_bf16"]


def _metadata(path, **kw):
    r = open_reader(path, **kw)
    try:
        return Metadata.from_json(r.read_metadata_text())
    finally:
        r.close()


def _read_all(path, **kw):
    md = _metadata(path, **kw)
    state = {k: torch.empty(t.shape, dtype=dtype_from_name(t.dtype)) for k, t in md.tensors.items()}
    state.update({k: None for k in md.objects})
    load(state, storage_reader=open_reader(path, "deepspeed", **kw))
    return md, state


@pytest.mark.parametrize("config", CONFIGS)
def test_weights_equal_zero_to_fp32_and_moments_equal_ds_to_universal(config):
    run = os.path.join(FIXTURES, config)
    assert detect_format(run) == "deepspeed" and detect_format(os.path.join(run, "global_step2")) == "deepspeed"
    md, state = _read_all(run)  # the run directory: its `latest` names global_step2
    info = md.extra["deepspeed"]
    assert info["zero_stage"] == int(config[4]) and info["world_size"] == 2
    ref = load_file(os.path.join(run, "reference", "zero_to_fp32.safetensors"))
    assert set(ref) == {k for k in md.tensors if not k.startswith("optim.")}
    for k, v in ref.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    uni = load_file(os.path.join(run, "reference", "universal.safetensors"))
    assert len(uni) == 2 * len(ref)
    for k, v in uni.items():  # ds_to_universal keeps ZeRO-3 moments flat
        name, moment = k.rsplit(".", 1)
        got = state[f"optim.state.{name}.{moment}"]
        assert got.shape == ref[name].shape and torch.equal(got.flatten(), v.flatten()), k
    assert {state[f"optim.state.{name}.step"] for name in ref} == {2.0}


@pytest.mark.parametrize("config", ["zero1_bf16", "zero2_fp32"])
def test_module_weights_are_the_modules_own(config):
    step = os.path.join(FIXTURES, config, "global_step2")
    module = torch.load(os.path.join(step, "mp_rank_00_model_states.pt"), weights_only=True)["module"]
    md, state = _read_all(step, weights="module")
    assert {k for k in md.tensors if not k.startswith("optim.")} == set(module)
    for k, v in module.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k


def test_zero3_keeps_no_module_weights():
    with pytest.raises(HpdcpError, match="ZeRO-3 checkpoint keeps no module weights.*weights=fp32"):
        _metadata(os.path.join(FIXTURES, "zero3_bf16"), weights="module")


def test_a_slice_reads_only_its_bytes():
    """A region of a ZeRO-3 parameter (split between the two rank files inside a row) is read
    from the bytes of that region alone."""
    run = os.path.join(FIXTURES, "zero3_bf16")
    ref = load_file(os.path.join(run, "reference", "zero_to_fp32.safetensors"))["model.embed_tokens.weight"]
    rows = ref.shape[0]
    part = torch.empty(3, ref.shape[1])
    from hpdcp_runner.dcp.offline.sources import ReaderSource
    from hpdcp_runner.dcp.core.geometry import Box

    src = ReaderSource(run, "deepspeed")
    try:
        mid = rows // 2 - 1  # rows straddling the two ranks' pieces
        before = src.reader.counters.bytes_read
        part = src.read("model.embed_tokens.weight", Box((mid, 0), (3, ref.shape[1])))
        assert torch.equal(part, ref[mid:mid + 3])
        assert src.reader.counters.bytes_read - before == part.numel() * 4
    finally:
        src.close()


def _copy(tmp_path, config="zero2_fp32"):
    dst = tmp_path / config
    shutil.copytree(os.path.join(FIXTURES, config), dst)
    return dst


def test_a_truncated_rank_file_is_named(tmp_path):
    run = _copy(tmp_path)
    f = run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:5000])
    with pytest.raises(CorruptCheckpointError, match=f"{f}: not a readable torch.save archive"):
        _metadata(str(run))


def test_a_missing_rank_file_is_named(tmp_path):
    run = _copy(tmp_path, "zero3_bf16")
    (run / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(HpdcpError, match=r"rank\(s\) \[1\] are missing|too short|too few"):
        _metadata(str(run))


class Planted:
    """A class a hostile checkpoint names: unpickling it must never run its code."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/hpdcp-deepspeed-planted",))


def test_a_pickle_with_another_class_is_refused_and_never_run(tmp_path):
    run = _copy(tmp_path)
    f = run / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"x": Planted()}}, f)
    if os.path.exists("/tmp/hpdcp-deepspeed-planted"):
        os.unlink("/tmp/hpdcp-deepspeed-planted")
    with pytest.raises(PickleNotAllowedError, match=f"{f}: holds an object of class posix.system"):
        _metadata(str(run))
    assert not os.path.exists("/tmp/hpdcp-deepspeed-planted")


def test_latest_naming_a_path_outside_the_run_is_refused(tmp_path):
    run = _copy(tmp_path)
    (run / "latest").write_text("../../etc")
    with pytest.raises(HpdcpError, match="latest: names '../../etc', not a step directory"):
        _metadata(str(run))
    (run / "latest").write_text("global_step9")
    with pytest.raises(CheckpointNotFoundError, match="names 'global_step9'"):
        _metadata(str(run))


def test_the_archive_structure_is_checked(tmp_path):
    """A flipped length in the zip structure fails on the structure, never shifts a read."""
    run = _copy(tmp_path)
    f = run / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(f) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(f.read_bytes())
    raw[info.header_offset + 28] ^= 0x10  # the local header's extra-field length
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=str(f)):
        _metadata(str(run))


def test_a_training_script_resumes_from_a_deepspeed_checkpoint():
    """The library API: a plain torch model and Adam (no DeepSpeed) take the checkpoint's fp32
    weights, moments and step (DeepSpeed keeps one step per group, as a number: it loads into
    torch's one-element step tensor), then train on."""
    transformers = pytest.importorskip("transformers")
    from hpdcp_runner import dcp

    run = os.path.join(FIXTURES, "zero3_bf16")
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(os.path.join(run, "reference")))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model.state_dict(), "optim": dcp.get_optim_state_dict(model, opt)}
    res = load(state, storage_reader=open_reader(run), strict=False,
               rename=[{"pattern": r"^(?!optim\.)", "replace": "model."}])
    assert list(res.missing_keys) == ["optim.param_groups"] and not res.unexpected_keys  # the script's own lr stays
    dcp.set_optim_state_dict(model, opt, state["optim"])
    weights = load_file(os.path.join(run, "reference", "zero_to_fp32.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    uni = load_file(os.path.join(run, "reference", "universal.safetensors"))
    names = dict(model.named_parameters())
    for k, p in names.items():
        s = opt.state[p]
        assert float(s["step"]) == 2.0 and torch.equal(s["exp_avg"].flatten(), uni[f"{k}.exp_avg"].flatten()), k
    ids = torch.arange(12).reshape(2, 6) % 67
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert float(opt.state[names["lm_head.weight"]]["step"]) == 3.0


def test_a_non_number_never_loads_into_a_step_tensor(tmp_path):
    """Only a number (or a one-element tensor) saved as an object loads into a one-element
    tensor of the target; anything else is refused naming the key."""
    from hpdcp_runner.dcp import save

    save({"step": "two", "n": 3}, checkpoint_id=str(tmp_path / "c"))
    got = {"step": torch.zeros(()), "n": torch.zeros((), dtype=torch.int64)}
    with pytest.raises(HpdcpError, match="key 'step': the checkpoint holds str 'two'"):
        load(got, checkpoint_id=str(tmp_path / "c"))
    got = {"n": torch.zeros((), dtype=torch.int64)}
    load(got, checkpoint_id=str(tmp_path / "c"), strict=False)
    assert got["n"].item() == 3


# -- universal checkpoints (ds_to_universal's output: zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt) ---------

@pytest.mark.parametrize("config", ["zero2_fp32", "zero3_bf16"])
def test_a_universal_checkpoint_reads_as_zero_to_fp32_and_ds_to_universal(config, tmp_path):
    """The universal checkpoint ds_to_universal 0.19.8 made of the fixture (``_universal``): every
    parameter's fp32 weight bitwise equal to zero_to_fp32's (ZeRO 3 keeps it flat: the model
    states give its shape), its moments to the references, its step; found through the run
    directory when ``latest_universal`` is its only tracker."""
    uni = os.path.join(FIXTURES, config, "_universal")
    assert detect_format(uni) == "deepspeed"
    md, state = _read_all(uni)
    assert md.extra["deepspeed"]["universal"] is True
    for k, v in load_file(os.path.join(FIXTURES, config, "reference", "zero_to_fp32.safetensors")).items():
        assert state[k].shape == v.shape and torch.equal(state[k], v), k
    for k, v in load_file(os.path.join(FIXTURES, config, "reference", "universal.safetensors")).items():
        name, moment = k.rsplit(".", 1)
        assert torch.equal(state[f"optim.state.{name}.{moment}"].flatten(), v.flatten()), k
    if config == "zero2_fp32":  # (ZeRO 3's universal checkpoint has no step.pt)
        assert state["optim.state.model.norm.weight.step"] == 2.0
    run = tmp_path / "run"  # a run directory whose only tracker names the universal checkpoint
    shutil.copytree(uni, run / "_universal")
    (run / "latest_universal").write_text("_universal")
    assert detect_format(str(run)) == "deepspeed"
    assert _metadata(str(run)).tensors.keys() == md.tensors.keys()


def test_a_universal_checkpoint_reads_only_the_files_of_what_is_loaded():
    """One parameter's weight is one file's bytes: loading it reads those bytes and nothing else."""
    uni = os.path.join(FIXTURES, "zero2_fp32", "_universal")
    r = open_reader(uni)
    md = Metadata.from_json(r.read_metadata_text())
    key = "model.layers.1.mlp.up_proj.weight"
    assert [c.file for c in md.tensors[key].chunks] == [f"zero/{key}/fp32.pt"]
    state = {key: torch.empty(md.tensors[key].shape)}
    before = r.counters.bytes_read
    load(state, storage_reader=r, strict=False)
    assert r.counters.bytes_read - before == state[key].numel() * 4


def test_a_link_or_a_missing_file_inside_a_universal_checkpoint_is_named(tmp_path):
    """Each directory of zero/ is opened inside the checkpoint without following a link: a
    parameter's directory replaced by a link (to a copy outside) is refused, never read."""
    uni = tmp_path / "uni"
    shutil.copytree(os.path.join(FIXTURES, "zero2_fp32", "_universal"), uni)
    victim = uni / "zero" / "model.norm.weight"
    outside = tmp_path / "outside"
    shutil.move(str(victim), outside)
    os.symlink(outside, victim)
    with pytest.raises(CorruptCheckpointError, match=f"{victim} is a link or not a directory"):
        _read_all(str(uni))
    os.unlink(victim)
    shutil.copytree(outside, victim)
    (victim / "fp32.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"{victim / 'fp32.pt'}"):
        _read_all(str(uni))
    shutil.rmtree(uni / "zero")  # model states and nothing else: neither a ZeRO step nor universal
    with pytest.raises(CheckpointNotFoundError, match="no optimizer states .* and no zero/<param>/"):
        _metadata(str(uni))


# -- tensor parallelism (AutoTP training): a set of files per model-parallel rank -------------------

TP_CONFIGS = ["zero1_bf16_tp2", "zero2_fp32_tp2_dp2"]


@pytest.mark.parametrize("config", TP_CONFIGS)
def test_tensor_parallel_slices_join_into_what_ds_to_universal_merges(config):
    """Each parameter whole, bitwise ds_to_universal's merge of the model-parallel slices (fp32
    weights and moments), from the files of both model-parallel ranks (and their data-parallel
    partitions beside them)."""
    run = os.path.join(FIXTURES, config)
    assert detect_format(run) == "deepspeed"
    md, state = _read_all(run)
    assert md.extra["deepspeed"]["model_parallel"] == 2
    ref = load_file(os.path.join(run, "reference", "universal_fp32.safetensors"))
    assert set(ref) == {k for k in md.tensors if not k.startswith("optim.")}
    for k, v in ref.items():
        assert torch.equal(state[k], v), k
    for k, v in load_file(os.path.join(run, "reference", "universal.safetensors")).items():
        name, moment = k.rsplit(".", 1)
        assert torch.equal(state[f"optim.state.{name}.{moment}"], v), k
    # a column-parallel weight's rows come from the rank that held them; a replicated one from one rank
    q = md.tensors["model.layers.1.self_attn.q_proj.weight"]
    assert {c.file.split("_mp_rank_")[1][:2] for c in q.chunks} == {"00", "01"}
    assert all((c.offsets[0] >= 12) == ("_mp_rank_01_" in c.file) for c in q.chunks), q.chunks
    norm = md.tensors["model.norm.weight"]
    assert {c.file.split("_mp_rank_")[1][:2] for c in norm.chunks} == {"00"}


def test_tensor_parallel_without_an_affine_map_by_its_patterns():
    """Older DeepSpeed (and Megatron-DeepSpeed) record only the patterns: replicated, cut by
    columns (row parallelism), the vocabulary; every other parameter cut by rows. The same
    checkpoint described by them alone reads the same."""
    from hpdcp_runner.dcp.storage.formats.deepspeed import DeepSpeedReader
    from hpdcp_runner.dcp.storage.formats.deepspeed_tp import join_model_parallel

    run = os.path.join(FIXTURES, "zero1_bf16_tp2", "global_step2")
    r = DeepSpeedReader(run)
    parts = [r._describe_mp(mp) for mp in (0, 1)]
    info = dict(parts[0][1].tree["universal_checkpoint_info"])
    by_affine = join_model_parallel([p[0] for p in parts], parts[0][1], run)
    info.pop("affine_map")

    class Model:
        tree = {"universal_checkpoint_info": info, "param_shapes": parts[0][1].tree["param_shapes"]}
        where = "model states"

    by_patterns = join_model_parallel([p[0] for p in parts], Model(), run)
    assert by_patterns.tensors.keys() == by_affine.tensors.keys()
    for k, t in by_affine.tensors.items():
        a = sorted((c.offsets, c.sizes, c.file, c.byte_offset) for c in t.chunks)
        b = sorted((c.offsets, c.sizes, c.file, c.byte_offset) for c in by_patterns.tensors[k].chunks)
        assert t.shape == by_patterns.tensors[k].shape and a == b, k
    Model.tree = {}
    with pytest.raises(HpdcpError, match="model states: a checkpoint of 2 model-parallel ranks that records no "
                                         "universal_checkpoint_info"):
        join_model_parallel([p[0] for p in parts], Model(), run)


def test_a_missing_model_parallel_rank_is_named(tmp_path):
    """Every file of model-parallel rank 1 gone: the model states of rank 0 say there were 2 (its
    slices are never read as the whole model)."""
    run = _copy(tmp_path, "zero1_bf16_tp2")
    for f in (run / "global_step2").iterdir():
        if "mp_rank_01" in f.name:
            f.unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"model-parallel rank\(s\) \[1\] are missing"):
        _metadata(str(run))


def test_a_universal_checkpoint_of_a_tensor_parallel_run_reads_as_the_run():
    """ds_to_universal's output of the AutoTP fixture: whole tensors beside model states that give
    model-parallel rank 0's slice shapes; every parameter, moment and step reads bitwise as the
    step directory it was made of does."""
    run = os.path.join(FIXTURES, "zero1_bf16_tp2")
    _, step = _read_all(run)
    md, universal = _read_all(os.path.join(run, "_universal"))
    assert md.extra["deepspeed"]["universal"] is True and universal.keys() == step.keys()
    assert md.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (24, 24)
    for k, v in step.items():
        assert torch.equal(universal[k], v) if isinstance(v, torch.Tensor) else universal[k] == v, k


def test_a_universal_tensor_is_checked_against_its_zip_crc(tmp_path):
    """Each universal tensor fills its archive's storage: read whole, it is checked against the
    CRC-32 torch.save recorded, and a flipped byte is named (DeepSpeed records no other checksum)."""
    uni = tmp_path / "u"
    shutil.copytree(os.path.join(FIXTURES, "zero2_fp32", "_universal"), uni)
    r = open_reader(str(uni))
    md = Metadata.from_json(r.read_metadata_text())
    c = md.tensors["model.norm.weight"].chunks[0]
    assert c.checksum.startswith("crc32:")
    state = {"model.norm.weight": torch.empty(md.tensors["model.norm.weight"].shape)}
    load(state, storage_reader=r, strict=False)
    assert r.counters.chunks_verified == 1
    f = uni / c.file
    raw = bytearray(f.read_bytes())
    raw[c.byte_offset] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=f"{f}: the record of 'model.norm.weight' .* fails its zip CRC-32"):
        load(state, storage_reader=open_reader(str(uni)), strict=False)


# -- pipeline parallelism (deepspeed.pipe.PipelineModule): a set of files per stage, layer files -----

PIPE_CONFIGS = ["pipe_zero1_bf16_pp2_dp2", "pipe_zero1_fp32_pp2"]


@pytest.mark.parametrize("config", PIPE_CONFIGS)
def test_pipeline_stages_read_as_one_model_equal_to_ds_to_universal(config):
    """Both stages' parameters under the PipelineModule's names (layer index first; the embedding
    tied to the output head as ``tied_modules.embed``), fp32 weights and moments bitwise what
    ds_to_universal merged, each from the stage (and data-parallel partition) that holds it."""
    run = os.path.join(FIXTURES, config)
    assert detect_format(run) == "deepspeed"
    md, state = _read_all(run)
    info = md.extra["deepspeed"]
    assert info["pipeline_stages"] == 2 and info["zero_stage"] == 1
    ref = load_file(os.path.join(run, "reference", "universal.safetensors"))
    weights = {k for k in ref if not k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert weights == {k for k in md.tensors if not k.startswith("optim.")}
    assert {"tied_modules.embed.tok.weight", "1.up.weight", "4.down.bias", "5.weight"} <= weights
    for k, v in ref.items():
        key = k if k in weights else "optim.state.{}.{}".format(*k.rsplit(".", 1))
        assert state[key].dtype == v.dtype and torch.equal(state[key], v), k
    assert {state[f"optim.state.{name}.step"] for name in weights} == {2.0}
    stage = {k: {c.file.split("_mp_rank_")[1][:2] for c in t.chunks} for k, t in md.tensors.items()}
    assert stage["1.up.weight"] == {"00"} and stage["4.up.weight"] == {"01"} and stage["5.weight"] == {"01"}
    assert stage["tied_modules.embed.tok.weight"] == {"00"}  # the first stage's copy of the tied layer


def test_bf16_without_zero_in_the_pipeline_engine_reads_as_the_engine_held():
    """BF16_Optimizer (bf16 without ZeRO: ZeRO-1's flat partitions, but no param_shapes): the
    parameters named by each rank's param_slice_mappings, shaped by the layer files; every fp32
    weight and moment bitwise what the engine held (DeepSpeed's safe_get_full_* across the
    data-parallel ranks; ds_to_universal does not read these files)."""
    run = os.path.join(FIXTURES, "pipe_zero0_bf16_pp2_dp2")
    md, state = _read_all(run)
    assert md.extra["deepspeed"]["zero_stage"] == 0 and md.extra["deepspeed"]["pipeline_stages"] == 2
    held = {}
    for s in (0, 1):
        held.update(load_file(os.path.join(run, "reference", f"live_stage{s}.safetensors")))
    weights = {k for k in held if not k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert weights == {k for k in md.tensors if not k.startswith("optim.")} and len(weights) == 27
    for k, v in held.items():
        key = k if k in weights else "optim.state.{}.{}".format(*k.rsplit(".", 1))
        assert torch.equal(state[key], v), k
    assert {state[f"optim.state.{k}.step"] for k in weights} == {2.0}
    cut = [k for k, t in md.tensors.items() if {c.file[:16] for c in t.chunks} == {"bf16_zero_pp_ran"} and
           len({c.file for c in t.chunks}) == 2]
    assert cut, "no parameter straddles the two data-parallel partitions"
    _, module = _read_all(run, weights="module")
    for s in (0, 1):
        for k, v in load_file(os.path.join(run, "reference", f"stage{s}.safetensors")).items():
            assert torch.equal(module[k], v), k


def test_a_tied_layer_is_the_same_on_every_stage_that_holds_it():
    """Why the first stage's copy stands for the tied layer: DeepSpeed sums its gradients across
    the stages holding it, so the last stage's fp32 master and moments (its own files) are the
    same values as the first stage's."""
    from hpdcp_runner.dcp.storage.formats.deepspeed import DeepSpeedReader

    run = os.path.join(FIXTURES, "pipe_zero1_bf16_pp2_dp2", "global_step2")
    _, first = _read_all(run)
    last, _ = DeepSpeedReader(run)._describe_mp(1)
    key = "tied_modules.embed.tok.weight"
    for k in (key, f"optim.state.{key}.exp_avg", f"optim.state.{key}.exp_avg_sq"):
        assert {c.file.split("_mp_rank_")[1][:2] for c in last.tensors[k].chunks} == {"01"}
        r = DeepSpeedReader(run)
        r.describe = lambda: last  # (the last stage alone, as its own checkpoint)
        got = {k: torch.empty(first[k].shape, dtype=first[k].dtype)}
        load(got, storage_reader=r, strict=False)
        assert torch.equal(got[k], first[k]), k


@pytest.mark.parametrize("config", PIPE_CONFIGS)
def test_pipeline_module_weights_are_each_stages_own(config):
    """``weights=module``: the layer files, named as the PipelineModule names them, bitwise the
    weights each stage's module held when it saved (its state dict, written beside)."""
    run = os.path.join(FIXTURES, config)
    md, state = _read_all(run, weights="module")
    held = {}
    for s in (0, 1):
        for k, v in load_file(os.path.join(run, "reference", f"stage{s}.safetensors")).items():
            assert k not in held or torch.equal(held[k], v), k  # (the tied layer: the same on both stages)
            held[k] = v
    assert held.keys() == {k for k in md.tensors if not k.startswith("optim.")}
    for k, v in held.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    assert all(c.file.startswith("layer_") and c.checksum.startswith("crc32:")
               for k, t in md.tensors.items() if not k.startswith("optim.") for c in t.chunks)


def test_a_missing_pipeline_stage_or_layer_file_is_named(tmp_path):
    run = _copy(tmp_path, "pipe_zero1_fp32_pp2")
    step = run / "global_step2"
    (step / "layer_04-model_states.pt").unlink()
    _metadata(str(run))  # the fp32 weights are the optimizer's: the layer file is not needed
    with pytest.raises(CheckpointNotFoundError, match=r"no layer_<NN>-model_states.pt holds \['4.down.bias', "
                                                      r"'4.down.weight', '4.norm.bias'\] and more"):
        _metadata(str(run), weights="module")
    for f in step.iterdir():
        if "mp_rank_01" in f.name:
            f.unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"model-parallel rank\(s\) \[1\] are missing"):
        _metadata(str(run))


def test_a_flipped_byte_in_a_layer_file_is_named(tmp_path):
    """A layer file's tensors fill their storages: each is checked against torch.save's CRC-32."""
    run = _copy(tmp_path, "pipe_zero1_fp32_pp2")
    md = _metadata(str(run), weights="module")
    c = md.tensors["4.up.weight"].chunks[0]
    assert c.file == "layer_04-model_states.pt"
    f = run / "global_step2" / c.file
    raw = bytearray(f.read_bytes())
    raw[c.byte_offset + 5] ^= 0x01
    f.write_bytes(bytes(raw))
    state = {"4.up.weight": torch.empty(md.tensors["4.up.weight"].shape)}
    with pytest.raises(CorruptCheckpointError, match=f"{f}: the record of '4.up.weight' .* fails its zip CRC-32"):
        load(state, storage_reader=open_reader(str(run), weights="module"), strict=False)


# -- without ZeRO (stage 0, DeepSpeed's default): everything in mp_rank_00_model_states.pt ----------

PLAIN_CONFIGS = ["zero0_fp32", "zero0_bf16"]


@pytest.mark.parametrize("config", PLAIN_CONFIGS)
def test_without_zero_the_weights_moments_and_steps_are_what_the_engine_held(config):
    """fp32: the module's weights and torch Adam's state; bf16: FP16_Optimizer's fp32 copies and
    its Adam's state. Bitwise what the engine's optimizer objects held when it saved (DeepSpeed's
    tools read none of these files); the tied head is one parameter, under its first name."""
    run = os.path.join(FIXTURES, config)
    assert detect_format(run) == "deepspeed"
    md, state = _read_all(run)
    info = md.extra["deepspeed"]
    assert info["zero_stage"] == 0 and info["optimizer_read"] and info["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    live = load_file(os.path.join(run, "reference", "live.safetensors"))
    weights = {k for k in live if not k.endswith((".exp_avg", ".exp_avg_sq", ".step"))}
    assert weights == {k for k in md.tensors if not k.startswith("optim.")} and len(weights) == 20
    for k, v in live.items():
        if k.endswith(".step"):
            assert state[f"optim.state.{k}"] == float(v), k  # (bf16: FP16_Optimizer's Adam took a step more)
            continue
        key = k if k in weights else "optim.state.{}.{}".format(*k.rsplit(".", 1))
        assert state[key].dtype == v.dtype and torch.equal(state[key], v), k


@pytest.mark.parametrize("config", PLAIN_CONFIGS)
def test_without_zero_module_weights_are_the_modules_own(config):
    step = os.path.join(FIXTURES, config, "global_step2")
    module = torch.load(os.path.join(step, "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    md, state = _read_all(step, weights="module")
    assert {k for k in md.tensors if not k.startswith("optim.")} == set(module) - {"lm_head.weight"}
    for k in md.tensors:
        if not k.startswith("optim."):
            assert state[k].dtype == module[k].dtype and torch.equal(state[k], module[k]), k


def test_without_zero_an_optimizer_whose_positions_cannot_be_named_is_left_out(tmp_path, caplog):
    """A script's own parameter groups (here: the state dict's one group cut in two) leave each
    position's parameter unknown: the module's weights are read, the moments are not, and why is
    logged; the fp16 masters (fp32_groups) cannot be told apart either: weights=module is named."""
    import logging
    import pickle as _pickle  # (test-side only: rewriting the fixture's optimizer groups)

    run = _copy(tmp_path, "zero0_bf16")
    f = run / "global_step2" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    groups = sd["optimizer"]["optimizer_state_dict"]["param_groups"]
    params = groups[0]["params"]
    groups[:] = [dict(groups[0], params=params[:5]), dict(groups[0], params=params[5:])]
    torch.save(sd, f, pickle_module=_pickle)
    with pytest.raises(MetadataError, match=r"fp32_groups\) cannot be told apart by parameter; read the module's "
                                            r"own weights \(weights=module\)"):
        _metadata(str(run))
    with caplog.at_level(logging.WARNING):
        md = _metadata(str(run), weights="module")
    assert not any(k.startswith("optim.") for k in md.tensors) and md.extra["deepspeed"]["optimizer_read"] is False
    assert "2 parameter groups (a training script's own)" in caplog.text


def test_a_pipeline_stage_without_zero_or_bf16_is_refused_by_name():
    """fp32 without ZeRO under the pipeline engine: each stage's optimizer state is torch's, by
    position, and its model states name no parameter (no module, no param_shapes): refused, never
    guessed."""
    run = os.path.join(FIXTURES, "pipe_zero0_fp32_pp2")
    assert detect_format(run) == "deepspeed"
    with pytest.raises(MetadataError, match=r"global_step2/mp_rank_00_model_states.pt: a pipeline stage saved "
                                            r"without ZeRO and without bf16 is not read"):
        _metadata(run)
