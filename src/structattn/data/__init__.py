"""Data sets and generators, one module each; loaders raise ``ValueError("<file>:<line>: ...")``
on malformed input.

- :mod:`~structattn.data.tree_transduction`: prefix -> infix formulas (Kim et al. 2017, 4.1).
"""

from .tree_transduction import (
    Expr,
    GeneratorConfig,
    Pair,
    Vocabulary,
    generate_splits,
    parse_infix,
    parse_prefix,
    random_expression,
    read_pairs,
    read_splits,
    to_infix,
    to_prefix,
    write_splits,
)

__all__ = [
    "Expr",
    "GeneratorConfig",
    "Pair",
    "Vocabulary",
    "generate_splits",
    "parse_infix",
    "parse_prefix",
    "random_expression",
    "read_pairs",
    "read_splits",
    "to_infix",
    "to_prefix",
    "write_splits",
]
