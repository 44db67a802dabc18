"""A params group's schema: a frozen dataclass beside the code that reads the group, one field per
key of its conf/ files, with the key's type and the check of its values, and the group's cross-key
rules in its ``relations``. ``eagle3.config.validate`` runs every schema over the keys a view holds.

    @dataclass(frozen=True)
    class ExtractSettings:
        GROUP: ClassVar[str] = "extract"
        max_length: int = setting(POSITIVE)   # tokens per sequence

        @staticmethod
        def relations(get: Lookup) -> None:   # rules over several keys, of any group
            ...

    check_schema(ExtractSettings, get)   # get("extract.max_length"): the value, or ABSENT
    read_section(ExtractSettings, params.extract)   # the section as an ExtractSettings, each field as its read says

Why here and not in config.py: a key's type, bounds and rules are declared once, where the code
that reads the key can see them; config.py composes the groups and cuts each stage's view.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import field, fields
from typing import Any, NamedTuple, TypeVar

from eagle3.common import UserError, to_plain

ABSENT = object()  # what a Lookup gives for a key the view does not hold
Lookup = Callable[[str], Any]  # a dotted key's plain value in the params view, or ABSENT
Schema = TypeVar("Schema")


class Check(NamedTuple):
    """A value check: the test, and what the one-line refusal says is allowed."""

    test: Callable[[Any], bool]
    allowed: str


def setting(check: Check | None = None, read: Callable[[Any], Any] | None = None) -> Any:
    """A schema field without a default (a key missing from params.yaml is an error, never a silent
    second value) and with the check of its values; None: any value of the field's type passes. ``read``:
    how the code takes the value (e.g. a list as a tuple; ``lm.spec.VerifierSpec``), None: as it is."""
    return field(metadata={"check": check, "read": read})


def read_section(schema: type[Schema], section: Any) -> Schema:
    """``schema``'s group ``section`` (a params view's, checked by the schema) as a ``schema``: each field's value taken as
    its ``read`` says. A key the section lacks is refused in one line (a stage run alone with a ``~train.lr`` override:
    `dvc repro -s` skips the params stage, which compares the keys with conf/); one it has besides its fields (the
    option's ``name``) is not read, and a misspelt one was refused by the stage's own key check
    (``settings.check_section_keys``)."""
    values = to_plain(section)
    missing = [item.name for item in fields(schema) if item.name not in values]
    if missing:
        raise UserError(f"params.yaml: {schema.GROUP}.{missing[0]}: missing; set it, or recompose params.yaml with "
                        "`eagle3 params`")
    return schema(**{item.name: (item.metadata["read"] or _as_is)(values[item.name]) for item in fields(schema)})


def _as_is(value: Any) -> Any:
    return value


def integer(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def number(low: float, high: float = float("inf"), open_low: bool = False) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and (v > low if open_low else v >= low) and v <= high

    return check


def or_null(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or test(v)


def one_of(*allowed: Any) -> Check:
    return Check(lambda v: v in allowed, f"one of {list(allowed)}")


POSITIVE = Check(integer(1), "an integer >= 1")
NON_NEGATIVE = Check(integer(0), "an integer >= 0")
BOOL = Check(lambda v: isinstance(v, bool), "true or false")
FRACTION = Check(number(0, 1), "a number in [0, 1]")
FRACTION_BELOW_1 = Check(lambda v: number(0, 1)(v) and v < 1, "a number in [0, 1)")
FRACTION_ABOVE_0 = Check(number(0, 1, open_low=True), "a number in (0, 1]")
POSITIVE_NUMBER = Check(number(0, open_low=True), "a number > 0")
NON_NEGATIVE_NUMBER = Check(number(0), "a number >= 0")
SOME_OR_ALL = Check(or_null(integer(1)), "an integer >= 1, or null for all")


def is_placement(value: Any) -> bool:
    """{tp, ep}: tp processes hold one verifier copy, its experts split over ep of them (1, or all tp)."""
    return (isinstance(value, dict) and set(value) == {"tp", "ep"} and integer(1)(value["tp"]) and integer(1)(value["ep"])
            and value["ep"] in (1, value["tp"]))


# layout.verifier and model.placement (lm.loading.Placement): here, where both schemas and the verifier's loading
# import from already, so neither stage's code gains the other's schema as a dependency
PLACEMENT = Check(is_placement, "{tp: an integer >= 1, ep: 1 or tp}")


def refuse(key: str, value: Any, allowed: str) -> UserError:
    """The one-line error of a params value: its key, the value and what is allowed."""
    return UserError(f"params.yaml: {key} = {value!r}: must be {allowed}")


def check_schema(schema: type, get: Lookup) -> None:
    """Refuse the first value of ``schema``'s group that is not finite (anywhere inside it: a field of
    no check and an open mapping too) or fails its field's check, then apply the group's ``relations``
    (where it has rules over several keys); keys the view does not hold are not checked."""
    for item in fields(schema):
        key = f"{schema.GROUP}.{item.name}"
        check, value = item.metadata.get("check"), get(key)
        if value is ABSENT:
            continue
        not_finite = next(non_finite(key, value), None)  # YAML reads .inf, 1e400 and .nan: no setting can use them
        if not_finite:
            raise refuse(*not_finite, "a finite number")
        if check is not None and not check.test(value):
            raise refuse(key, value, check.allowed)
    if hasattr(schema, "relations"):
        schema.relations(get)


def non_finite(key: str, value: Any) -> Iterator[tuple[str, float]]:
    """The infinite and NaN floats in ``value`` (a plain params value), each with its key:
    ``non_finite("a", {"b": [1.0, inf]})`` yields ``("a.b[1]", inf)``."""
    if isinstance(value, float) and not math.isfinite(value):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from non_finite(f"{key}.{name}", item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from non_finite(f"{key}[{index}]", item)
