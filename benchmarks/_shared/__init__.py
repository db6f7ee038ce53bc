"""Helpers that more than one benchmark script uses (a script never imports another script):
:mod:`.checkpoints` (the cached random checkpoints), :mod:`.flops` (GEMM peak, model FLOPs,
MFU), :mod:`.smollm2` (the SmolLM2 recipes, targets and model folder), :mod:`.quickstart` (the
quickstart's run override and val/acc curve), :mod:`.races` (the peer race's recipe, snapshots
and TRL settings). Timing, memory, tables and PNGs: :mod:`benchmarks._common`."""
