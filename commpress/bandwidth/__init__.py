"""The bandwidth-aware layer (``[bandwidth]``): measure the links between ranks
(``measurement``, ``topology``), model each setting's traffic (``traffic``), pick a method
per link (``planner``, ``ratios``), and reduce hierarchically inside and across the fast
domains (``hierarchical``, ``hierarchy``); ``layer`` runs it under the DDP hook."""
