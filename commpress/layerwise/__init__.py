"""Per-tensor settings under a byte budget (``[layerwise]``, L-GreCo): candidates' errors
measured (``measure``), the knapsack solved (``knapsack``), the plan as data (``plan``), and the
DDP hook's method groups following it (``groups``)."""
