"""What a person reads: the analysis report (``analysis``: Markdown, findings; ``plots``;
``moe``: experts, routing coverage, what stays in 16 bits; ``rotation``: what a
block-Hadamard rotation buys per unit), a checkpoint's model card
(``model_card``), and the FP4 training report and plots (``training``)."""
