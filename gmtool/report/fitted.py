"""A terminal table that fits the width it is printed at: rather than squeeze every column until numbers read
`0.…`, it drops whole columns, the least important first, and says under the table which it left out.

A FittedTable is a rich renderable: it is laid out at print time for the console's width (80 on a small
terminal, wide when the output goes to a file), so the table functions need not know where they print."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.markup import escape
from rich.table import Table
from rich.text import Text

EMPTY_CELLS = {"", "-", "-/-"}


@dataclass(frozen=True)
class Column:
    header: str
    rank: int = 0  # 0: never dropped; the highest rank is dropped first
    justify: str = "right"
    legend: str | None = None  # what the column means, for the line under the table


def _cell_width(cell: str) -> int:
    return Text.from_markup(cell).cell_len


def _header_width(header: str) -> int:
    return max(len(w) for w in header.split())  # headers may wrap at their spaces; cells never do


class FittedTable:
    """rows: lists of cells (rich markup allowed), None for a section line."""

    def __init__(self, title: str, columns: list[Column], rows: list[list[str] | None]):
        self.title, self.columns, self.rows = title, columns, rows

    def widths(self) -> list[int]:
        body = [r for r in self.rows if r is not None]
        return [max([_header_width(c.header)] + [_cell_width(r[i]) for r in body]) for i, c in enumerate(self.columns)]

    def shown(self, width: int) -> list[int]:
        """Indices of the columns kept at this width: while the table is too wide, drop the columns that show
        nothing, then the highest rank (the rightmost first among equals). Rank 0 stays whatever the width."""
        widths = self.widths()
        body = [r for r in self.rows if r is not None]
        empty = {i for i in range(len(self.columns)) if all(r[i].strip() in EMPTY_CELLS for r in body)}
        keep = list(range(len(self.columns)))
        # heavy box: a border left of each column and one at the end, a space of padding on each side
        while sum(widths[i] + 3 for i in keep) + 1 > width:
            droppable = [i for i in keep if self.columns[i].rank > 0]
            if not droppable:
                break
            keep.remove(max(droppable, key=lambda i: (i in empty, self.columns[i].rank, i)))
        return keep

    def table(self, width: int) -> Table:
        """Each kept column at a fixed width (rich's own squeezing would cut numbers): its widest cell, widened
        towards its header's full length while the width allows, so headers wrap only when they must."""
        keep = self.shown(width)
        widths = self.widths()
        spare = width - sum(widths[i] + 3 for i in keep) - 1
        for i in keep:
            more = max(0, min(len(self.columns[i].header) - widths[i], spare))
            widths[i] += more
            spare -= more
        t = Table(title=escape(self.title), caption=self.caption(keep, width), caption_justify="left")
        for i in keep:
            c = self.columns[i]
            t.add_column(c.header, justify=c.justify, width=widths[i], overflow="fold")
        for row in self.rows:
            if row is None:
                t.add_section()
            else:
                t.add_row(*(row[i] for i in keep))
        return t

    def caption(self, keep: list[int], width: int) -> str | None:
        parts = [f"{c.header}: {c.legend}" for i, c in enumerate(self.columns) if i in keep and c.legend]
        dropped = [c.header for i, c in enumerate(self.columns) if i not in keep]
        if dropped:
            parts.append(f"not shown at {width} columns: {', '.join(dropped)} (the results files have them)")
        return "; ".join(parts) or None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)
