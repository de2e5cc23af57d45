"""corral on a Ray cluster: a daemon per node, and the directory clients route by.

- :mod:`corral.cluster.bringup` — ``corral cluster up | status | down``.
- :mod:`corral.cluster.node` — the Ray actors: a daemon per node, and its supervisor.
- :mod:`corral.cluster.directory` — where a client finds each node's daemon, the
  cluster's token, and which nodes are alive.
- :mod:`corral.cluster.placement` — which node a new sandbox goes to.
- :mod:`corral.cluster.ids` — sandbox ids that name their node.

Ray is imported only when a cluster is used (``pip install 'corral[ray]'``). Nothing
here imports the daemon: the daemon runs as a process (``python -m corral.server``).
"""
