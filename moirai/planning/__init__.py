"""The torch-free planning core: the problem, objectives, bounds, the simulator, the stream, schedules, placers
and the MILP. Nothing under this folder imports torch (tests/test_package.py imports every module to check)."""
