"""Per-tensor settings under a byte budget (``[layerwise]``, L-GreCo): each tensor's error
under every candidate setting measured (``measure``), the least total error within the
budget solved (``knapsack``), the plan kept and priced (``plan``), and the DDP hook's
method groups following it (``groups``)."""
