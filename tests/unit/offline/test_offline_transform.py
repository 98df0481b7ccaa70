"""Offline transforms in one process: HF merge/import, .pt import, hyper-parallel import, bad inputs."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from hpdcp_runner.dcp import (CheckpointNotFoundError, ConfigError, HpdcpError, MetadataError, PickleNotAllowedError,
                              load, save)
from hpdcp_runner.dcp.offline.inspection import full_tensor_digests, iter_full_tensors
from hpdcp_runner.dcp.offline.transforms import import_checkpoint, merge_to_hf, plan_hf_shards, select_keys


def _state():
    g = torch.Generator().manual_seed(3)
    return {"model": {"embed": torch.randn(11, 6, generator=g), "layers": [{"w": torch.randn(6, 6, generator=g)},
                                                                             {"w": torch.randn(6, 6, generator=g)}],
                      "ids": torch.arange(9, dtype=torch.int64), "scale": torch.tensor(0.5)},
            "optim": {"m": torch.ones(6, 6)}, "step": 12}


def test_select_keys_and_shard_plan():
    keys = ["model.a", "model.b", "optim.m"]
    assert select_keys(keys, exclude=r"^optim\.", rename=[(r"^model\.", "")]) == {"model.a": "a", "model.b": "b"}
    with pytest.raises(ConfigError, match="both 'model.a' and 'model.b'"):
        select_keys(keys, rename=[(r"model\.[ab]", "x")])
    assert plan_hf_shards([("a", 40), ("b", 70), ("c", 10), ("d", 200)], 100) == [["a"], ["b", "c"], ["d"]]


def test_ours_to_hf_to_ours_bitwise_with_index(tmp_path):
    sd = _state()
    save(sd, checkpoint_id=tmp_path / "ours")
    res = merge_to_hf(tmp_path / "ours", tmp_path / "hf", max_shard_size=300, exclude=r"^optim\.",
                      rename=[(r"^model\.", "")])
    assert res["skipped_objects"] == ["step"] and len(res["files"]) > 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    merged = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(tmp_path / "hf" / name)
        assert not set(part) & set(merged)  # every key once
        assert all(index["weight_map"][k] == name for k in part)
        merged.update(part)
    assert set(merged) == set(index["weight_map"]) == {"embed", "layers.0.w", "layers.1.w", "ids", "scale"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert torch.equal(merged["layers.1.w"], sd["model"]["layers"][1]["w"]) and merged["ids"].dtype == torch.int64
    # ... and back, split over 3 rank files (Shard(0)), renamed back: bitwise the same tensors.
    md = import_checkpoint(tmp_path / "hf", tmp_path / "back", world_size=3, rename=[(r"^", "model.")])
    assert md.world_size == 3 and len(md.tensors["model.embed"].chunks) == 3
    a = full_tensor_digests(tmp_path / "ours")
    assert full_tensor_digests(tmp_path / "back") == {k: v for k, v in a.items() if not k.startswith("optim")}


def test_merge_single_file_and_dtype_cast(tmp_path):
    sd = _state()
    save(sd, checkpoint_id=tmp_path / "ours")
    merge_to_hf(tmp_path / "ours", tmp_path / "hf", dtype="bfloat16", single_file=True, max_shard_size=10)
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(out["model.embed"], sd["model"]["embed"].to(torch.bfloat16))
    assert out["model.ids"].dtype == torch.int64  # integer tensors are not cast


def test_pt_import_weights_only_and_objects(tmp_path):
    sd = _state()
    torch.save(sd, tmp_path / "x.pt")
    import_checkpoint(tmp_path / "x.pt", tmp_path / "ck", world_size=2)
    tgt = {"model": {"embed": torch.zeros(11, 6), "layers": [{"w": torch.zeros(6, 6)}, {"w": torch.zeros(6, 6)}],
                     "ids": torch.zeros(9, dtype=torch.int64), "scale": torch.tensor(0.0)},
           "optim": {"m": torch.zeros(6, 6)}, "step": 0}
    load(tgt, checkpoint_id=tmp_path / "ck")
    assert tgt["step"] == 12 and torch.equal(tgt["model"]["layers"][0]["w"], sd["model"]["layers"][0]["w"])
    assert torch.equal(tgt["model"]["scale"], sd["model"]["scale"])


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pt_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "PWNED"
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"w": _Payload(marker)}, f)
    with pytest.raises(PickleNotAllowedError, match="evil.pt"):
        import_checkpoint(tmp_path / "evil.pt", tmp_path / "ck")
    assert not marker.exists() and not (tmp_path / "ck").exists()


def test_malformed_hf_inputs_name_the_file(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(2)}, hf / "s1.safetensors")
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, hf / "s2.safetensors")
    (hf / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(MetadataError, match="model.safetensors.index.json: not valid JSON"):
        import_checkpoint(hf, tmp_path / "o1")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors",
                                                                                 "b": "s2.safetensors"}}))
    with pytest.raises(MetadataError, match=r"'a' is stored twice: in .*s1.safetensors and .*s2.safetensors"):
        import_checkpoint(hf, tmp_path / "o2")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors",
                                                                                 "b": "gone.safetensors"}}))
    with pytest.raises(CheckpointNotFoundError, match="gone.safetensors is listed in .*model.safetensors.index.json"):
        import_checkpoint(hf, tmp_path / "o3")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../s1.safetensors"}}))
    with pytest.raises(MetadataError, match="must be a plain (file )?name"):
        import_checkpoint(hf, tmp_path / "o4")
    (hf / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(HpdcpError, match="bad.safetensors"):
        import_checkpoint(hf / "bad.safetensors", tmp_path / "o5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing half-written


# -- hyper-parallel ---------------------------------------------------------------------------------

def _hp_module():
    """Stand-ins for hyper-parallel's metadata classes under their real module path."""
    name = "hyper_parallel.core.distributed_checkpoint.metadata"
    mod = types.ModuleType(name)

    def dc(cls_name, fields, frozen=True):
        cls = dataclasses.make_dataclass(cls_name, fields, frozen=frozen)
        cls.__module__ = name
        setattr(mod, cls_name, cls)
        return cls

    dc("ChunkStorageMetadata", ["offsets", "sizes"])
    dc("TensorProperties", ["dtype"])
    dc("TensorStorageMetadata", ["properties", "size", "chunks"])
    dc("BytesStorageMetadata", [])
    dc("MetadataIndex", ["fqn", "offset"])
    dc("StorageInfo", ["relative_path", "offset", "length", "tensor_key"])
    dc("Metadata", ["state_dict_metadata", "planner_data", "storage_data", "version"], frozen=False)
    for pkg in ("hyper_parallel", "hyper_parallel.core", "hyper_parallel.core.distributed_checkpoint"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg))
    sys.modules[name] = mod
    return mod


def _write_hp(root, m, full):
    """A 2-rank hyper-parallel checkpoint of ``full`` split by rows, plus one pickled object."""
    root.mkdir()
    halves = [full[:3], full[3:]]
    chunks, storage = [], {}
    for r, h in enumerate(halves):
        save_file({"w": h.contiguous()}, root / f"_rank{r}_.safetensors")
        off = (3 * r, 0)
        chunks.append(m.ChunkStorageMetadata(off, tuple(h.shape)))
        storage[m.MetadataIndex("w", off)] = m.StorageInfo(f"_rank{r}_.safetensors", 0, -1, "w")
    obj = pickle.dumps({"lr": 0.1})
    (root / "_rank0_.bytes").write_bytes(obj)
    storage[m.MetadataIndex("opt", ())] = m.StorageInfo("_rank0_.bytes", 0, len(obj), None)
    sdm = {"w": m.TensorStorageMetadata(m.TensorProperties("torch.float32"), tuple(full.shape), chunks),
           "opt": m.BytesStorageMetadata()}
    with open(root / ".metadata", "wb") as f:
        pickle.dump(m.Metadata(sdm, {"w": ("w",), "opt": ("opt",)}, storage, "1.0"), f)


def test_hyper_parallel_import_through_restricted_unpickler(tmp_path):
    m = _hp_module()
    full = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    _write_hp(tmp_path / "hp", m, full)
    with pytest.raises(PickleNotAllowedError, match="allow_pickle"):
        import_checkpoint(tmp_path / "hp", tmp_path / "ck")
    md = import_checkpoint(tmp_path / "hp", tmp_path / "ck", allow_pickle=True, world_size=2)
    assert md.extra["source_format"] == "HyperParallelSource"
    tgt = {"w": torch.zeros(7, 5), "opt": None}
    load(tgt, checkpoint_id=tmp_path / "ck")
    assert torch.equal(tgt["w"], full) and tgt["opt"] == {"lr": 0.1}


def test_hyper_parallel_metadata_with_a_foreign_global_runs_nothing(tmp_path):
    m = _hp_module()
    _write_hp(tmp_path / "hp", m, torch.zeros(7, 5))
    marker = tmp_path / "PWNED"
    with open(tmp_path / "hp" / ".metadata", "wb") as f:
        pickle.dump(m.Metadata({"w": _Payload(marker)}, None, {}, "1.0"), f)
    with pytest.raises(MetadataError, match=r"\.metadata: not hyper-parallel metadata .*posix.system"):
        import_checkpoint(tmp_path / "hp", tmp_path / "ck", allow_pickle=True)
    assert not marker.exists() and not (tmp_path / "ck").exists()


def test_merge_memory_stays_near_the_largest_tensor(tmp_path):
    """12 x 16 MiB tensors (192 MiB) merged with a 40 MiB shard cap: peak RSS growth < 2x 16 MiB."""
    sd = {f"t{i}": torch.full((4096, 1024), float(i)) for i in range(12)}
    save(sd, checkpoint_id=tmp_path / "big")
    del sd
    script = textwrap.dedent(f"""
        import json
        from hpdcp_runner.dcp.offline.transforms import merge_to_hf
        def status(field):
            for line in open("/proc/self/status"):
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        open("/proc/self/clear_refs", "w").write("5")
        base = status("VmRSS")
        res = merge_to_hf({str(tmp_path / "big")!r}, {str(tmp_path / "hf")!r}, max_shard_size=40 << 20, fsync=False)
        print(json.dumps({{"growth": status("VmHWM") - base, "files": len(res["files"])}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["files"] == 6
    assert out["growth"] < 2 * (16 << 20), f"peak RSS grew by {out['growth'] / 2**20:.1f} MiB"
    got = dict(iter_full_tensors(tmp_path / "big", ["t11"]))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert torch.equal(load_file(tmp_path / "hf" / index["weight_map"]["t11"])["t11"], got["t11"])
    assert index["metadata"]["total_size"] == 12 * (16 << 20)


def test_an_import_writes_through_the_save_writer_with_block_digests(tmp_path):
    """The import is not a second save path: its rank files carry what a save's carry,
    including the per-block digests that let a partial read verify what it copies."""
    from safetensors.torch import save_file

    from hpdcp_runner.dcp import load, read_metadata
    from hpdcp_runner.dcp.offline.transforms import import_checkpoint

    big = torch.randn(700, 1024)  # 2.7 MiB: over the 1 MiB block size
    save_file({"big": big, "small": torch.ones(3)}, str(tmp_path / "w.safetensors"))
    import_checkpoint(tmp_path / "w.safetensors", tmp_path / "ours", world_size=2)
    md = read_metadata(tmp_path / "ours")
    assert all(("rank0000%d.safetensors" % r, f"big@{350 * r},0") in md.blocks for r in range(2))
    tgt = {"big": torch.zeros(700, 1024), "small": torch.zeros(3)}
    load(tgt, checkpoint_id=tmp_path / "ours")
    assert torch.equal(tgt["big"], big)


@pytest.mark.parametrize("t", [torch.arange(12.).view(3, 4), torch.ones(0, 3), torch.tensor(3.5),
                               torch.arange(10, dtype=torch.bfloat16)[::2], torch.arange(6, dtype=torch.int64).view(2, 3).t()])
def test_a_tensor_digest_is_the_hash_of_its_dtype_shape_and_row_major_bytes(t):
    """The verify compares digests of both sides; streaming the hash over a tensor's bytes (no
    copy) must give exactly the digest of dtype + shape + its row-major bytes, whatever its
    strides, dtype or size."""
    import xxhash

    from hpdcp_runner.dcp.offline.inspection import tensor_digest

    c = t.contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert tensor_digest(t) == xxhash.xxh3_64_hexdigest(f"{c.dtype}{list(c.shape)}".encode() + raw)
