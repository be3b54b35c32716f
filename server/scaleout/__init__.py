"""``--api-server-count N`` (N > 1): one owner of the engine's life and N API processes, each with the door and
the guarded client (:mod:`server.scaleout.owner`, :mod:`server.scaleout.remote`)."""
