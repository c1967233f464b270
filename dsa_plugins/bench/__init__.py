"""Benchmarks of the ops: the runner (timing, results files) and the suites behind
``python -m dsa_plugins bench``. The kernel drivers and layer benchmarks live in the repository's
``benchmarks/`` folder and use :mod:`.runner`."""
