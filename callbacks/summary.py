"""DAPOModelSummary: Lightning's model summary at the start of ``fit``, without FLOPs.

Lightning counts FLOPs only by running the module's ``example_input_array``; a DAPO module has
none (its inputs are rollouts), so every fit printed a ``FLOPs`` column of zeros and
``Total FLOPs: 0`` (issue 30). This summary prints the same table and parameter counts without
them. The ``dapo-lightning`` CLI puts it in place of the summary the Trainer adds by itself
(:func:`replace_default_summary`); a Python user can pass it to ``Trainer(callbacks=[...])``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.callbacks.model_summary import log as lightning_summary_log
from lightning.pytorch.utilities.model_summary.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)

from dapo_lightning.lightning_internals import (
    RICH_AVAILABLE,
    format_summary_table,
    summary_settings,
)

if RICH_AVAILABLE:  # an optional dependency, as in Lightning's own rich callbacks
    from rich import get_console
    from rich.table import Table

#: The column Lightning fills from the FLOP counter.
FLOPS_COLUMN = "FLOPs"
#: Columns of numbers, right-aligned as Lightning's rich summary aligns them.
_RIGHT = ("Params", "Params per Device", "In sizes", "Out sizes")


class DAPOModelSummary(ModelSummary):
    """The layer table and parameter counts of Lightning's model summary, without FLOPs.

    Args:
        max_depth: Depth of nested layers shown (0: no summary), as Lightning's.
        rich: Draw the table with rich, as Lightning does when rich is installed (its
            ``RichModelSummary``); False, or rich not installed: plain text through
            Lightning's logger.
        **summarize_kwargs: ``header_style`` of the rich table.

    Example::

        trainer = Trainer(enable_model_summary=True, callbacks=[DAPOModelSummary()])
    """

    def __init__(self, max_depth: int = 1, rich: bool = True, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.rich = rich and RICH_AVAILABLE

    def summarize(  # type: ignore[override]  # Lightning's is a staticmethod called on self
        self,
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        """Print the summary with the FLOPs column and total left out."""
        columns = [(name, values) for name, values in summary_data if name != FLOPS_COLUMN]
        counts = (total_parameters, trainable_parameters, model_size, total_training_modes)
        if self.rich:
            _print_rich(columns, *counts, summarize_kwargs.get("header_style", "bold magenta"))
            return
        table = format_summary_table(*counts[:3], total_training_modes, total_flops, *columns)
        lines = table.splitlines()
        lightning_summary_log.info("\n" + "\n".join(lines[:-1]))  # the last: "Total Flops"


def _print_rich(
    columns: list[tuple[str, list[str]]],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    header_style: str,
) -> None:
    """The table and totals as Lightning's ``RichModelSummary`` draws them."""
    console = get_console()
    table = Table(header_style=header_style)
    for name, _ in columns:
        style = {"style": "dim"} if name == " " else {}
        table.add_column(name, justify="right" if name in _RIGHT else "left", **style)
    for row in zip(*(values for _, values in columns)):
        table.add_row(*row)
    console.print(table)
    grid = Table.grid(expand=True)
    grid.add_column()
    frozen = total_parameters - trainable_parameters
    for label, value in (
        ("Trainable params", get_human_readable_count(int(trainable_parameters))),
        ("Non-trainable params", get_human_readable_count(int(frozen))),
        ("Total params", get_human_readable_count(int(total_parameters))),
        ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
        ("Modules in train mode", total_training_modes["train"]),
        ("Modules in eval mode", total_training_modes["eval"]),
    ):
        grid.add_row(f"[bold]{label}[/]: {value}")
    console.print(grid)


def replace_default_summary(trainer: pl.Trainer) -> None:
    """Put a :class:`DAPOModelSummary` in place of the ``ModelSummary`` / ``RichModelSummary``
    the Trainer added (``enable_model_summary``), with its depth and settings; a summary
    callback of another class is left alone."""
    for i, callback in enumerate(trainer.callbacks):
        if type(callback) in (ModelSummary, RichModelSummary):
            max_depth, summarize_kwargs = summary_settings(callback)
            trainer.callbacks[i] = DAPOModelSummary(
                max_depth, rich=isinstance(callback, RichModelSummary), **summarize_kwargs
            )
