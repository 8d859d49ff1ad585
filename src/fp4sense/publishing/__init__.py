"""Readying a checkpoint for the Hugging Face Hub: checks and the upload (``hub``), and
how shared files name the base model and text without local paths (``lineage``)."""
