"""Field types shared by the request bodies: JSON's own types, not pydantic's lax coercions."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Strict

TokenId = Annotated[int, Strict()]  # a float or bool is not a token id
# A JSON true/false only: pydantic's lax mode reads "yes", "on", "1" as true, so {"stream": "yes"} was a 200
# stream to a client that asked for none (bench soak, 60-minute run: 3 of 366 malformed bodies).
Flag = Annotated[bool, Strict()]


def _not_bool(value):
    if isinstance(value, bool):  # pydantic's lax int reads true as 1: {"max_tokens": true} was a 200
        raise ValueError("expected an integer, got a boolean")
    return value


# A count or id field: what pydantic's int takes (16, and 16.0 as clients may send it), never a JSON boolean.
Int = Annotated[int, BeforeValidator(_not_bool)]
