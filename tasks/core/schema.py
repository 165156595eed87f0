"""The building blocks of params.yaml's schema: frozen models that reject unknown keys (naming the
nearest allowed one), numbers and switches that are not coerced from strings, and names that are
safe as folder names, DVC stage names and params keys."""

from __future__ import annotations

import difflib
import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, model_validator

# Numbers and switches as YAML writes them: "32" is a string, not a block size (no coercion).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # an int is a float too
Bool = Annotated[bool, Strict()]

NAME = re.compile(r"^[a-z0-9][a-z0-9_]*(-[a-z0-9_]+)*$")


def _check_name(name: str) -> str:
    # Names end up in folder names, DVC stage names (stage@model-variant) and DVC params keys, which
    # are dot paths: a dot, a slash or a space in a name would break one of them.
    if not NAME.match(name) or len(name) > 64:
        raise ValueError(
            f"name `{name}` may hold only lowercase letters, digits, `_` and single `-` between them (at most 64 "
            f"characters): it names folders, DVC stages and params keys"
        )
    return name


Name = Annotated[str, AfterValidator(_check_name)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: object) -> object:
        if isinstance(data, dict):
            allowed = [field.alias or name for name, field in cls.model_fields.items()]
            for key in data:
                if key not in allowed:
                    near = difflib.get_close_matches(str(key), allowed, n=1)
                    hint = f"did you mean `{near[0]}`? " if near else ""
                    raise ValueError(f"unknown key `{key}`; {hint}allowed keys: {', '.join(allowed)}")
        return data
