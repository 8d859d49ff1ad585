"""Readying a checkpoint for the Hugging Face Hub: checks and the upload (``hub``) and what
a folder may publish (``contents``: the allowlist, secrets, links, plan.json and
recipe.yaml checked against the tensors). How shared files name the base model and the
text is :mod:`fp4sense.structure.lineage`."""
