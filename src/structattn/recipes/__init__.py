"""Recipes: one module per paper experiment (config, build, train, evaluate)."""
