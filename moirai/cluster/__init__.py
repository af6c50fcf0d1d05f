"""The cluster: devices and links (hardware), cluster files, detection of this host, device kinds, calibration,
and the cost model that prices an op graph on a cluster as a :class:`~moirai.planning.problem.Problem`."""
