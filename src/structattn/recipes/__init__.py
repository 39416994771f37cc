"""Paper experiments, registered by name (``structattn list``).

A new recipe is one module ending with a :class:`~structattn.recipes.base.Recipe` record
named ``RECIPE`` plus one line in :data:`BUILTIN`; code outside the package registers its own
with :func:`register`. The command line is generated from the registry.
"""

from __future__ import annotations

import importlib

from .base import GridAxis, Preset, Recipe

__all__ = ["BUILTIN", "GridAxis", "Preset", "Recipe", "get", "names", "register", "unregister"]

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

_REGISTRY: dict[str, Recipe] = {}
_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in BUILTIN:
        recipe = importlib.import_module(module).RECIPE
        _REGISTRY.setdefault(recipe.name, recipe)


def register(recipe: Recipe, replace: bool = False) -> Recipe:
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


def get(name: str) -> Recipe:
    """The recipe ``name``; ``ValueError`` listing the known ones otherwise."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]
