"""``--servers K``: the model's parameters split across K parameter servers. Rank 0's
:class:`..server.Server` keeps its own share and coordinates (:mod:`.peers`: the other
servers, cuts for evaluations and checkpoints); each other server runs
:mod:`.partition_server`; :mod:`.partition` says which server owns which slice."""
