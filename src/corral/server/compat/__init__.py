"""Front-ends that let clients written for other sandbox services talk to corral.

Each module here serves one foreign API on the daemon's event loop, against the same
engine and admission control as corral's own API. They are imported only when the
daemon is asked to serve them, so their client libraries stay optional (the
``compat`` extra).
"""
