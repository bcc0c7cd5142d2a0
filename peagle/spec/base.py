"""The base of every job-spec section: unknown keys refused, every string storable text."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from peagle.spec.text import unstorable_problem

__all__ = ["Strict"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False)

    @field_validator("*", mode="after")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        """Every string of the spec is storable text: no NUL, no lone surrogate (`peagle.spec.text`)."""
        problem = unstorable_problem(value)
        if problem is not None:
            raise PydanticCustomError("unstorable_text", problem)
        return value
