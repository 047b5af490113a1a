"""Decoding strategies behind one interface (:class:`m2r2.decoding.base.Strategy`).

Each method registers a factory ``f(loaded, **options) -> Strategy``. The CLI, the engine and the
benchmark harness only ever look methods up here, so adding a method is adding one entry. This
module imports no torch: ``m2r2 --help`` lists the methods from their ``@register`` lines.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m2r2.errors import SettingsError

if TYPE_CHECKING:
    from m2r2.decoding.base import Loaded, Strategy

Factory = Callable[..., "Strategy"]
_REGISTRY: dict[str, tuple[Factory, str]] = {}
#: Modules whose ``@register`` calls define the built-in methods (imported on first lookup).
BUILTIN = (
    "autoregressive",
    "deed",
    "dynamic",
    "eagle",
    "exits",
    "hf",
    "lookahead",
    "medusa",
    "mixture_of_depths",
    "speculative",
    "two_model",
)
#: Method name that picks for the model: ``m2r2`` where fast-stream adapters exist for it, else ``vanilla``.
AUTO_METHOD = "auto"
#: The one default of the CLI and the API (lossless either way).
DEFAULT_METHOD = AUTO_METHOD


def register(name: str, help: str) -> Callable[[Factory], Factory]:
    """Decorator: make ``factory`` available as method ``name`` (``help`` shows in ``--help``)."""

    def deco(factory: Factory) -> Factory:
        _REGISTRY[name] = (factory, help)
        return factory

    return deco


def _load_builtin() -> None:
    # Imported for their @register side effects; kept lazy so `import m2r2` stays light.
    for module in BUILTIN:
        importlib.import_module(f"m2r2.decoding.{module}")


def _declared_help(module: str) -> dict[str, str]:
    """``{name: help}`` of the module-level ``@register(name, help)`` lines of ``module``, read from its
    source (constants and f-strings over module constants), without importing it."""
    tree = ast.parse((Path(__file__).parent / f"{module}.py").read_text(encoding="utf-8"))
    consts = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }

    def text(node: ast.expr) -> str:
        if isinstance(node, ast.JoinedStr):
            return "".join(text(v.value if isinstance(v, ast.FormattedValue) else v) for v in node.values)
        if isinstance(node, ast.Name):
            return str(consts[node.id])
        return str(ast.literal_eval(node))

    out = {}
    for fn in tree.body:
        for d in getattr(fn, "decorator_list", []):
            if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "register" and len(d.args) == 2:
                out[text(d.args[0])] = text(d.args[1])
    return out


def method_names() -> list[str]:
    _load_builtin()
    return list(_REGISTRY)


def method_help() -> dict[str, str]:
    """Name -> help of every built-in method (from the sources: no torch), then any registered since."""
    declared = {k: v for m in BUILTIN for k, v in _declared_help(m).items()}
    return declared | {k: v[1] for k, v in _REGISTRY.items()}


def method_options(name: str) -> list[str]:
    """Keyword options the factory of method ``name`` accepts (after the engine)."""
    _load_builtin()
    params = list(inspect.signature(_REGISTRY[name][0]).parameters.values())[1:]
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


#: Range of each numeric method option (inclusive; None = open). Bounds that depend on the model
#: (layer counts) are the strategy's own check.
OPTION_RANGES: dict[str, tuple[float | None, float | None]] = {
    "max_draft": (1, None),
    "stop_below": (0.0, 1.0),
    "threshold": (0.0, None),
    "max_pending": (1, None),
    "backoff": (0, None),
    "window": (1, None),
    "ngram": (2, None),
    "candidates": (1, None),
    "exit_layer": (1, None),
    "layer": (1, None),
    "min_layer": (1, None),
    "max_layer": (1, None),
    "depth": (1, None),
    "lookup": (0, None),
}


def _typed(option: str, kinds: set[str], value: Any) -> Any:
    """``value`` as the type its factory declares (``int``, ``float``, ``bool``, ``str``), else a SettingsError."""
    if (value is None and "None" in kinds) or "Any" in kinds:
        return value
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if "bool" in kinds and isinstance(value, bool):
        return value
    if "bool" in kinds and "int" not in kinds and number and value in (0, 1):
        return bool(value)  # ``--option online_costs=0``
    if "int" in kinds and number and float(value).is_integer():
        return int(value)
    if "float" in kinds and number:
        return float(value)
    if "str" in kinds and not isinstance(value, bool) and value is not None:
        return str(value)
    want = " or ".join({"int": "an integer", "float": "a number", "bool": "true/false", "str": "text"}[k]
                       for k in ("int", "float", "bool", "str") if k in kinds)  # fmt: skip
    raise SettingsError(f"{option} must be {want}, got {value!r}")


def check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Method ``name``'s options, each checked against its factory's declared type and :data:`OPTION_RANGES`."""
    _load_builtin()
    params = dict(list(inspect.signature(_REGISTRY[name][0]).parameters.items())[1:])
    out = {}
    for key, value in options.items():
        if key not in params:
            accepted = method_options(name)
            raise SettingsError(f"method {name!r} takes no option {key}; its options: {', '.join(accepted) or 'none'}")
        ann = params[key].annotation
        kinds = {k.strip() for k in (ann if isinstance(ann, str) else getattr(ann, "__name__", "Any")).split("|")}
        value = _typed(key, kinds, value)
        low, high = OPTION_RANGES.get(key, (None, None))
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and ((low is not None and value < low) or (high is not None and value > high)):
            span = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
            raise SettingsError(f"{key} must be {span}, got {value}")
        out[key] = value
    return out


def build_strategy(name: str, engine: Loaded, **options: Any) -> Strategy:
    _load_builtin()
    return _REGISTRY[name][0](engine, **options)


__all__ = [
    "AUTO_METHOD",
    "DEFAULT_METHOD",
    "build_strategy",
    "check_options",
    "method_names",
    "register",
]
