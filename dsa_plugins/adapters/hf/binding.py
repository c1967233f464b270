"""Binding a patched method's call to its parameter names, in a form ``torch.compile`` traces.

The patches read arguments by name (the mask, the cache, the top-k). ``inspect.Signature.bind``
does that but breaks a ``torch.compile`` graph (dynamo cannot trace it), which would cut every
decoder layer in pieces; :class:`CallBinder` reads the signature once, when the patch is made, and
binds each call with plain tuple and dict work.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

__all__ = ["CallBinder"]


class CallBinder:
    """``CallBinder(fn)(args, kwargs)`` -> the arguments of a call of ``fn`` by name, defaults filled
    in (as ``inspect.signature(fn).bind(*args, **kwargs)`` with ``apply_defaults``).

    ``aliases``: names of one parameter under different releases (transformers renamed the indexer's
    ``past_key_values`` to ``cache``): a keyword under any of them binds to the one ``fn`` has.
    """

    def __init__(self, fn: Callable, aliases: Sequence[str] = ()):
        self.qualname = getattr(fn, "__qualname__", repr(fn))
        params = list(inspect.signature(fn).parameters.values())
        kind = inspect.Parameter
        if any(p.kind == kind.VAR_POSITIONAL for p in params):
            raise TypeError(f"dsa_tilelang: {self.qualname} takes *args; it cannot be bound by name")
        self.var_keyword = next((p.name for p in params if p.kind == kind.VAR_KEYWORD), None)
        params = [p for p in params if p.kind != kind.VAR_KEYWORD]
        self.names = tuple(p.name for p in params)
        self.positional = tuple(p.name for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD))
        self.positional_only = frozenset(p.name for p in params if p.kind == kind.POSITIONAL_ONLY)
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        own = [a for a in aliases if a in self.names]
        self.renames = {a: own[0] for a in aliases if own and a not in self.names}

    def __call__(self, args: tuple, kwargs: dict) -> dict:
        if len(args) > len(self.positional):
            raise TypeError(f"{self.qualname} takes {len(self.positional)} positional arguments, got {len(args)}")
        bound = dict(zip(self.positional, args))
        extra = {}
        for name, value in kwargs.items():
            if name in self.renames:
                name = self.renames[name]
                if name in kwargs:  # both names given: the function's own name wins
                    continue
            if name not in self.names or name in self.positional_only:
                if self.var_keyword is None:
                    raise TypeError(f"{self.qualname} got an unexpected keyword argument {name!r}")
                extra[name] = value
                continue
            if name in bound:
                raise TypeError(f"{self.qualname} got multiple values for argument {name!r}")
            bound[name] = value
        for name in self.names:
            if name not in bound:
                if name not in self.defaults:
                    raise TypeError(f"{self.qualname} is missing the argument {name!r}")
                bound[name] = self.defaults[name]
        if self.var_keyword is not None:
            bound[self.var_keyword] = extra
        return bound
