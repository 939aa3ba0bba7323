"""Labs: clusters built on this one machine, for the benchmarks and the tests alike.

* :mod:`bench.labs.network`: N "nodes" (network namespaces) joined by rate-limited links
  (veth + ``tc tbf``, loopback-range addresses); ``python -m bench.netlab`` runs any script
  or the benchmarks across it, ``tests/dist/labs/test_netlab.py`` the package.
* :mod:`bench.labs.slurm`: a real SLURM cluster (``slurmctld``, one ``slurmd`` per node, ``munge``)
  over the network lab's nodes; ``python -m bench.cluster_preemption`` and ``tests/dist/cluster/``
  run the package under it.

A lab needs root; each says why it cannot be built (``lab_unavailable``), gives every run
unique names, and is always torn down (``with``, ``atexit``, SIGTERM/SIGHUP/SIGINT), the
leftovers of a killed run removed by the next one. Ranks are started in a lab by
:func:`bench.harness.launch.run` (one ``torchrun`` per node).
"""
