"""Encoders and cells: LSTMN (Cheng et al. 2016), PRPN parsing and reading networks."""

from .lstmn import (
    LSTMN,
    LSTMNCell,
    LSTMNDecoder,
    LSTMNDecoderOutput,
    LSTMNDecoderState,
    LSTMNDecoderStep,
    LSTMNOutput,
    LSTMNSource,
    LSTMNStackOutput,
    LSTMNState,
    LSTMNStep,
)
from .prpn import GatedAttentionOutput, GatedSelfAttention, ParsingNetwork, ParsingOutput

__all__ = [
    "LSTMN",
    "GatedAttentionOutput",
    "GatedSelfAttention",
    "LSTMNCell",
    "LSTMNDecoder",
    "LSTMNDecoderOutput",
    "LSTMNDecoderState",
    "LSTMNDecoderStep",
    "LSTMNOutput",
    "LSTMNSource",
    "LSTMNStackOutput",
    "LSTMNState",
    "LSTMNStep",
    "ParsingNetwork",
    "ParsingOutput",
]
