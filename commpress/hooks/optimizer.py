"""The hand-over of an optimizer's momentum to the compressors that apply it before they
compress (:attr:`~commpress.compressors.base.Compressor.applies_momentum`: DGC's momentum
correction, :mod:`commpress.compressors.dgc`), so the optimizer runs without it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from commpress.compressors import Compressor
from commpress.errors import ConfigError
from commpress.optim.hybrid import HybridOptimizer, describe

__all__ = ["HANDED_OVER", "hand_over_momentum"]

#: The optimizer param-group key that records the momentum handed over (saved with the
#: optimizer's state, so a resumed run finds it even after loading that state first).
HANDED_OVER = "commpress_dgc_momentum"


def _where(c: Compressor) -> str:
    """How messages name a compressor that applies momentum itself."""
    return f"method {c.name!r} with DGC's momentum correction"


def hand_over_momentum(
    optimizer: torch.optim.Optimizer | None,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    compressor_of: Callable[[str], Compressor],
    start_iter: int = 0,
) -> Callable[[], None]:
    """Give each compressor that applies momentum itself the momentum of the SGD param groups
    holding its parameters and set theirs to 0 (recorded under :data:`HANDED_OVER`; a step with it
    back is refused); returns the call that gives it back. Raises :class:`ConfigError`, changing
    nothing, for what DGC cannot take over: no optimizer or not ``torch.optim.SGD``, Nesterov or
    dampening, a group mixing DGC parameters with others, a momentum configured otherwise,
    ``start_iter > 0``."""
    owners: dict[int, tuple[str, Compressor]] = {}
    for name, p in named_parameters:
        c = compressor_of(name)
        if c.applies_momentum:
            owners[id(p)] = (name, c)
    if not owners:
        return lambda: None
    where = _where(next(iter(owners.values()))[1])
    if isinstance(optimizer, HybridOptimizer):
        optimizer = _holder(optimizer, owners, where)
    _check_optimizer(optimizer, start_iter, where)
    taken, handed = _momenta(optimizer, owners)
    for c, m in taken.values():
        if m and c.momentum is not None and c.momentum != m:
            raise ConfigError(
                f"{_where(c)}: momentum = {c.momentum} is configured, the optimizer's is {m}; set them equal, or leave "
                "momentum out of the config to take the optimizer's"
            )
    for _, c in owners.values():
        if c.momentum is None and id(c) not in taken:
            raise ConfigError(f"{_where(c)}: no optimizer param group holds its parameters; set params.momentum")
    for c, m in taken.values():
        if m or c.momentum is None:  # an optimizer without momentum leaves a configured one in place
            c.momentum = m
    for i, m in handed:
        optimizer.param_groups[i][HANDED_OVER] = m
        optimizer.param_groups[i]["momentum"] = 0.0
    guard = optimizer.register_step_pre_hook(_guard([i for i, _ in handed])) if handed else None

    def give_back() -> None:
        if guard is not None:
            guard.remove()
        for i, m in handed:
            optimizer.param_groups[i]["momentum"] = optimizer.param_groups[i].pop(HANDED_OVER, m)

    return give_back


def _holder(hybrid: HybridOptimizer, owners: dict[int, tuple[str, Compressor]], where: str) -> torch.optim.Optimizer:
    """The one optimizer of ``hybrid`` that steps the parameters whose momentum DGC takes over."""
    holders = [o for o in hybrid.optimizers if any(id(p) in owners for g in o.param_groups for p in g["params"])]
    if len(holders) != 1:
        named = "; ".join(describe(o) for o in holders) or "none of its optimizers"
        raise ConfigError(
            f"{where} takes over the momentum of the one torch.optim.SGD that steps its parameters; in the "
            f"HybridOptimizer they are stepped by {named}: give them one SGD, or a method without DGC"
        )
    return holders[0]


def _check_optimizer(optimizer: torch.optim.Optimizer | None, start_iter: int, where: str) -> None:
    """Refuse an optimizer (or a start) whose momentum DGC cannot take over."""
    if start_iter:
        raise ConfigError(
            f"start_iter = {start_iter} is not accepted with {where}: the plain steps before it would run without "
            "momentum (DGC applies it); use the method's warmup_steps instead"
        )
    if optimizer is None:
        raise ConfigError(
            f"{where} applies momentum itself: pass optimizer= (the torch.optim.SGD of these parameters) to "
            "commpress.register, which hands the optimizer's momentum over to it"
        )
    if not isinstance(optimizer, torch.optim.SGD):
        raise ConfigError(
            f"optimizer {type(optimizer).__name__} is not accepted with {where}: it replaces the momentum of "
            "torch.optim.SGD; with Adam, AdamW or other adaptive optimizers turn DGC's momentum correction off, or "
            "use a method that leaves the momentum to the optimizer"
        )


def _momenta(
    optimizer: torch.optim.Optimizer, owners: dict[int, tuple[str, Compressor]]
) -> tuple[dict[int, tuple[Compressor, float]], list[tuple[int, float]]]:
    """({id(compressor): (compressor, momentum of its groups)}, [(group index, momentum)
    of the groups to hand over]), checking every group that holds DGC parameters."""
    taken: dict[int, tuple[Compressor, float]] = {}
    handed = []
    for i, group in enumerate(optimizer.param_groups):
        mine = [owners[id(p)] for p in group["params"] if id(p) in owners]
        if not mine:
            continue
        m = float(group.get(HANDED_OVER, group["momentum"]))
        if group["momentum"] not in (0, m):
            raise ConfigError(
                f"optimizer param group {i} has momentum = {group['momentum']} after handing over {m} to DGC "
                "(an optimizer state from another run was loaded after commpress.register?)"
            )
        if group.get("nesterov") or group.get("dampening"):
            raise ConfigError(
                f"optimizer param group {i}: nesterov = {group.get('nesterov')}, dampening = {group.get('dampening')} "
                f"are not accepted with {_where(mine[0][1])}; accepted: nesterov = False, dampening = 0"
            )
        others = sum(1 for p in group["params"] if id(p) not in owners)
        if others and m:
            raise ConfigError(
                f"optimizer param group {i} holds {others} parameters not compressed with DGC next to "
                f"{len(mine)} that are ({mine[0][0]!r}, ...): DGC takes over a whole group's momentum; give the "
                "DGC parameters their own param group (torch.optim.SGD([{'params': dgc}, {'params': others}], ...))"
            )
        for name, c in mine:
            seen = taken.setdefault(id(c), (c, m))[1]
            if seen != m:
                raise ConfigError(f"parameter {name!r}: the parameters of its method group have momentum {seen} and {m}")
        if m:
            handed.append((i, m))
    return taken, handed


def _guard(indices: list[int]) -> Callable[..., None]:
    """An optimizer step pre-hook: refuse to step once a handed-over group has momentum again."""

    def check(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for i in indices:
            if opt.param_groups[i]["momentum"] != 0:
                raise ConfigError(
                    f"optimizer param group {i} handed its momentum to DGC but has momentum = "
                    f"{opt.param_groups[i]['momentum']} again (an optimizer state from before the hand-over was loaded "
                    "after commpress.register): load it before register, or set that group's momentum to 0"
                )

    return check
