"""JSON for the hook path, without the `json` package.

`json` imports `re` and `enum`, which cost a hook (a new process on every tool call) more than
everything else it does.  The C accelerator `_json` underneath it parses and quotes by itself;
this module drives it directly.  The output is ordinary JSON, parsed by `json` elsewhere."""
from __future__ import annotations

import _json


class _Context:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float   # NaN, Infinity, -Infinity
    memo: dict = {}


_scan = _json.make_scanner(_Context())


def loads(text: str):
    text = text.strip()
    try:
        value, end = _scan(text, 0)
    except StopIteration as e:
        raise ValueError(f"not JSON (at {e.value})") from None
    if end != len(text):
        raise ValueError(f"extra data after JSON at {end}")
    return value


def dumps(obj, ascii: bool = True) -> str:
    """Compact JSON; ``ascii``: every other character escaped (what goes on the wire), else
    kept (text a person reads)."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, str):
        return (_json.encode_basestring_ascii if ascii else _json.encode_basestring)(obj)
    if isinstance(obj, (int, float)):
        return repr(obj)
    if isinstance(obj, dict):
        return "{" + ",".join(f"{dumps(str(k), ascii)}:{dumps(v, ascii)}"
                              for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(dumps(v, ascii) for v in obj) + "]"
    raise TypeError(f"cannot send {type(obj).__name__} as JSON")
