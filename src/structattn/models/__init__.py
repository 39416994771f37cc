"""Models assembled from the attention layers (one per paper experiment family)."""

from .seq2seq import ENCODERS, BeamResult, StructuredSeq2Seq

__all__ = ["ENCODERS", "BeamResult", "StructuredSeq2Seq"]
