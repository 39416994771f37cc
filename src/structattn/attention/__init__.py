"""Attention layers (nn.Modules): a scorer makes potentials, a normaliser turns them into weights."""
