"""Paper experiments, registered by name (``structattn list``).

A new recipe is one module ending with a :class:`~structattn.recipes.base.Recipe` record
named ``RECIPE`` plus one line in :data:`BUILTIN`; code outside the package registers its own
with :func:`register`. The command line is generated from the registry.

The record's core is what every recipe has; reporting and extra commands are optional::

    RECIPE = Recipe(
        name="my-recipe", summary="Paper, Table 1: what is measured",
        config=MyConfig,  # dataclass: paper defaults, `train: TrainConfig`, maybe `runs: int`
        presets={"paper": Preset(MyConfig(), "..."), "cpu": ..., "quick": ...},
        grid=(GridAxis("variants", "model", ("lstm", "crf")),),  # last axis: the variant
        train=train, score=score, evaluate=evaluate,
        report=Reporting(table=my_table, paper={...}),  # optional
        tools=Tools(viz=viz, viz_options=VizOptions),  # optional
    )

Shared pieces: :mod:`~structattn.recipes.runs` (run directories, seeded runs, ``reproduce``),
:mod:`~structattn.recipes.tables` (selection, summaries, Markdown tables),
:mod:`~structattn.recipes.config` (config dataclasses <-> flags and JSON).
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

from .base import GridAxis, Preset, Recipe, RecipeConfig, Reporting, Tools

__all__ = [
    "BUILTIN",
    "GridAxis",
    "Preset",
    "Recipe",
    "Reporting",
    "Tools",
    "get",
    "names",
    "register",
    "unregister",
]

C = TypeVar("C", bound=RecipeConfig)

#: modules of the built-in recipes, each defines ``RECIPE`` (one line per recipe)
BUILTIN: tuple[str, ...] = (
    "structattn.recipes.tree_transduction",
    "structattn.recipes.babi",
    "structattn.recipes.lstmn_lm",
    "structattn.recipes.lstmn_sst",
    "structattn.recipes.lstmn_nli",
    "structattn.recipes.nmt",
    "structattn.recipes.mfa",
    "structattn.recipes.prpn",
    "structattn.recipes.nli",
    "structattn.recipes.parser",
    "structattn.recipes.mfa_lm",
)

_REGISTRY: dict[str, Recipe[Any]] = {}  # recipes of any config type
_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in BUILTIN:
        recipe = importlib.import_module(module).RECIPE
        _REGISTRY.setdefault(recipe.name, recipe)


def register(recipe: Recipe[C], replace: bool = False) -> Recipe[C]:
    """Add ``recipe`` under ``recipe.name`` (an existing name is an error unless ``replace``)."""
    _load_builtin()
    if not isinstance(recipe, Recipe):
        raise TypeError(f"`recipe` must be a Recipe, got {type(recipe).__name__}")
    if recipe.name in _REGISTRY and not replace and _REGISTRY[recipe.name] is not recipe:
        raise ValueError(f"a recipe named {recipe.name!r} is already registered")
    _REGISTRY[recipe.name] = recipe
    return recipe


def unregister(name: str) -> None:
    """Remove the recipe ``name`` (tests register temporary ones)."""
    _load_builtin()
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    """Registered recipe names, in registration order."""
    _load_builtin()
    return list(_REGISTRY)


def get(name: str) -> Recipe[Any]:
    """The recipe ``name``; ``ValueError`` listing the known ones otherwise."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]
