"""Plots of attention weights, latent structures and results (the figures of the papers).

* :func:`attention_heatmap` -- queries x memory weights (Kim et al. 2017, Figures 3-4);
  :func:`attention_panels` -- several such heatmaps side by side (Figure 4);
  :func:`translation_figures` -- Figure 4 and the Viterbi segmentation of one sentence; in
  :mod:`.heatmaps`;
* :func:`dependency_arcs` -- a MAP dependency parse as arcs, with other likely arcs
  (:mod:`.arcs`);
* :func:`fact_chain_graph` -- fact-sequence marginals of :class:`MemoryCRFAttention`
  (Figure 5; :mod:`.chains`);
* :func:`bracketed_tree` -- a binary constituency tree from :func:`split_tree` (PRPN;
  :mod:`.trees`);
* :func:`interaction_map` -- mean-field interactions J and their maximum-|J| spanning tree
  (Liu et al., section 3.3; :mod:`.mean_field`); :func:`mean_field_figures` -- one model's
  attention on one example: weights, after iteration 1, J per query, free energy per
  iteration (Figures 3-4);
* :func:`depth_curves`, :func:`grouped_bars` -- our results beside the paper's,
  :func:`line_curves` -- any metric against lengths or iterations, and
  :func:`training_curves` -- loss, learning rate and validation metrics of one or more
  runs from their ``metrics.jsonl`` (:mod:`.results`);
* :mod:`.babi` -- bAbI results beside the paper's Table 4 (the markdown table and its bar
  figures) and Figure 5 for one question; :mod:`.mfa` (Liu et al.'s Table 1 and Figure 1),
  :mod:`.nmt` (SAN Table 3, BLEU significance) and :mod:`.nli` (SAN Table 5) likewise: the
  recipes' result tables and figures from plain values (imported on use, not re-exported
  here);
* :func:`require_matplotlib` -- fail fast, before long work, when plots cannot be drawn;
* :func:`maximum_spanning_tree` -- re-exported from :mod:`structattn.structs.spanning_tree`
  (no matplotlib).

Every plotting function takes plain tensors / arrays / lists (index one batch item first),
writes the figure to ``path`` (parent folders are created; PNG unless the suffix names
another format matplotlib writes, such as ``.pdf`` or ``.svg``) and returns the
:class:`pathlib.Path`. matplotlib is an optional dependency (``pip install
"structattn[viz]"``), imported only when a plot is drawn: importing this package does not
import it. Figures are built with :class:`matplotlib.figure.Figure` on an Agg canvas, never
through ``pyplot``: no global backend switch (notebooks keep theirs) and no figure left
registered, so nothing leaks when many plots are written.
"""

from __future__ import annotations

from ..structs.spanning_tree import maximum_spanning_tree
from ._common import require_matplotlib
from .arcs import dependency_arcs
from .chains import fact_chain_graph
from .heatmaps import attention_heatmap, attention_panels, translation_figures
from .mean_field import interaction_map, mean_field_figures
from .results import depth_curves, grouped_bars, line_curves, training_curves
from .trees import bracketed_tree

__all__ = [
    "attention_heatmap",
    "attention_panels",
    "bracketed_tree",
    "depth_curves",
    "dependency_arcs",
    "fact_chain_graph",
    "grouped_bars",
    "interaction_map",
    "line_curves",
    "mean_field_figures",
    "maximum_spanning_tree",
    "require_matplotlib",
    "training_curves",
    "translation_figures",
]
