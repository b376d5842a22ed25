"""The ``keyop`` data source (what ``spark.read.format("keyop")`` finds) and
:func:`register`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
)
from pyspark.sql.types import (
    StructType,
)

from .options import ENVELOPE_DDL, SOURCE_NAME, Options, check_payload_ddl, nullable_ddl
from .reader import BatchReader, ReadSpec
from .streaming import StreamReader, stream_writer
from .writer import BatchWriter, WriteSpec

if TYPE_CHECKING:
    from pyspark.sql import SparkSession



def register(spark: SparkSession) -> None:
    """Registers the ``keyop`` data source in ``spark`` (idempotent)."""
    spark.dataSource.register(KeyopDataSource)


class KeyopDataSource(DataSource):
    """The ``keyop`` data source: read, write and stream keyop-messenger channels.

    See the module documentation for the options."""

    @classmethod
    def name(cls) -> str:
        """The data source's name, ``keyop``."""
        return SOURCE_NAME

    def schema(self) -> str:
        """The envelope columns; ``payload`` is a struct when ``payload_schema`` is set, JSON text
        otherwise."""
        payload_schema = Options(self.options).get("payload_schema")
        if payload_schema and payload_schema.strip():
            check_payload_ddl(payload_schema)
            return ENVELOPE_DDL.format(payload=f"STRUCT<{nullable_ddl(payload_schema)}>")
        return ENVELOPE_DDL.format(payload="STRING")

    def reader(self, schema: StructType) -> DataSourceReader:
        """A batch reader; ``retain_as`` is refused (it applies to streaming reads)."""
        specs = ReadSpec.all_from_options(self.options, schema)
        spec = specs[0]
        if spec.retain_as is not None:
            raise ValueError("keyop data source: option 'retain_as' applies to streaming reads")
        for key in ("maxOffsetsPerTrigger", "maxBytesPerTrigger"):
            if Options(self.options).get(key):
                raise ValueError(f"keyop data source: option {key!r} applies to streaming reads")
        for s in specs:
            s.check_exists()
        return BatchReader(specs)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """A streaming reader following the channel."""
        specs = ReadSpec.all_from_options(self.options, schema)
        if specs[0].ending_offset != "latest":
            raise ValueError(
                "keyop data source: options 'endingOffsets' and 'endingTimestamp' apply to "
                "batch reads (a stream follows the channel)"
            )
        for s in specs:
            s.check_exists()
        return StreamReader(specs)

    def writer(self, schema: StructType, overwrite: bool) -> BatchWriter:
        """A batch writer; only the ``append`` mode is accepted."""
        if overwrite:
            raise ValueError("keyop data source: channels are append-only; use mode('append')")
        return BatchWriter(WriteSpec.from_options(self.options, schema, streaming=False))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """A streaming writer; only the ``append`` output mode is accepted."""
        if overwrite:
            raise ValueError(
                "keyop data source: channels are append-only; use outputMode('append')"
            )
        spec = WriteSpec.from_options(self.options, schema, streaming=True)
        return stream_writer(spec)
