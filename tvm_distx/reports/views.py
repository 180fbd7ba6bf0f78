"""Sharding views: tables of who holds what, pictures of a tensor cut across ranks.

What ``jax.debug.visualize_array_sharding`` and DTensor's ``visualize_sharding``
give their users, for tvm-distx programs:

* :func:`sharding_tables`: per function, every value with its global shape,
  mesh, placement, local shape and the reason (the rows of
  :func:`tvm_distx.reports.explain`), as rich tables;
* :func:`show_tensor_sharding` / :func:`plot_tensor_sharding`: how one tensor
  is cut into blocks and which devices hold each block, in the terminal or as
  a matplotlib figure (PNG);
* :func:`comm_table`: the comm report with readable sizes and the total.

The command line shows them with ``tvm-distx explain`` and ``tvm-distx plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
import os
from typing import Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tvm_distx.errors import ArgumentError
from tvm_distx.layout import TensorSharding, shard_bounds
from tvm_distx.reports.explain import _shape, explain

__all__ = ["Block", "tensor_blocks", "sharding_tables", "comm_table", "tensor_grid",
           "show_tensor_sharding", "plot_tensor_sharding", "value_sharding", "show_value",
           "plot_value", "human_bytes"]

logger = logging.getLogger(__name__)

_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan",
            "bright_magenta", "bright_green", "bright_yellow", "bright_blue", "bright_red")


@dataclass(frozen=True)
class Block:
    """One block of a tensor (in the two dimensions drawn) and the devices holding it."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    devices: tuple[int, ...]


def tensor_blocks(sharding: TensorSharding, shape: Sequence[int],
                  dims: tuple[int, int] | None = None) -> list[Block]:
    """The blocks of a tensor along two of its dimensions, each with the devices holding it.

    Parameters
    ----------
    sharding : TensorSharding
    shape : sequence of int
        The global static shape.
    dims : (int, int), optional
        The two dimensions drawn; the last two by default (a 1-D tensor is
        drawn as one row).

    Returns
    -------
    list of Block
        In row-major order of the blocks.
    """
    shape = tuple(int(n) for n in shape)
    if len(shape) == 1:
        rows_of = lambda box: (0, 1)  # noqa: E731 - a 1-D tensor is one row
        cols_of = lambda box: box[0]  # noqa: E731
    else:
        r, c = dims if dims is not None else (len(shape) - 2, len(shape) - 1)
        rows_of = lambda box: box[r]  # noqa: E731
        cols_of = lambda box: box[c]  # noqa: E731
    holders: dict[tuple, list[int]] = {}
    for device in sharding.mesh.device_range:
        box = shard_bounds(sharding, shape, device)
        holders.setdefault((rows_of(box), cols_of(box)), []).append(device)
    return [Block(rows, cols, tuple(devices))
            for (rows, cols), devices in sorted(holders.items())]


def _devices(devices: Sequence[int]) -> str:
    return ",".join(str(d) for d in devices)


def tensor_grid(sharding: TensorSharding, shape: Sequence[int],
                dims: tuple[int, int] | None = None):
    """A rich table: one cell per block, naming its element ranges and the devices."""

    blocks = tensor_blocks(sharding, shape, dims)
    rows = sorted({b.rows for b in blocks})
    cols = sorted({b.cols for b in blocks})
    table = Table(title=f'{sharding.placement} on {sharding.mesh.name or sharding.mesh.shape}',
                  show_header=False, box=box.SQUARE, show_lines=True)
    for _ in cols:
        table.add_column(justify="center", min_width=9)
    colours = {}
    by_place = {(b.rows, b.cols): b for b in blocks}
    for r in rows:
        cells = []
        for c in cols:
            block = by_place[(r, c)]
            colour = colours.setdefault(block.devices, _COLOURS[len(colours) % len(_COLOURS)])
            label = f"dev {_devices(block.devices)}\n[{r[0]}:{r[1]}, {c[0]}:{c[1]}]"
            cells.append(Text(label, style=f"bold {colour}"))
        table.add_row(*cells)
    return table


def show_tensor_sharding(sharding: TensorSharding, shape: Sequence[int], *,
                         dims: tuple[int, int] | None = None, console=None) -> None:
    """Print how a tensor is cut across the devices of its mesh (see :func:`tensor_grid`)."""

    (console or Console()).print(tensor_grid(sharding, shape, dims))


def plot_tensor_sharding(sharding: TensorSharding, shape: Sequence[int], *,
                         dims: tuple[int, int] | None = None,
                         path: str | os.PathLike | None = None, ax=None):
    """Draw the blocks of a tensor, to scale, labelled with their devices.

    Parameters
    ----------
    sharding, shape, dims
        As :func:`tensor_blocks`.
    path : path, optional
        Also save the figure there (PNG by the file's suffix).
    ax : matplotlib.axes.Axes, optional
        Draw into it instead of a new figure.

    Returns
    -------
    matplotlib.figure.Figure
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    blocks = tensor_blocks(sharding, shape, dims)
    if ax is None:
        figure = Figure(figsize=(4, 4))
        ax = figure.add_subplot()
    else:
        figure = ax.figure
    palette = matplotlib.colormaps["tab20"]
    colours: dict[tuple, int] = {}
    for block in blocks:
        index = colours.setdefault(block.devices, len(colours))
        (r0, r1), (c0, c1) = block.rows, block.cols
        ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=palette(index % 20),
                               edgecolor="black"))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, f"dev {_devices(block.devices)}",
                ha="center", va="center", fontsize=9)
    rows_end = max(b.rows[1] for b in blocks)
    cols_end = max(b.cols[1] for b in blocks)
    ax.set_xlim(0, cols_end)
    ax.set_ylim(rows_end, 0)
    ax.set_title(f'"{sharding.placement}" on {sharding.mesh.name or sharding.mesh.shape}')
    if path is not None:
        figure.savefig(path)
    return figure


def sharding_tables(mod) -> list:
    """One rich table per function: value, global shape, mesh, placement, local shape, why.

    Parameters
    ----------
    mod : tvm.IRModule
        The annotated module (before propagation), as :func:`tvm_distx.reports.explain` takes.
    """


    report = explain(mod)
    tables = []
    for name in dict.fromkeys(r.function for r in report.rows):
        table = Table(title=f"function {name}", title_justify="left")
        for header in ("value", "global shape", "mesh", "placement", "local shape", "why"):
            table.add_column(header, overflow="fold")
        for r in report.for_function(name):
            table.add_row(r.value, _shape(r.global_shape), r.mesh, r.placement,
                          _shape(r.local_shape), r.reason)
        tables.append(table)
    return tables


def human_bytes(count: int) -> str:
    """``65536`` -> ``"64.0 KiB"``."""
    size = float(count)
    if size < 1024:
        return f"{int(size)} B"
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"


def comm_table(report):
    """The comm report as a rich table, with readable sizes and a total row."""

    table = Table(title="communication (bytes received per rank)", title_justify="left",
                  show_footer=True)
    columns = ("function", "value", "mesh axis", "collective", "from", "to")
    for index, header in enumerate(columns):
        table.add_column(header, footer="total" if index == 0 else "")
    static = all(not r.per for r in report.rows)
    total = report.total_bytes_per_rank
    table.add_column("bytes/rank", justify="right",
                     footer=f"{total:,} ({human_bytes(total)})" if static else report.total_text)
    for r in report.rows:
        table.add_row(r.function, r.value, "-" if r.mesh_axis is None else str(r.mesh_axis),
                      r.collective, r.src, r.dst,
                      r.bytes_text if r.per else
                      f"{r.bytes_per_rank:,} ({human_bytes(r.bytes_per_rank)})")
    return table


def value_sharding(mod, function: str, value: str) -> tuple[TensorSharding, tuple[int, ...]]:
    """The sharding and global shape of one value of an annotated module.

    Raises
    ------
    tvm_distx.errors.ArgumentError
        If the function has no such tensor value.
    """

    report = explain(mod)
    try:
        row = report.row(function, value)
    except KeyError:
        known = ", ".join(r.value for r in report.for_function(function)) or "none"
        raise ArgumentError(f"function '{function}' has no tensor value '{value}'",
                            hint=f"its values are: {known}") from None
    return row.sharding, row.global_shape


def show_value(mod, function: str, value: str, *, console=None) -> None:
    """Print how one value of an annotated module is cut across its mesh."""
    sharding, shape = value_sharding(mod, function, value)
    show_tensor_sharding(sharding, shape, console=console)


def plot_value(mod, function: str, value: str, *, path: str | os.PathLike | None = None):
    """Draw how one value of an annotated module is cut across its mesh."""
    sharding, shape = value_sharding(mod, function, value)
    return plot_tensor_sharding(sharding, shape, path=path)
