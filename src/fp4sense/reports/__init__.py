"""What a person reads: the analysis report (``analysis``: Markdown, findings, plots)
and a checkpoint's model card (``model_card``)."""
