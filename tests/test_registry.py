"""The Registry contract: registration, lookup errors that list the names, lazy entries, create()."""

from __future__ import annotations

import sys

import pytest

from quillcache.registry import Registry, UnknownNameError


class Widget:
    def __init__(self, *, size: int = 1, colour: str = "red") -> None:
        if size <= 0:
            raise ValueError(f"size={size} must be positive")
        self.size, self.colour = size, colour


def make() -> Registry:
    r: Registry = Registry("widget")
    r.register("b", Widget)
    r.register("a", dict)
    return r


def test_order_membership_and_lookup():
    r = make()
    assert list(r) == r.names() == r.keys() == ["b", "a"]  # registration order, not sorted
    assert sorted(r) == ["a", "b"] and len(r) == 2
    assert "a" in r and "c" not in r and 3 not in r
    assert r["b"] is Widget and r.get("a") is dict
    assert r.items() == [("b", Widget), ("a", dict)] and r.values() == [Widget, dict]


def test_decorator_registers_and_returns_the_object():
    r: Registry = Registry("thing")

    @r.register("f")
    def f() -> int:
        return 7

    assert r["f"] is f and f() == 7


def test_unknown_name_lists_registered_sorted():
    r = make()
    with pytest.raises(UnknownNameError, match=r"unknown widget 'c'; registered: \['a', 'b'\]") as info:
        r["c"]
    assert isinstance(info.value, ValueError) and isinstance(info.value, KeyError)
    assert str(info.value) == "unknown widget 'c'; registered: ['a', 'b']"  # not quoted like a KeyError
    with pytest.raises(TypeError, match="widget name must be str, got int 3"):
        r.get(3)
    assert r.get("c", None) is None and r.get("a", None) is dict


def test_duplicate_and_bad_names_refused():
    r = make()
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        r.register("a", list)
    with pytest.raises(ValueError, match="already registered"):
        r["b"] = list
    assert r["a"] is dict and r["b"] is Widget  # unchanged
    for bad in ("", None, 5):
        with pytest.raises(ValueError, match="non-empty str"):
            r.register(bad, list)  # type: ignore[arg-type]


def test_setitem_and_delitem_support_monkeypatch(monkeypatch):
    r = make()
    monkeypatch.setitem(r, "c", list)
    assert r["c"] is list and r.names() == ["b", "a", "c"]
    monkeypatch.undo()
    assert "c" not in r and r.names() == ["b", "a"]
    with pytest.raises(UnknownNameError):
        del r["zzz"]


def test_create_passes_options_and_names_rejected_ones():
    r = make()
    w = r.create("b", size=3)
    assert isinstance(w, Widget) and (w.size, w.colour) == (3, "red")
    with pytest.raises(TypeError, match=r"widget 'b' rejected options \['shape', 'size'\]: .*\['shape'\].*"
                                         r"accepts \['size', 'colour'\]"):
        r.create("b", size=2, shape="round")
    with pytest.raises(ValueError, match="size=0 must be positive"):  # the entry's own error passes through
        r.create("b", size=0)
    with pytest.raises(UnknownNameError, match="registered"):
        r.create("nope")


def test_lazy_entry_imported_on_first_lookup_only():
    name = "quillcache.cli.info"
    sys.modules.pop(name, None)
    r: Registry = Registry("command module")
    r.register_lazy("info", f"{name}:run")
    assert "info" in r and name not in sys.modules  # membership does not import
    assert r.check("info") == "info" and name not in sys.modules  # nor does checking a name
    with pytest.raises(UnknownNameError, match=r"unknown command module 'inf'; registered: \['info'\]"):
        r.check("inf")
    with pytest.raises(TypeError, match="command module name must be str"):
        r.check(None)
    run = r["info"]
    assert name in sys.modules and run is sys.modules[name].run and r["info"] is run
    with pytest.raises(ValueError, match="module:attr"):
        r.register_lazy("x", "no_colon")


def test_lazy_entry_with_missing_module_fails_only_on_lookup():
    r: Registry = Registry("backend")
    r.register_lazy("ghost", "quillcache_no_such_module:Thing")
    r.register("real", int)
    assert r["real"] is int and sorted(r) == ["ghost", "real"]
    with pytest.raises(ModuleNotFoundError):
        r["ghost"]
    del r["ghost"]  # removing a lazy entry does not import it
    assert r.names() == ["real"]


def test_component_registries_are_registries():
    from quillcache.cli import COMMANDS
    from quillcache.hitrate import HITRATE_KERNELS, HITRATE_POLICIES
    from quillcache.index import INDEX_BACKENDS
    from quillcache.policies import POLICIES
    from quillcache.routing import ROUTERS

    for reg in (COMMANDS, HITRATE_KERNELS, INDEX_BACKENDS, POLICIES, ROUTERS):
        assert isinstance(reg, Registry) and len(reg) > 0
    assert HITRATE_POLICIES is POLICIES  # one policy registry; the hit-rate layer adds only kernels
    assert set(HITRATE_KERNELS) == set(POLICIES)  # every policy can be simulated
