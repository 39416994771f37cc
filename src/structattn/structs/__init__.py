"""Pure dynamic programs over log-potentials (no parameters, no nn.Modules)."""
