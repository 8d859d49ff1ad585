"""What the stages read: the model (``models``: loading with every check), the text
(``texts``: calibration / evaluation windows per protocol), the bundled offline assets
(``assets``), GGUF files converted to a Hugging Face folder (``gguf``) with a tokenizer
that tokenizes as the GGUF does (``gguf_tokenizer``) and MoE experts
in the per-expert layout their host quantizes (``moe``)."""
