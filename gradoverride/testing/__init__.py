"""Tools to check backward rules: `gradoverride.testing.strategies` (Hypothesis strategies
for tensors; needs the `hypothesis` package)."""
