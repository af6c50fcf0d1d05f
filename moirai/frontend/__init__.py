"""The torch front end: trace a model with torch.export, check it, read its shapes, build the op graph and coarsen it.

Everything here imports torch; its output, an :class:`~moirai.frontend.graph.OpGraph`, is what the cluster's
cost model turns into a torch-free :class:`~moirai.planning.problem.Problem`.
"""
