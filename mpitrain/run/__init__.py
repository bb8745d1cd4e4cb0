"""The run inside the job: the session from start to finish (:mod:`.session`), its
signals, checkpoint and resume (:mod:`.signals`, :mod:`.checkpoint`, :mod:`.resume`),
and what rank 0 prints (:mod:`.console`)."""
