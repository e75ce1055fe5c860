"""Arrow IPC files: what Hugging Face `datasets.save_to_disk` writes (data-0000N-of-0000M.arrow).

Recognised by content: the stream format (what `datasets` writes) starts with Arrow's
continuation marker, the file format with ARROW1. The file is memory-mapped, so walking its
record batches reads no data; runs of batches of about the target size are the unit of work.
A folder made by save_to_disk (its state.json names the data files in order) is found by
sources.py. Skipped and counted as for Parquet: a file Arrow cannot read, no text column,
a null or blank text.
"""
from __future__ import annotations

from .base import Limits, Probe, Reading, SourceFile, Span, column_pieces
from .parquet import table_spans, text_column_problem

NAME = "arrow"
STREAM_MAGIC = b"\xff\xff\xff\xff"
FILE_MAGIC = b"ARROW1"


def sniff(probe: Probe) -> bool:
    return probe.head[:4] == STREAM_MAGIC or probe.head[:6] == FILE_MAGIC


def _errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa
    return (pa.ArrowException, OSError, ValueError)


def _batches(path):
    """(schema, iterator of record batches) of an Arrow stream or file, memory-mapped."""
    import pyarrow as pa
    source = pa.memory_map(str(path), "r")
    if source.read(6) == FILE_MAGIC:
        source.seek(0)
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    source.seek(0)
    reader = pa.ipc.open_stream(source)
    return reader.schema, iter(reader)


def spans(source: SourceFile, probe: Probe, target: int, text_field: str = "text") -> list[Span]:
    try:
        schema, batches = _batches(source.path)
        sizes = [batch.nbytes for batch in batches] if text_column_problem(schema, text_field) is None else []
    except _errors() as exc:
        return [Span(source, NAME, 0, 0, source.size, broken=("bad_arrow", f"not a readable Arrow file ({exc})"))]
    return table_spans(source, NAME, schema, text_field, sizes, target, "record batches")


def read(span: Span, text_field: str, reading: Reading, limits: Limits):
    number = 0
    try:
        schema, batches = _batches(span.source.path)
        column = schema.get_field_index(text_field)
        for index, batch in enumerate(batches):
            if index < span.start:
                continue
            if index >= span.end:
                break
            values = batch.column(column).to_pylist()
            yield from column_pieces(values, number, text_field, reading, limits)
            number += len(values)
    except _errors() as exc:
        reading.skip("bad_arrow", f"unreadable after row {number} ({exc})")
    reading.records = number
