"""What every config section shares: strictness, and Keras objects named by a string or a map."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

Auto = Literal["auto"]
Positive = Annotated[int, Field(ge=1)]


class Section(BaseModel):
    """A strict config section: unknown keys are errors, defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True, validate_assignment=True)


class NamedObject(Section):
    """A Keras object named by a string, or by ``{name: ..., other keys are kwargs}``."""

    name: str = Field(
        description="A Keras name (`adam`), or an import path `module:Name` or `path/to/file.py:Name`."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Constructor arguments: in YAML, the keys beside `name` (`{name: adam, "
        "beta_1: 0.8}`).",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_user_form(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"name": value, "kwargs": {}}
        if isinstance(value, dict) and "kwargs" not in value:
            rest = {k: v for k, v in value.items() if k != "name"}
            return {"name": value.get("name"), "kwargs": rest}
        return value

    @model_serializer
    def _to_user_form(self) -> Any:
        return self.name if not self.kwargs else {"name": self.name, **self.kwargs}
