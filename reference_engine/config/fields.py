"""What target and draft configs both read: the attention kinds of a layer, the field parsers
(each raises `ConfigError` with the field, the value and what was expected) and RoPE, with
Llama 3's scaling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"


def _require(raw: dict[str, Any], name: str, where: str) -> Any:
    if name not in raw or raw[name] is None:
        raise ConfigError(f"{where}: required field '{name}' is missing")
    return raw[name]


def _positive_int(raw: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(f"{where}: required field '{name}' is missing")
    if not _is_positive_int(value):
        raise ConfigError(f"{where}: '{name}' must be a positive integer, got {value!r}")
    return value


def _number(raw: dict[str, Any], name: str, where: str, default: float | None = None) -> float:
    """A number: required, or `default` when absent (null is not absent); its range is the
    config's to check."""
    value = _require(raw, name, where) if default is None else raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: '{name}' must be a number, got {value!r}")
    return float(value)


def _count(raw: dict[str, Any], name: str, where: str, default: int) -> int:
    """An integer >= 0 (`default` when absent)."""
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: '{name}' must be an integer >= 0, got {value!r}")
    return value


def _bool(raw: dict[str, Any], name: str, where: str, default: bool) -> bool:
    """JSON true or false (`default` when absent): a string such as "false" is refused, not
    read as true."""
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: '{name}' must be true or false, got {value!r}")
    return value


def _list(raw: dict[str, Any], name: str, where: str, kind: type, what: str) -> list | None:
    """A JSON list of `kind` (a tuple, from a config built in code, too; None when absent or
    null)."""
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, kind) and not isinstance(v, bool) for v in value
    ):
        raise ConfigError(f"{where}: '{name}' must be a list of {what}, got {value!r}")
    return list(value)


def _qwen3_window(
    raw: dict[str, Any], layer_types: list[str] | None, num_layers: int, where: str
) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) as transformers' Qwen3Config reads them: a window of 4096
    unless the config says otherwise, kept only with use_sliding_window (sliding layers
    without it attend without a window); without layer_types, the layers from
    max_window_layers (28) on slide when a window applies. No sliding layer: no window."""
    window = raw.get("sliding_window", 4096) if _bool(raw, "use_sliding_window", where, False) else None
    if layer_types is None:
        window_from = _count(raw, "max_window_layers", where, 28)
        layer_types = [
            SLIDING_ATTENTION if window and i >= window_from else FULL_ATTENTION for i in range(num_layers)
        ]
    return layer_types, window if SLIDING_ATTENTION in layer_types else None


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x RoPE scaling (`rope_type: llama3`): frequencies whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those under
    original_max_position_embeddings / high_freq_factor are kept, and the band between is
    interpolated (models/layers.py: `llama3_inv_freq`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        where = "llama3 rope scaling"
        if not self.factor >= 1.0:
            raise ConfigError(f"{where}: 'factor' must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                f"{where}: expected 0 < low_freq_factor < high_freq_factor, got low_freq_factor "
                f"{self.low_freq_factor} and high_freq_factor {self.high_freq_factor}"
            )


def _rope(
    raw: dict[str, Any], where: str, llama3: bool = False, max_positions: int | None = None
) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from a v5 `rope_parameters` or a v4 `rope_theta`
    plus `rope_scaling` (whose legacy key `type` is read too). `llama3`: whether the family
    takes llama3 scaling; `max_positions` stands in for a missing
    original_max_position_embeddings, as transformers does."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    supported = ("default", "llama3") if llama3 else ("default",)
    if rope_type not in (None, *supported):
        raise ConfigError(
            f"{where}: rope type '{rope_type}' is not supported (expected {' or '.join(supported)})"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: 'rope_theta' must be a positive number, got {theta!r}")
    if rope_type != "llama3":
        return float(theta), None
    values = {"original_max_position_embeddings": max_positions, **scaling, **params}
    rope_where = f"{where} (llama3 rope scaling)"
    return float(theta), Llama3RopeScaling(
        factor=_number(values, "factor", rope_where),
        low_freq_factor=_number(values, "low_freq_factor", rope_where),
        high_freq_factor=_number(values, "high_freq_factor", rope_where),
        original_max_position_embeddings=_positive_int(
            values, "original_max_position_embeddings", rope_where
        ),
    )


def _token_id(value: Any) -> bool:
    """Whether `value` reads as a token id: an integer (a JSON boolean is not one; the range is
    checked against the vocabulary where the config is validated)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value: Any) -> bool:
    """Whether `value` is a positive integer (a JSON boolean or a float is not one)."""
    return _token_id(value) and value > 0


def _eos_ids(raw: dict[str, Any], outer: dict[str, Any], where: str = "config") -> tuple[int, ...]:
    """`eos_token_id`: one token id or a list of them (Llama 3's three), or absent."""
    eos = raw.get("eos_token_id", outer.get("eos_token_id"))
    if eos is None:
        return ()
    if _token_id(eos):
        return (eos,)
    if isinstance(eos, list) and all(_token_id(e) for e in eos):
        return tuple(eos)
    raise ConfigError(f"{where}: 'eos_token_id' must be a token id or a list of them, got {eos!r}")
