"""The engine: pytree math, PRNG derivation, sampling, cohorts, client mapping, server optimizers.

Nothing here knows about models, datasets or algorithms.
"""
