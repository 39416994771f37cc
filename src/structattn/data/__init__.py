"""Data sets and generators, one module each; loaders raise ``ValueError("<file>:<line>: ...")``
on malformed input.

- :mod:`~structattn.data.tree_transduction`: prefix -> infix formulas (Kim et al. 2017, 4.1).
- :mod:`~structattn.data.lm`: word-level LM corpora (PTB, WikiText-2), streams for truncated
  BPTT, perplexity.
- :mod:`~structattn.data.classification`: sentence / sentence-pair classification (SICK,
  SNLI, SST), padded length-bucketed batches.
- :mod:`~structattn.data.conllu`: CoNLL-U treebanks (UD English-EWT), UAS / LAS,
  projectivity.
- :mod:`~structattn.data.embeddings`: GloVe-format word vectors, embedding matrices with
  coverage counts and hashed Gaussian vectors for unknown words (imports torch, so it is not
  re-exported here).
- :mod:`~structattn.data.parallel`: line-aligned parallel corpora (small_parallel_enja),
  character or word sources, length filters, translation vocabularies.

Metrics shared across tasks (accuracy, confusion matrix, perplexity) are in
:mod:`structattn.metrics`.
"""

from .classification import (
    NLI_LABELS,
    SST_BINARY_LABELS,
    SST_FINE_LABELS,
    ClassificationBatch,
    ClassificationExample,
    LabelVocabulary,
    SSTNode,
    WordVocabulary,
    default_classification_data_dir,
    make_batches,
    parse_sst_tree,
    read_sick,
    read_snli,
    read_snli_jsonl,
    read_sst,
    split_holdout,
)
from .conllu import (
    PUNCT_TAGS,
    AttachmentScores,
    ConlluSentence,
    attachment_scores,
    check_tree,
    conllu_stats,
    default_ud_data_dir,
    format_conllu,
    heads_tensor,
    is_projective,
    non_projective_arcs,
    parse_conllu,
    read_conllu,
    write_conllu,
)
from .lm import (
    EOS,
    LM_SPLITS,
    UNK,
    BPTTWindow,
    LMCorpus,
    LMVocabulary,
    StreamEvaluation,
    batchify,
    bptt_windows,
    corpus_files,
    corpus_stats,
    default_lm_data_dir,
    evaluate_stream,
    line_nll,
    load_lm_corpus,
    read_lm_lines,
)
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
    # lm
    "EOS",
    "LM_SPLITS",
    "UNK",
    "BPTTWindow",
    "LMCorpus",
    "LMVocabulary",
    "StreamEvaluation",
    "batchify",
    "bptt_windows",
    "corpus_files",
    "corpus_stats",
    "default_lm_data_dir",
    "evaluate_stream",
    "line_nll",
    "load_lm_corpus",
    "read_lm_lines",
    # classification
    "NLI_LABELS",
    "SST_BINARY_LABELS",
    "SST_FINE_LABELS",
    "ClassificationBatch",
    "ClassificationExample",
    "LabelVocabulary",
    "SSTNode",
    "WordVocabulary",
    "default_classification_data_dir",
    "make_batches",
    "parse_sst_tree",
    "read_sick",
    "read_snli",
    "read_snli_jsonl",
    "read_sst",
    "split_holdout",
    # conllu
    "PUNCT_TAGS",
    "AttachmentScores",
    "ConlluSentence",
    "attachment_scores",
    "check_tree",
    "conllu_stats",
    "default_ud_data_dir",
    "format_conllu",
    "heads_tensor",
    "is_projective",
    "non_projective_arcs",
    "parse_conllu",
    "read_conllu",
    "write_conllu",
    # tree transduction
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
