"""Readying a checkpoint for the Hugging Face Hub: checks and the upload (``hub``), what a
folder may publish (``contents``: allowlist, secrets, links, records checked), and
how shared files name the base model and text without local paths (``lineage``)."""
