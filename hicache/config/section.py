"""What every section of the deployment schema (`schema.py`) stands on: `Section` (extra
keys forbidden, frozen once loaded) and `ByteSize` (a byte count given as an int or a
`"64GiB"`-style string, shown as one in JSON).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer

from hicache.config.sizes import format_bytes, parse_bytes

ByteSize = Annotated[
    int,
    BeforeValidator(parse_bytes),
    PlainSerializer(format_bytes, return_type=str, when_used="json"),
    Field(json_schema_extra={"examples": ["256MiB", 4096]}),
]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
