"""JSON schemas shared by the grammar benchmark and the structured-output tests.

``SMALL`` is a typical function-argument object; ``LARGE`` is a deliberately big schema (many
properties, nested ``$defs``, enums, bounded numbers, patterns, arrays) to show what compilation
costs at the top end of what clients send.
"""

from __future__ import annotations

from typing import Any

SMALL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def large_schema(num_fields: int = 60) -> dict[str, Any]:
    """An order-like object: ``num_fields`` typed properties plus nested address/item definitions."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 32},
        {"type": "integer", "minimum": 0, "maximum": 100000},
        {"type": "number", "minimum": -1000, "maximum": 1000},
        {"type": "boolean"},
        {"type": "string", "enum": ["new", "paid", "shipped", "delivered", "returned", "cancelled"]},
        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4,6}$"},
        {"$ref": "#/$defs/address"},
        {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 5},
        {"type": "string", "format": "date"},
        {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(num_fields)}
    return {
        "type": "object",
        "$defs": {
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["DE", "FR", "US", "GB", "JP"]}},
                "required": ["street", "city", "country"], "additionalProperties": False},
            "item": {"type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[a-z0-9]{8}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                "price": {"type": "number", "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
                "required": ["sku", "qty"], "additionalProperties": False},
        },
        "properties": props,
        "required": [f"field_{i:02d}" for i in range(0, num_fields, 3)],
        "additionalProperties": False,
    }


LARGE = large_schema()
