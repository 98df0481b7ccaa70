"""Model and optimizer state keyed by parameter FQN, and torch's ``Stateful`` protocol.

Optimizer state keyed by parameter FQN saves and reshards like the model's own state.

``torch.optim.Optimizer.state_dict()`` keys state by parameter *index*, which breaks as soon as
the model is wrapped, split or resharded. torch's public helpers
(``torch.distributed.checkpoint.state_dict``) already map indices to FQNs for plain modules,
DTensor-sharded modules and FSDP2 (``fully_shard``), and keep sharded state as DTensors; we
build on them rather than re-deriving FQNs, and add what a checkpoint engine needs:

* ``get_optim_state_dict`` on an optimizer that has not stepped yet returns correctly shaped,
  zero-initialised state (torch initialises it), so the result is a valid *load target*;
* errors come back as ``StateDictError`` naming the parameter, not a bare ``KeyError``.

The returned dict is ``{"state": {fqn: {"step": t, "exp_avg": DTensor, ...}}, "param_groups":
[{..., "params": [fqn, ...]}]}``; put it under a key of the state dict you save.
"""

from __future__ import annotations

from typing import Any

import torch

from .core.errors import StateDictError
from .core.utils import is_stateful


def _options(full_state_dict: bool, cpu_offload: bool, strict: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full_state_dict, cpu_offload=cpu_offload, strict=strict)


def _check_params_in_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    known = {id(p) for p in model.parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in known:
                raise StateDictError(f"optimizer param_groups[{gi}].params[{pi}] (shape {tuple(p.shape)}) is not a "
                                     f"parameter of the model; its state would have no FQN")


def get_optim_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                         full_state_dict: bool = False, cpu_offload: bool = False) -> dict[str, Any]:
    """FQN-keyed optimizer state; sharded state stays sharded (DTensor) unless ``full_state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _check_params_in_model(model, optimizer)
    try:
        return get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict, cpu_offload, True))
    except (KeyError, RuntimeError, ValueError) as e:
        raise StateDictError(f"cannot build the FQN-keyed optimizer state: {type(e).__name__}: {e}") from e


def set_optim_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                         *, strict: bool = True) -> None:
    """Load FQN-keyed optimizer state (as loaded by ``load``) into ``optimizer``.

    With ``strict``, every parameter of the optimizer must have state in ``optim_state_dict``
    when the dict has any state at all (a partial optimizer state is an error, not a silent
    fresh start for some parameters).
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    _check_params_in_model(model, optimizer)
    if not isinstance(optim_state_dict, dict) or not {"state", "param_groups"} <= set(optim_state_dict):
        raise StateDictError("optimizer state dict must have 'state' and 'param_groups' (from get_optim_state_dict)")
    state = optim_state_dict["state"]
    if strict and state:
        names = {id(p): n for n, p in model.named_parameters()}
        wanted = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        missing = [n for n in wanted if n not in state]
        if missing:
            raise StateDictError(f"optimizer state lacks {len(missing)} parameter(s): {missing[:10]}")
    n_groups = len(optimizer.param_groups)
    if len(optim_state_dict["param_groups"]) != n_groups:
        raise StateDictError(f"optimizer state has {len(optim_state_dict['param_groups'])} param group(s), "
                             f"the optimizer has {n_groups}")
    try:
        set_optimizer_state_dict(model, optimizer, optim_state_dict, options=_options(False, False, strict))
    except (KeyError, RuntimeError, ValueError) as e:
        raise StateDictError(f"cannot load the optimizer state: {type(e).__name__}: {e}") from e


def get_model_state_dict(model: torch.nn.Module, *, full_state_dict: bool = False,
                         cpu_offload: bool = False) -> dict[str, Any]:
    """The model's state keyed by FQN through torch's helper, which strips wrapper prefixes
    (``_orig_mod.``, FSDP/DDP wrappers) so the keys stay the same however the model is wrapped;
    sharded parameters stay DTensors unless ``full_state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict as torch_get

    try:
        return torch_get(model, options=_options(full_state_dict, cpu_offload, True))
    except (KeyError, RuntimeError, ValueError) as e:
        raise StateDictError(f"cannot build the model state dict: {type(e).__name__}: {e}") from e


def set_model_state_dict(model: torch.nn.Module, model_state_dict: dict[str, Any], *, strict: bool = True) -> Any:
    """Load an FQN-keyed model state (as loaded by ``load``) into ``model``; returns torch's
    ``(missing_keys, unexpected_keys)``. ``strict`` makes any mismatch a ``StateDictError``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict as torch_set

    if not isinstance(model_state_dict, dict):
        raise StateDictError(f"model state dict must be a dict, got {type(model_state_dict).__name__}")
    try:
        return torch_set(model, model_state_dict, options=_options(False, False, strict))
    except (KeyError, RuntimeError, ValueError) as e:
        raise StateDictError(f"cannot load the model state: {type(e).__name__}: {e}") from e


def stateful_to_state_dict(state_dict: Any) -> tuple[Any, dict[str, Any]]:
    """Replace top-level ``Stateful`` values by their ``state_dict()`` (as torch DCP does).
    Returns the plain state dict and the objects that were replaced, by key."""
    if not isinstance(state_dict, dict):
        return state_dict, {}
    objs = {k: v for k, v in state_dict.items() if is_stateful(v)}
    if not objs:
        return state_dict, {}
    plain = dict(state_dict)
    for k, v in objs.items():
        plain[k] = v.state_dict()
    return plain, objs


def restore_stateful(objs: dict[str, Any], loaded: dict[str, Any], caller: Any) -> None:
    """After a load into the plain state dict: hand each object its loaded state, in place, and
    give the caller's dict the other top-level values (objects were replaced in the copy)."""
    if not objs:
        return
    for k, v in loaded.items():
        if k not in objs:
            caller[k] = v
    for k, obj in objs.items():
        try:
            obj.load_state_dict(loaded[k])
        except Exception as e:
            raise StateDictError(f"state-dict key {k!r}: {type(obj).__name__}.load_state_dict() refused the loaded "
                                 f"state: {type(e).__name__}: {e}") from e
