"""A wire error code names one class: ``errors.error_from_dict`` rebuilds the class a code
names, so two classes with one code would make the SDK raise the wrong one (every
``internal`` error once came back to clients as a CgroupError). Only the base,
``CorralError``, shares ``internal`` with ``InternalError``: an error nobody classified is
an internal one."""

from __future__ import annotations

import importlib
import pkgutil

import corral
from corral.errors import CorralError, _all_subclasses, error_from_dict


def _import_everything() -> None:
    for mod in pkgutil.walk_packages(corral.__path__, "corral."):
        if ".guest." in mod.name or mod.name.startswith("corral.integrations"):
            continue  # programs run in sandboxes; integrations need their host packages
        try:
            importlib.import_module(mod.name)
        except ImportError:
            pass  # an optional extra that is not installed: its errors are not loaded


def test_every_error_code_names_one_class():
    _import_everything()
    seen: dict[str, type] = {}
    clashes = []
    for cls in _all_subclasses(CorralError):  # parents first
        first = seen.setdefault(cls.code, cls)
        if first is not cls:  # a subclass, too, needs a code of its own
            clashes.append((cls.code, first.__qualname__, cls.__qualname__))
    assert clashes == []


def test_a_code_comes_back_as_its_class():
    _import_everything()
    roots: dict[str, type] = {}
    for cls in _all_subclasses(CorralError):
        roots.setdefault(cls.code, cls)
    for code, cls in roots.items():
        assert type(error_from_dict({"code": code, "message": "m"})) is cls, cls
    assert type(error_from_dict({"code": "internal", "message": "m"})).__name__ == "InternalError"
