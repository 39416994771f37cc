"""Encoders and cells: LSTMN, PRPN parsing/reading networks."""
