"""Where the work runs: the device and dtype (``devices``), the ranks of a torchrun launch
(``distributed``), the memory a run will need, said before it starts (``memory``), and
the output folder a run writes, by the one ``--out`` rule (``outputs``), and the host
code the core finds through entry points, never by importing it (``hosts``)."""
