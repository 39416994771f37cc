"""Encoders and cells: LSTMN (Cheng et al. 2016), PRPN parsing and reading networks, the
gated-feedback and depth-gated LSTMs (the 3-layer baselines of the LSTMN paper)."""

from .deep_lstm import DepthGatedLSTM, GatedFeedbackLSTM
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
    "DepthGatedLSTM",
    "GatedAttentionOutput",
    "GatedFeedbackLSTM",
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
