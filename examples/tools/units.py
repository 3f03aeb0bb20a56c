"""A function tool for the example task examples/units.yaml: unit conversion of lengths."""

METRES = {"m": 1.0, "km": 1000.0, "mi": 1609.344, "ft": 0.3048}


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """Convert a length from one unit to another.

    Args:
        value: the length to convert
        from_unit: its unit, one of m, km, mi, ft
        to_unit: the unit wanted, one of m, km, mi, ft
    """
    for unit in (from_unit, to_unit):
        if unit not in METRES:
            raise ValueError(f"unknown unit {unit!r}; known: {', '.join(METRES)}")
    return round(value * METRES[from_unit] / METRES[to_unit], 4)
