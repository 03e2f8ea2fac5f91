"""The base of every typed tunables model (proposers, allocator): frozen, attribute docstrings as
field descriptions, and an unknown key is an error that names the valid keys."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["StrictConfig"]


class StrictConfig(BaseModel):
    """Base: frozen, attribute docstrings become field descriptions, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; valid keys: {sorted(cls.model_fields)}")
        return data
