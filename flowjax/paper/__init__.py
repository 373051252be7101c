"""The paper's reproduction: the experiment plan, the paper's figures, seed statistics,
tables and plots. Nothing here is imported by the engine."""
