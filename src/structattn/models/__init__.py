"""Models assembled from the attention layers (one per paper experiment family)."""

from .memory_qa import MEMORY_MODELS, MemoryQA, MemoryQAOutput, position_encoding
from .seq2seq import ENCODERS, BeamResult, StructuredSeq2Seq

__all__ = [
    "ENCODERS",
    "MEMORY_MODELS",
    "BeamResult",
    "MemoryQA",
    "MemoryQAOutput",
    "StructuredSeq2Seq",
    "position_encoding",
]
