"""Where the work runs: the device and dtype (``devices``), the ranks of a torchrun launch
(``distributed``) and the memory a run will need, said before it starts (``memory``)."""
