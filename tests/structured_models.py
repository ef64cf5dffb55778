"""The pydantic model the structured-output tests ask for: nested objects, an enum, an
array, bounded numbers and an optional field. Every string and array is bounded and no
object takes other keys (as OpenAI's strict schemas), so any sampled answer can end
within max_tokens."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=24)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    height_m: float = Field(ge=0.5, le=2.5)
    favorite: Color
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    address: Address
    nickname: Annotated[str, Field(max_length=12)] | None = None
