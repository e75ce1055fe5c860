"""Parquet (FineWeb, DCLM, RedPajama parts): the text column, streamed row group by row group.

Recognised by its magic bytes (PAR1). Row groups are the unit of work: a file is cut into
runs of row groups of about the target size, so one large file is read by every worker,
and only the text column is read (`--text-field`, default text), in batches of rows.
A file whose footer cannot be read (cut short, not Parquet after all) or that has no such
text column is skipped and counted once, naming the columns it has; a null or blank text
is skipped by row.
"""
from __future__ import annotations

from .base import Limits, Probe, Reading, SourceFile, Span, column_pieces, group_spans

NAME = "parquet"
MAGIC = b"PAR1"
BATCH_ROWS = 1024


def sniff(probe: Probe) -> bool:
    return probe.head[:4] == MAGIC


def _open(path):
    import pyarrow.parquet as pq
    return pq.ParquetFile(path, memory_map=False, pre_buffer=False)


def _errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa
    return (pa.ArrowException, OSError, ValueError)


def text_column_problem(schema, text_field: str) -> str | None:
    """Why `schema` (an Arrow schema) has no usable text column, or None."""
    import pyarrow as pa
    if text_field not in schema.names:
        shown = ", ".join(schema.names[:12]) + (", ..." if len(schema.names) > 12 else "")
        return f"no column {text_field!r} (columns: {shown}); give the text column with --text-field"
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        return f"column {text_field!r} holds {kind}, not text; give the text column with --text-field"
    return None


def spans(source: SourceFile, probe: Probe, target: int, text_field: str = "text") -> list[Span]:
    try:
        meta = _open(source.path).metadata
    except _errors() as exc:
        return [Span(source, NAME, 0, 0, source.size, broken=("bad_parquet", f"not a readable Parquet file ({exc})"))]
    sizes = [sum(meta.row_group(i).column(c).total_compressed_size for c in range(meta.num_columns))
             for i in range(meta.num_row_groups)]
    return table_spans(source, NAME, meta.schema.to_arrow_schema(), text_field, sizes, target, "row groups")


def table_spans(source: SourceFile, name: str, schema, text_field: str, sizes: list[int], target: int,
                pieces: str) -> list[Span]:
    """Spans over a table file's pieces (row groups, record batches), or the one broken span that
    says why there are none: no usable text column, or no pieces at all."""
    problem = text_column_problem(schema, text_field)
    if problem:
        return [Span(source, name, 0, 0, source.size, broken=("missing_text_field", problem))]
    if not sizes:
        return [Span(source, name, 0, 0, source.size, broken=("empty", f"empty (no {pieces})"))]
    return group_spans(source, name, sizes, target)


def read(span: Span, text_field: str, reading: Reading, limits: Limits):
    number = 0
    try:
        parquet = _open(span.source.path)
        # numbered by the footer's row counts: a damaged row group does not shift the next span's rows
        reading.records = sum(parquet.metadata.row_group(i).num_rows for i in range(span.start, span.end))
        batches = parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=range(span.start, span.end),
                                       columns=[text_field], use_threads=False)
        for batch in batches:
            values = batch.column(0).to_pylist()
            yield from column_pieces(values, number, text_field, reading, limits)
            number += len(values)
    except _errors() as exc:
        reading.skip("bad_parquet", f"unreadable after row {number} of row groups "
                                    f"{span.start}..{span.end - 1} ({exc})")
        reading.records = max(reading.records, number)
