"""A mapping of keys checked against a dataclass schema, for the run config (normlab/config/loader.py) and the study
file (normlab/study/spec.py, plan.py): both word their one-line errors alike (an unknown key with a close match and the
valid keys, a value of the wrong type, a value outside its choices)."""

import dataclasses
import difflib
import types
import typing


def suggest(word, choices, wording: str = " (did you mean '{}'?)") -> str:
    """`wording` with the closest of `choices` in its {} (" (did you mean 'x'?)"), or "" when none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return wording.format(close[0]) if close else ""


def describe(kind, items: bool = False) -> str:
    """A type as an error message names it: `int or null`; `items`: a list's too (`list of int`)."""
    kinds = typing.get_args(kind) if _is_union(kind) else (kind,)

    def name(k) -> str:
        args = typing.get_args(k) if items and typing.get_origin(k) is list else ()
        return getattr(typing.get_origin(k) or k, "__name__", "any value") + (f" of {name(args[0])}" if args else "")

    return " or ".join(name(k) for k in kinds if k is not type(None)) + (" or null" if type(None) in kinds else "")


def bad_choice(key: str, value, choices) -> str:
    return f"{key}={value!r} is not valid{suggest(value, choices)}; choose one of: {', '.join(map(str, choices))}"


def _is_union(kind) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def matches(value, kind) -> bool:
    """Whether `value` (as YAML reads it) has the schema type `kind` (an int passes for a float)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is typing.Any:
        return True
    if _is_union(kind):
        return any(matches(value, k) for k in args)
    if kind is type(None):
        return value is None
    if kind in (int, float):
        return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(matches(v, args[0]) for v in value)
    return isinstance(value, origin or kind)


def checked(schema, values, where: str, error=ValueError):
    """`values` (a mapping read from YAML) as an instance of the dataclass `schema`, or `error` with one line: a
    key the schema does not have (and the close match), a value of the wrong type or outside its `choices`
    (field metadata), a required key (no default) that is missing."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    if not isinstance(values, dict):
        raise error(f"{where} must be a mapping of keys ({', '.join(fields)}), got {type(values).__name__}")
    for key, value in values.items():
        if key not in fields:
            hint = suggest(key, fields, "; did you mean '{}'?")
            raise error(f"{where}: unknown key '{key}'{hint}; valid keys: {', '.join(fields)}")
        f = fields[key]
        if not matches(value, f.type):
            raise error(f"{where}: {key}={value!r} has the wrong type; expected {describe(f.type, items=True)}")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise error(f"{where}: {bad_choice(key, value, f.metadata['choices'])}")
    missing = [name for name, f in fields.items() if name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{where}: missing '{missing[0]}'")
    return schema(**values)
