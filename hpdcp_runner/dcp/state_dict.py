"""Optimizer state keyed by parameter FQN, so it saves and reshards like the model's own state.

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

from .errors import StateDictError


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
