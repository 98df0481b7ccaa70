"""The Python API where users come from torch.distributed.checkpoint: Stateful values, loading a
subset, FQN-keyed model state."""

import pytest
import torch

from hpdcp_runner.dcp import (PickleNotAllowedError, StateDictError, get_model_state_dict, load, save,
                              set_model_state_dict)


class Counter:
    """A user's own Stateful object (a data-loader position, a trainer)."""

    def __init__(self, n: int = 0) -> None:
        self.n, self.loaded = n, None

    def state_dict(self) -> dict:
        return {"n": self.n, "hist": torch.arange(4) * self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.loaded = sd["n"], sd


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def test_stateful_values_are_saved_through_their_state_dict_and_restored_in_place(tmp_path):
    src, dst = _model(0), _model(1)
    save({"model": src, "loader": Counter(3), "step": 7}, checkpoint_id=tmp_path / "ck")
    counter = Counter()
    state = {"model": dst, "loader": counter, "step": 0}
    load(state, checkpoint_id=tmp_path / "ck")
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k
    assert counter.n == 3 and torch.equal(counter.loaded["hist"], torch.arange(4) * 3)
    assert state["model"] is dst and state["loader"] is counter and state["step"] == 7
    assert not (tmp_path / "ck" / "rank00000.objects.json").read_text().count('"p"')  # nothing pickled


def test_nested_stateful_is_not_advised_to_pickle(tmp_path):
    with pytest.raises(StateDictError) as ei:
        save({"train": {"loader": Counter(1)}}, checkpoint_id=tmp_path / "ck")
    assert not isinstance(ei.value, PickleNotAllowedError)
    assert "Stateful" in str(ei.value) and "'train.loader'" in str(ei.value) and "allow_pickle" not in str(ei.value)


def test_a_refused_load_state_dict_names_the_key(tmp_path):
    class Picky(Counter):
        def load_state_dict(self, sd):
            raise ValueError("wrong version")

    save({"obj": Counter(2)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(StateDictError, match="'obj'.*Picky.load_state_dict.*wrong version"):
        load({"obj": Picky()}, checkpoint_id=tmp_path / "ck")


def test_weights_only_from_a_model_and_optimizer_checkpoint(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path / "ck")
    fresh = _model(1)
    res = load({"model": fresh.state_dict()}, checkpoint_id=tmp_path / "ck", strict=False)
    assert res.missing_keys == () and res.unexpected_keys and all(k.startswith("optim.") for k in res.unexpected_keys)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_model_state_dict_helpers_round_trip(tmp_path):
    src, dst = _model(0), _model(1)
    compiled_like = torch.nn.Module()
    compiled_like._orig_mod = src  # a wrapper prefix the helper strips
    sd = get_model_state_dict(src)
    assert set(sd) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    save({"model": sd}, checkpoint_id=tmp_path / "ck")
    target = {"model": get_model_state_dict(dst)}
    load(target, checkpoint_id=tmp_path / "ck")
    set_model_state_dict(dst, target["model"])
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    with pytest.raises(StateDictError):
        set_model_state_dict(dst, {"0.weight": torch.zeros(7, 5)})  # strict: the others are missing
