"""The benchmark scripts: each runs from the repository root as ``python -m benchmarks.<name>``
(the index: ``benchmarks/README.md``). Not part of the installed package (setup.cfg lists only
``dapo_lightning``'s packages)."""
