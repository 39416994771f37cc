"""Models assembled from the attention layers (one per paper experiment family)."""

from .decoding import BeamResult, beam_search, greedy_search, reorder_batch_first
from .language_model import LM_CELLS, LanguageModel, RNNLanguageModel, detach_state
from .memory_qa import MEMORY_MODELS, MemoryQA, MemoryQAOutput, position_encoding
from .nli import INTRA_ATTENTION, DecomposableAttention, NLIOutput
from .parser import ArcParser, WordFeatures, parse_sentences, predict_heads
from .prpn_lm import PRPNConfig, PRPNLanguageModel, PRPNOutput, PRPNState
from .seq2seq import (
    ATTENTIONS,
    ENCODERS,
    SELF_ATTENTION,
    DecoderState,
    EncoderOutput,
    KeyedAttention,
    RecurrentEncoder,
    Seq2Seq,
    Seq2SeqConfig,
    StructuredSeq2Seq,
    make_attention,
    sequence_nll,
)

__all__ = [
    "ATTENTIONS",
    "ENCODERS",
    "LM_CELLS",
    "MEMORY_MODELS",
    "SELF_ATTENTION",
    "INTRA_ATTENTION",
    "ArcParser",
    "BeamResult",
    "DecomposableAttention",
    "NLIOutput",
    "DecoderState",
    "EncoderOutput",
    "KeyedAttention",
    "LanguageModel",
    "MemoryQA",
    "MemoryQAOutput",
    "PRPNConfig",
    "PRPNLanguageModel",
    "PRPNOutput",
    "PRPNState",
    "RNNLanguageModel",
    "RecurrentEncoder",
    "Seq2Seq",
    "Seq2SeqConfig",
    "StructuredSeq2Seq",
    "WordFeatures",
    "beam_search",
    "detach_state",
    "greedy_search",
    "make_attention",
    "parse_sentences",
    "position_encoding",
    "predict_heads",
    "reorder_batch_first",
    "sequence_nll",
]
