"""Where each weight lives on the device mesh, and the checks that no weight lands where it should
not: before the first step, never a silent replication or an indivisible shape deep in JAX.

A layout is a list of rules, ``(pattern, axes)``: a variable whose path the pattern matches in full
is split along each dimension over the mesh axis named there (``"data"``, ``"model"`` or None).
Three sources (``runtime.layout``):

- ``preset``: the backbone's own ``get_layout_map`` (KerasHub's Gemma, Llama, Qwen), read into rules;
- ``auto``: tpurun's rule for any Keras model (:func:`auto_axes`);
- the config's own list.

:class:`Placer` is what the Keras distribution asks for each variable as it is created: it finds the
rule, checks the shape divides, and remembers the placement. :func:`check_placements` then looks at
the whole model: a rule of the config's that matched nothing, or a large variable left replicated
(keras-hub#2806: a renamed variable stops matching its rule and the model loads fully replicated,
then dies out of memory with no hint), is an error naming the variables and the rule that would
split them.

Imports no framework: the Keras side (the distribution) is :mod:`tpurun.runtime.mesh`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tpurun.errors import ConfigError
from tpurun.runtime.auto_layout import Axes, Weight, auto_rule
from tpurun.runtime.sizes import size

Rule = tuple[str, Axes]  # (pattern matched in full against the variable path, axes per dimension)

#: A weight of 2 or more dimensions at least this big (bytes) must be split when the model axis
#: is over 1 (vectors, biases and norms, stay whole: they are a hidden size, small)...
LARGE_BYTES = 1024 * 1024
#: ...or at least this share of the model's bytes (small models: a tiny preset in a rehearsal).
LARGE_SHARE = 0.01


@dataclass(frozen=True)
class Placement:
    """One variable as the mesh holds it."""

    path: str
    shape: tuple[int, ...]
    itemsize: int
    axes: Axes  # per dimension: the mesh axis it is split over, or None
    rule: str | None  # the pattern that placed it, or "auto"; None: no rule matched (replicated)
    how: str = ""  # which rule, as the placement listing says it: "auto: attention heads"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def replicated(self) -> bool:
        return not any(self.axes)


def auto_axes(shape: Sequence[int], model: int, weight: Weight | None = None) -> Axes:
    """tpurun's ``auto`` rule (:mod:`tpurun.runtime.auto_layout`): attention heads where the layer
    says which dimension counts them, an embedding's vocabulary, else the largest dimension the
    model axis divides (a Dense kernel's units, a convolution's filters); vectors (biases, norms)
    and weights no dimension of which divides stay replicated."""
    return auto_rule(shape, model, weight)[0]


def _generalized(path: str) -> str:
    """A pattern for a variable and its siblings: ``decoder_block_3/ffw/kernel`` ->
    ``decoder_block_\\d+/ffw/kernel``."""
    return re.sub(r"_\d+(?=/|$)", r"_\\d+", re.escape(path).replace(r"\/", "/"))


def rule_text(pattern: str, axes: Axes) -> str:
    """A rule as the config writes it."""
    shown = ", ".join("null" if a is None else a for a in axes)
    return f"{{pattern: '{pattern}', axes: [{shown}]}}"  # single quotes: YAML keeps \\d as is


class Placer:
    """The layout, asked once per variable as Keras creates it (see :mod:`tpurun.runtime.mesh`).

    Three layers, first match wins: the config's own rules (``runtime.layout`` as a list; two of
    them matching one variable is an error), then the preset's map, then (``auto``) tpurun's rule.
    So a config adds or overrides a rule or two on top of a preset's layout, and a rule whose axes
    are all null keeps a variable whole on purpose.
    """

    def __init__(
        self,
        rules: Sequence[Rule],
        mesh: dict[str, int],
        source: str,
        preset: Sequence[Rule] = (),
        auto: bool = False,
    ):
        self.rules = list(rules)  # the config's
        self.preset = list(preset)  # the backbone's get_layout_map
        self.mesh = mesh  # {"data": d, "model": m}
        self.source = source  # "the preset's (GemmaBackbone)", "auto", "runtime.layout"
        self.auto = auto
        self.placements: dict[str, Placement] = {}

    def _rule(
        self, path: str, shape: tuple[int, ...], weight: Weight | None
    ) -> tuple[str | None, Axes, str]:
        for rules in (self.rules, self.preset):
            matched = [(p, a) for p, a in rules if re.fullmatch(p, path)]
            mine = rules is self.rules
            if len(matched) > 1:
                key = "runtime.layout" if mine else f"the layout {self.source}"
                raise ConfigError(
                    [
                        f"{key}: the variable {path} matches {len(matched)} rules "
                        f"({', '.join(repr(p) for p, _ in matched)}); each variable may match one. "
                        "Make the patterns narrower."
                    ]
                )
            if matched:
                pattern, axes = matched[0]
                return pattern, axes, f"{'runtime.layout' if mine else self.map}: {pattern}"
        if self.auto:
            axes, why = auto_rule(shape, self.mesh["model"], weight)
            return "auto", axes, f"auto: {why}"
        return None, (None,) * len(shape), "whole (no rule matches)"

    @property
    def map(self) -> str:
        """The preset's layout map, as the listing names it: ``GemmaBackbone.get_layout_map``."""
        name = re.search(r"\((\w+)\)", self.source)
        return f"{name.group(1)}.get_layout_map" if name else self.source

    def place(
        self, path: str, shape: Sequence[int], itemsize: int, weight: Weight | None = None
    ) -> Axes:
        """The axes of the variable at ``path`` (``weight``: what its layer says of its
        dimensions, for the ``auto`` rule).

        Raises:
            ConfigError: two rules match it, a rule's axes do not fit its dimensions, or a
                dimension is not divisible by the axis it is split over.
        """
        shape = tuple(int(n) for n in shape)
        rule, axes, how = self._rule(path, shape, weight)
        if len(axes) != len(shape):
            raise ConfigError(
                [
                    f"runtime.layout: the rule {rule!r} gives {len(axes)} axes, and the variable "
                    f"{path} it matches has {len(shape)} dimensions {list(shape)}. Give one entry "
                    "(data, model or null) per dimension."
                ]
            )
        for dim, (n, axis) in enumerate(zip(shape, axes, strict=True)):
            if axis and n % self.mesh[axis]:
                raise ConfigError([_indivisible(path, shape, dim, axes, rule, self)])
        self.placements[path] = Placement(path, shape, itemsize, tuple(axes), rule, how)
        return tuple(axes)

    def deliberate(self, placement: Placement) -> bool:
        """Whether the config's own rule placed it (whole on purpose, if its axes are null)."""
        return placement.rule in {p for p, _ in self.rules}


def _indivisible(
    path: str, shape: tuple[int, ...], dim: int, axes: Axes, rule: str | None, placer: Placer
) -> str:
    n, axis, mesh = shape[dim], axes[dim], placer.mesh
    sizes = [k for k in range(2, n + 1) if n % k == 0] or [1]
    kv = re.search(r"/(key|value)/", path)
    gqa = (
        " (grouped-query attention: fewer key/value heads than the model axis; keras-hub#1613)"
        if kv
        else ""
    )
    unsplit = tuple(None if i == dim else a for i, a in enumerate(axes))
    pattern = _generalized(path)
    if kv:  # keys and values have the same heads: one rule for both
        pattern = pattern.replace(f"/{kv.group(1)}/", "/(key|value)/")
    return (
        f"runtime.mesh: {path} has shape {list(shape)}, and its dimension {dim} ({n}) does not "
        f"split over the {axis} axis of {mesh[axis]} devices{gqa}; the layout is {placer.source}. "
        f"{axis.capitalize()} axis sizes that divide it: {', '.join(map(str, sizes))}. Set "
        f"runtime.mesh.{axis} to one of them, or add to runtime.layout a rule that leaves that "
        f"dimension whole (runtime.layout's rules come first): [{rule_text(pattern, unsplit)}]."
    )


def _of(placer: Placer, paths: Sequence[str] | None) -> list[Placement]:
    if paths is None:
        return list(placer.placements.values())
    return [placer.placements[p] for p in paths if p in placer.placements]


def check_placements(
    placer: Placer, paths: Sequence[str], exempt: Sequence[str] = (), config_rules: bool = False
) -> None:
    """After the model is built: every rule of the config's matched a variable, and no large
    variable is left replicated while the model axis is over 1.

    Args:
        paths: the model's variables (an optimizer's counters are placed too, and do not count).
        exempt: paths allowed to stay whole (LoRA adapters: rank-sized, trained, small).
        config_rules: the rules are the config's own (``runtime.layout`` as a list): each must
            match. A preset's map may name layers a smaller model of its family does not have.

    Raises:
        ConfigError: a rule matched nothing; large variables are replicated.
    """
    placements = _of(placer, paths)
    if config_rules:
        check_rules_match(placer, paths)
    total = sum(p.nbytes for p in placements)
    large = min(LARGE_BYTES, LARGE_SHARE * total)
    whole = [
        p for p in placements
        if p.replicated and p.nbytes >= large and len(p.shape) >= 2
        and p.path not in set(exempt) and not placer.deliberate(p)
    ]  # fmt: skip
    if placer.mesh["model"] > 1 and whole:
        raise ConfigError([_replicated(whole, placer, large)])


def check_rules_match(placer: Placer, paths: Sequence[str] | None = None) -> None:
    """Every rule of the config's placed one of ``paths`` (None: all the placed variables).

    Raises:
        ConfigError: a rule matched none, with the paths it comes closest to, or the wider
            pattern to write where it matches part of a path only (re.search's match).
    """
    placements = _of(placer, paths)
    used = {p.rule for p in placements}
    for pattern, _ in placer.rules:
        if pattern not in used:
            raise ConfigError([_unmatched(pattern, [p.path for p in placements])])


def _unmatched(pattern: str, paths: list[str]) -> str:
    import difflib

    partly = [p for p in paths if re.search(pattern, p)]
    if partly:  # what Keras before 3.14 would have matched (re.search; keras#22164)
        inner = f"({pattern})" if "|" in pattern else pattern
        wider = next(
            (w for w in (f".*{inner}", f"{inner}.*") if all(re.fullmatch(w, p) for p in partly)),
            f".*{inner}.*",
        )
        return (
            f"runtime.layout: the pattern {pattern!r} matches no whole variable path: tpurun "
            f"matches each pattern against the whole path (re.fullmatch, as Keras 3.14 and later "
            f"match LayoutMap keys, keras#22164), and it matches only part of {len(partly)} "
            f"path(s), such as {partly[0]}. To place those, write {wider!r}."
        )
    close = difflib.get_close_matches(pattern, paths, n=5, cutoff=0.3) or paths[:5]
    return (
        f"runtime.layout: the pattern {pattern!r} matches no variable of this model (a pattern "
        f"must match a whole path). The closest of its {len(paths)} paths: {', '.join(close)}. "
        "Correct the pattern, or remove the rule."
    )


def _replicated(whole: list[Placement], placer: Placer, large: float) -> str:
    whole = sorted(whole, key=lambda p: -p.nbytes)
    shown = "; ".join(f"{p.path} {list(p.shape)} ({size(p.nbytes)})" for p in whole[:4])
    more = f" and {len(whole) - 4} more" if len(whole) > 4 else ""
    suggestions = []
    for p in whole:
        axes = auto_axes(p.shape, placer.mesh["model"])
        rule = rule_text(_generalized(p.path), axes) if any(axes) else None
        if rule and rule not in suggestions:
            suggestions.append(rule)
    fix = (
        f"A rule that would split them: {'; '.join(suggestions[:3])} (runtime.layout as a list"
        f"{'' if placer.auto else ', or runtime.layout: auto'})."
        if suggestions
        else f"No dimension of theirs divides the model axis ({placer.mesh['model']}); choose a "
        "model axis that divides one."
    )
    return (
        f"runtime.layout ({placer.source}) leaves {len(whole)} large variable(s) whole on every "
        f"device: {shown}{more}. Each is at least {size(int(large))}: replicated, the model "
        f"would not shrink with the model axis (a renamed layer no longer matching its rule does "
        f"this, keras-hub#2806). {fix}"
    )
