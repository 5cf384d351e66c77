"""Finds the modules a configuration allows to tune, and the dtypes each may take."""
from __future__ import annotations

import logging
from fnmatch import fnmatchcase

import torch
from torch import nn

from autotune.backends import get_backend
from autotune.backends.base import CallInputs
from autotune.capture import failure_of
from autotune.clone import clone
from autotune.config.tuning import FUSED_EXPERTS, MixedPrecisionConfig, TuningConfig
from autotune.errors import ConfigError, NoTunableModulesError, did_you_mean, listed

log = logging.getLogger("autotune")


def fused_experts(module: nn.Module) -> bool:
    """Whether `module` holds a mixture of experts' weights stacked in Parameters of its own (experts × out × in,
    sliced per expert in its forward), as transformers' *Experts classes do (Mixtral, Qwen-MoE, DeepSeek, OLMoE
    and others since transformers 5): no nn.Linear is left to tune there, and the experts hold most of an MoE's
    weights (60 % of a 3-layer Qwen3-MoE's). `module_types` names them FusedExperts. A class of other layouts (a
    ModuleList of Linear experts) is left to its Linears."""
    return type(module).__name__.endswith("Experts") and any(
        parameter.dim() >= 3 and parameter.is_floating_point() for parameter in module.parameters(recurse=False))


def _type_matches(module: nn.Module, type_names: list[str]) -> bool:
    if FUSED_EXPERTS in type_names and fused_experts(module):
        return True
    for cls in type(module).__mro__:
        if cls.__name__ in type_names or f"{cls.__module__}.{cls.__qualname__}" in type_names:
            return True
    return False


def _matches_any(name: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def uncompiled(model: nn.Module) -> nn.Module:
    """`model` with each `torch.compile` wrapper in it (the model itself, or a submodule the user compiled) replaced
    by the module it compiles (its one child, `_orig_mod`): a copy where one is, else `model` itself. Trials run
    eagerly and the compiling engines compile the finalists; handed wrappers, dynamo traced every hooked call of
    the signals, and a three-Linear model's tuning grew past 6 GB of memory within a minute."""
    def wrapped(module: nn.Module) -> nn.Module | None:
        inner = dict(module.named_children()).get("_orig_mod")
        return inner if type(module).__name__ == "OptimizedModule" and isinstance(inner, nn.Module) else None

    def unwrapped(module: nn.Module) -> nn.Module:
        while (inner := wrapped(module)) is not None:
            module = inner
        return module

    def replace_below(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if (inner := unwrapped(child)) is not child:
                parent.set_submodule(name, inner)
            replace_below(inner)

    model = unwrapped(model)
    if all(wrapped(module) is None for module in model.modules()):
        return model
    copied = clone(model)
    replace_below(copied)
    return copied


def tunable_modules(model: nn.Module, config_set: list[MixedPrecisionConfig]) -> dict[str, list[str]]:
    """Maps each tunable module name to its candidate dtypes (fp32 always included, as the fallback).

    A module inside another tunable module is not tuned on its own: the outer one owns it.
    """
    _check_names(model, config_set)
    candidates: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if any(name.startswith(owner + ".") or owner == "" for owner in candidates):
            continue
        dtypes: list[str] = []
        for mp in config_set:
            if not _type_matches(module, mp.module_types):
                continue
            if mp.include and not _matches_any(name, mp.include):
                continue
            if _matches_any(name, mp.exclude):
                continue
            dtypes.extend(d for d in mp.dtype if d not in dtypes)
        if dtypes:
            candidates[name] = dtypes if "fp32" in dtypes else dtypes + ["fp32"]
    if not candidates:
        wanted = sorted({t for mp in config_set for t in mp.module_types})
        raise NoTunableModulesError(
            f"{type(model).__name__} has no module of the tunable types {wanted} left after include/exclude")
    return candidates


def _check_names(model: nn.Module, config_set: list[MixedPrecisionConfig]) -> None:
    """Raises ConfigError naming every include / exclude pattern that matches no module of `model`, and every
    module type a config names that is no class of its modules nor of torch.nn (a typo, "Conv2dd", left the
    model's convolutions untuned with a warning alone; a torch.nn class the model lacks is a config written for
    other models too)."""
    names = [name for name, _ in model.named_modules()]
    known = ({form for module in model.modules() for cls in type(module).__mro__
              for form in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")}
             | {n for n, value in vars(nn).items() if isinstance(value, type) and issubclass(value, nn.Module)}
             | set(MixedPrecisionConfig().module_types))
    errors = []
    for index, mp in enumerate(config_set):
        for field in ("include", "exclude"):
            errors += [(f"config_set.{index}.{field}", f"pattern {pattern!r} matches no module of "
                        f"{type(model).__name__}") for pattern in getattr(mp, field)
                       if not any(fnmatchcase(name, pattern) for name in names)]
        if "module_types" in mp.model_fields_set:
            errors += [(f"config_set.{index}.module_types", f"{kind!r} is no class of {type(model).__name__}'s "
                        f"modules nor of torch.nn{did_you_mean(kind, sorted(known))}")
                       for kind in mp.module_types if kind not in known]
    if errors:
        raise ConfigError("; ".join(f"{path}: {message}" for path, message in errors), errors)


# Sibling names of q/k/v projections in common models: BERT / ViT, BART / LLaMA / CLIP / Whisper, T5 / MPNet,
# DistilBERT, DeBERTa, Funnel
QKV_NAMES = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"),
             ("query_proj", "key_proj", "value_proj"), ("q_head", "k_head", "v_head"))


def qkv_groups(candidates: dict[str, list[str]]) -> list[list[str]]:
    """The q/k/v projections of each attention block (siblings named as in QKV_NAMES): they read the same input,
    so one dtype for all three is the natural unit."""
    groups = []
    parents = dict.fromkeys(name.rpartition(".")[0] for name in candidates)
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for names in QKV_NAMES:
            members = [prefix + child for child in names]
            if all(member in candidates for member in members):
                groups.append(members)
                break
    return groups


def tied_groups(model: nn.Module, candidates: dict[str, list[str]]) -> list[list[str]]:
    """The candidates holding one Parameter between them (cells tied to one weight), each set of two or more in
    model order: one dtype for all, so that apply_plan lowers them once and the tuned model keeps them tied (each
    int8 cell of six held its own copy, and the model grew past fp32's size)."""
    owner: dict[int, int] = {}    # id of a parameter -> the index of its group
    groups: list[list[str]] = []
    for name in candidates:
        ids = [id(p) for p in model.get_submodule(name).parameters(recurse=False)]
        index = next((owner[i] for i in ids if i in owner), None)
        if index is None:
            index = len(groups)
            groups.append([])
        groups[index].append(name)
        owner.update(dict.fromkeys(ids, index))
    return [group for group in groups if len(group) > 1]


def search_candidates(model: nn.Module, config: TuningConfig) -> dict[str, list[str]]:
    """Tunable modules and the dtypes the configured device supports for each (speed is measured later).

    Raises:
        ConfigError: an include / exclude pattern matches no module.
        NoTunableModulesError: no module is left to tune.
    """
    device = torch.device(config.device)
    return {name: [d for d in dtypes if get_backend(d).supports(model.get_submodule(name), device)]
            for name, dtypes in tunable_modules(model, config.config_set).items()}


def unlowerable(model: nn.Module, candidates: dict[str, list[str]]) -> list[str]:
    """The candidates no technique takes in any dtype but fp32 on the configured device, logged by type: a module
    quantised already (torch.ao's dynamic Linear matches "Linear" by name) or one with integer weights stays as it
    is, and so does one only casts take (a cell, a transposed convolution, fused experts) where the dtypes
    configured are int8 alone. Without the warning a run that tuned nothing would read as one that found nothing
    faster."""
    kept = [name for name, dtypes in candidates.items() if set(dtypes) <= {"fp32"}]
    if kept:
        by_weights: dict[bool, set[str]] = {True: set(), False: set()}
        for module in map(model.get_submodule, kept):
            floating = any(parameter.is_floating_point() for parameter in module.parameters())
            by_weights[floating].add(f"{type(module).__module__}.{type(module).__name__}")
        why = {False: "quantised already, or weights not in floating point",
               True: "no technique of the dtypes configured takes them: bf16 / fp16 casts do"}
        log.warning("%d of the %d tunable modules stay as they are: no technique lowers them (%s)", len(kept),
                    len(candidates), "; ".join(f"{', '.join(sorted(kinds))}: {why[floating]}"
                                               for floating, kinds in by_weights.items() if kinds))
    return kept


UNTUNED_SHARE = 0.1   # a module type holding this share of the weights, none of it tuned, is named in the log
UNTUNED_MOST = 0.5    # and as a warning where such types hold this share: most of the model is left as it is


def untuned_weights(model: nn.Module, candidates: dict[str, list[str]]) -> dict[str, tuple[int, float]]:
    """{module type: (modules, share of the model's weights)} for the types outside every candidate that hold
    UNTUNED_SHARE of the weights or more, logged: an embedding table can be most of a recommender or a language
    model, and a user reading the plan alone would not know it was never among the `module_types` tuned."""
    tuned = {id(module) for name in candidates for module in model.get_submodule(name).modules()}
    # Each parameter once, under the first untuned module holding it: a tied one (an embedding table that is also
    # the tuned output projection's weight) stays as it is in the embedding.
    held: dict[int, tuple[int, str | None]] = {}
    holders: dict[str, set[int]] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            size, kind = held.get(id(parameter), (parameter.numel(), None))
            if kind is None and id(module) not in tuned:
                kind = type(module).__name__
                holders.setdefault(kind, set()).add(id(module))
            held[id(parameter)] = size, kind
    total = sum(size for size, _ in held.values())
    owned = {kind: sum(size for size, holder in held.values() if holder == kind) for kind in holders}
    found = {kind: (len(holders[kind]), size / total) for kind, size in owned.items()
             if total and size / total >= UNTUNED_SHARE}
    if found:
        most = sum(share for _, share in found.values()) >= UNTUNED_MOST   # a recommender's EmbeddingBag: 65 %
        log.log(logging.WARNING if most else logging.INFO, "not tuned, as no module_types names them: %s", ", ".join(
            f"{kind} ×{count} ({100 * share:.0f} % of the weights)" for kind, (count, share) in found.items()))
    return found


UNCALLED_MOST = 0.25   # tunable modules the captured batch never reached holding this share of the weights: a warning


def called_candidates(model: nn.Module, candidates: dict[str, list[str]], called: set[str]) -> dict[str, list[str]]:
    """The candidates the model's forward calls as modules. A parent may use a child's weights without calling
    it (nn.MultiheadAttention's `out_proj`): lowering such a module would change nothing the model runs, and
    there is no input to calibrate or time it on, so it stays as it is.

    Raises:
        NoTunableModulesError: the forward calls none of the candidates.
    """
    kept = {name: dtypes for name, dtypes in candidates.items() if name in called}
    skipped = [name for name in candidates if name not in called]
    if skipped:
        # Said as a warning where they hold much of the model: a branch taken only by other batches than the
        # first (`if x.sum() > 0`) held half of one, and stayed fp32 unsaid.
        share = _weight_share(model, skipped)
        log.log(logging.WARNING if share >= UNCALLED_MOST else logging.INFO,
                "%d tunable modules (%.0f %% of the weights) are never called by the forward on the captured batch "
                "(their parent reads their weights, they are unused, only other inputs reach them: give "
                "example_inputs that do, or eval_fn calls them apart from the model's forward and its own methods), "
                "so they stay as they are: %s", len(skipped), 100 * share, listed(skipped))
    if not kept:
        raise NoTunableModulesError(f"the forward calls none of the {len(candidates)} tunable modules as a module "
                                    f"(e.g. {skipped[0]!r}): nothing is left to tune")
    return kept


def _weight_share(model: nn.Module, names: list[str]) -> float:
    """The share of the model's parameters (each counted once) that the modules `names` hold."""
    held = {id(p): p.numel() for name in names for p in model.get_submodule(name).parameters()}
    total = sum(p.numel() for p in model.parameters())
    return sum(held.values()) / total if total else 0.0


def runnable_alone(model: nn.Module, candidates: dict[str, list[str]],
                   calibration: dict[str, CallInputs]) -> dict[str, list[str]]:
    """The candidates that run when called alone on what the forward called them with. One whose call depends on
    what the forward sets around it (inside `torch.autocast` it is given bf16 inputs for fp32 weights) can be
    neither timed nor lowered alone, and its precision is the forward's own choice: it stays as it is.

    Raises:
        NoTunableModulesError: none of the candidates runs alone.
    """
    failing = {name: reason for name in candidates
               if (reason := failure_of(model.get_submodule(name), calibration[name]))}
    if failing:
        name, reason = next(iter(failing.items()))
        log.info("%d tunable modules fail when called alone on their inputs (e.g. under the forward's torch.autocast), "
                 "so they stay as they are: %s (%s)%s", len(failing), name, reason,
                 f" and {len(failing) - 1} more" if len(failing) > 1 else "")
    kept = {name: dtypes for name, dtypes in candidates.items() if name not in failing}
    if not kept:
        raise NoTunableModulesError(f"each of the {len(candidates)} modules the forward calls fails when called "
                                    f"alone on its inputs (e.g. {name}: {reason}): nothing is left to tune")
    return kept


def module_groups(candidates: dict[str, list[str]], config: TuningConfig,
                  model: nn.Module | None = None) -> list[list[str]]:
    """The user's groups, plus q/k/v groups (if enabled) and, given the model, tied groups (tied_groups) of
    modules no group before holds."""
    groups = [list(group) for group in config.groups]
    more = (qkv_groups(candidates) if config.group_qkv else []) + (tied_groups(model, candidates) if model else [])
    for group in more:
        if not {name for taken in groups for name in taken}.intersection(group):
            groups.append(group)
    return groups


def unit_name(members: list[str]) -> str:
    """`parent.{a,b,c}` for siblings, the members joined with `+` otherwise; a single module keeps its name."""
    if len(members) == 1:
        return members[0]
    parents = {name.rpartition(".")[0] for name in members}
    if len(parents) == 1:
        parent = parents.pop()
        return f"{parent + '.' if parent else ''}{{{','.join(n.rpartition('.')[2] for n in members)}}}"
    return "+".join(members)


def units_of(candidates: dict[str, list[str]], groups: list[list[str]]) -> dict[str, list[str]]:
    """{unit name: member modules} in model order; modules in no group are units of their own."""
    owner: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group:
            if name not in candidates:
                raise ConfigError(f"groups.{index}: {name!r} is not a tunable module of this model",
                                  [(f"groups.{index}", name)])
            if name in owner:
                raise ConfigError(f"groups.{index}: {name!r} is already in group {owner[name]}",
                                  [(f"groups.{index}", name)])
            owner[name] = index
    in_order = {index: [name for name in candidates if owner.get(name) == index] for index in range(len(groups))}
    units: dict[str, list[str]] = {}
    for name in candidates:
        if name not in owner:
            units[name] = [name]
        elif name == in_order[owner[name]][0]:   # a group stands where its first member does
            units[unit_name(in_order[owner[name]])] = in_order[owner[name]]
    return units


def shared_dtypes(candidates: dict[str, list[str]], members: list[str]) -> list[str]:
    """The dtypes every member of a unit may take, in the first member's order: the ones the unit may take."""
    return [d for d in candidates[members[0]] if all(d in candidates[n] for n in members)]
