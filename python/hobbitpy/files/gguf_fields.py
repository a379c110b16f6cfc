"""Reading GGUF metadata fields back into values GGUFWriter accepts."""

from __future__ import annotations

import numpy as np
from gguf import GGUFValueType as VT


def field_value(field):
    """Return (value, vtype, sub_type) of a GGUFReader field, ready for
    GGUFWriter.add_key_value.  Strings are kept as raw bytes so tokens that are
    not valid UTF-8 on their own survive the round trip unchanged."""
    main = field.types[0]
    if main == VT.ARRAY:
        sub = field.types[-1]
        if sub == VT.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        # numeric arrays: each element is its own 1-element part
        vals = np.concatenate([field.parts[i] for i in field.data]) if len(field.data) else []
        return [v.item() for v in vals], main, sub
    if main == VT.STRING:
        return bytes(field.parts[field.data[0]]), main, None
    return field.parts[field.data[0]][0].item(), main, None
