"""Configuration: string keys to values, with PyFlink's typed getters and setters
(``pyflink.common.Configuration``). stretch reads ``execution.runtime-mode``, ``parallelism.default``
and ``pipeline.max-parallelism`` from the one given to ``get_execution_environment``."""

from __future__ import annotations

from typing import Any


class Configuration:
    """PyFlink's key-value configuration (string keys; typed getters and setters)."""

    def __init__(self, other: Configuration | None = None):
        self._data: dict[str, str] = dict(other._data) if other is not None else {}

    # ---- strings, and the typed views PyFlink offers over them ----------------------------
    def get_string(self, key: str, default_value: str) -> str:
        return self._data.get(key, default_value)

    def set_string(self, key: str, value: str) -> Configuration:
        self._data[key] = str(value)
        return self

    def get_integer(self, key: str, default_value: int) -> int:
        return int(self._data[key]) if key in self._data else default_value

    def set_integer(self, key: str, value: int) -> Configuration:
        self._data[key] = str(int(value))
        return self

    def get_float(self, key: str, default_value: float) -> float:
        return float(self._data[key]) if key in self._data else default_value

    def set_float(self, key: str, value: float) -> Configuration:
        self._data[key] = str(float(value))
        return self

    def get_boolean(self, key: str, default_value: bool) -> bool:
        return self._data[key].lower() == "true" if key in self._data else default_value

    def set_boolean(self, key: str, value: bool) -> Configuration:
        self._data[key] = "true" if value else "false"
        return self

    def get_bytearray(self, key: str, default_value: bytearray) -> bytearray:
        return bytearray(self._data[key], "latin-1") if key in self._data else default_value

    def set_bytearray(self, key: str, value) -> Configuration:
        self._data[key] = bytes(value).decode("latin-1")
        return self

    # ---- the rest of PyFlink's surface ----------------------------------------------------
    def key_set(self) -> set[str]:
        return set(self._data)

    def add_all_to_dict(self, target_dict: dict) -> None:
        target_dict.update(self._data)

    def add_all(self, other: Configuration, prefix: str | None = None) -> Configuration:
        for k, v in other._data.items():
            self._data[(prefix or "") + k] = v
        return self

    def contains_key(self, key: str) -> bool:
        return key in self._data

    def to_dict(self) -> dict[str, str]:
        return dict(self._data)

    def remove_config(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Configuration) and self._data == other._data

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items())))

    def __repr__(self) -> str:
        return f"Configuration({self._data!r})"
