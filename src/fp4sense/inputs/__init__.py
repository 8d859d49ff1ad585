"""What the stages read: the model (``models``: loading with every check), the text
(``texts``: calibration / evaluation windows per protocol), the bundled offline assets
(``assets``) and GGUF files converted to a Hugging Face folder (``gguf``)."""
