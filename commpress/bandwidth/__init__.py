"""The bandwidth-aware layer (``[bandwidth]``): measure the links (``measurement``, ``topology``),
model each setting's traffic (``traffic``), pick a method per link (``planner``, ``ratios``) and
reduce hierarchically (``hierarchical``, ``hierarchy``); ``layer`` runs it under the DDP hook."""
