"""The recipes' formulas, each written once over a backend `b` (`gradoverride._ops`): the
torch recipes call them with torch's backend, the recipes on TensorFlow and JAX arrays
(`gradoverride.recipes._on_arrays`) with theirs. No framework is imported here."""
