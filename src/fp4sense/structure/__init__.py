"""What every stage knows of a model's structure, beneath them all: its decoder blocks and
units (``units``: fused groups, fingerprints), MoE experts, routers and the weights nothing
explains (``experts``), decoder blocks read from disk one at a time (``offload``), and how
files that may be shared name a model and a text (``lineage``: Hub ids, no local paths)."""
