"""Decoding strategies behind one interface (:class:`m2r2.decoding.base.Strategy`).

Each method registers a factory ``f(engine, **options) -> Strategy``. The CLI, the engine and the
benchmark harness only ever look methods up here, so adding a method is adding one entry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from m2r2.decoding.base import GenerationConfig, GenerationResult, Strategy

if TYPE_CHECKING:
    from m2r2.engine import Engine

Factory = Callable[..., Strategy]
_REGISTRY: dict[str, tuple[Factory, str]] = {}


def register(name: str, help: str) -> Callable[[Factory], Factory]:
    """Decorator: make ``factory`` available as method ``name`` (``help`` shows in ``--help``)."""

    def deco(factory: Factory) -> Factory:
        _REGISTRY[name] = (factory, help)
        return factory

    return deco


def _load_builtin() -> None:
    # Imported for their @register side effects; kept lazy so `import m2r2` stays light.
    from m2r2.decoding import autoregressive, dynamic, hf, lookahead, mod, speculative  # noqa: F401


def method_names() -> list[str]:
    _load_builtin()
    return list(_REGISTRY)


def method_help() -> dict[str, str]:
    _load_builtin()
    return {k: v[1] for k, v in _REGISTRY.items()}


def method_options(name: str) -> list[str]:
    """Keyword options the factory of method ``name`` accepts (after the engine)."""
    _load_builtin()
    params = list(inspect.signature(_REGISTRY[name][0]).parameters.values())[1:]
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def build_strategy(name: str, engine: Engine, **options: Any) -> Strategy:
    _load_builtin()
    return _REGISTRY[name][0](engine, **options)


__all__ = ["GenerationConfig", "GenerationResult", "Strategy", "build_strategy", "method_names", "register"]
