"""The shared validators (quillcache._checks): what they accept, what they refuse, and the wording."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quillcache._checks import check_choice, check_float, check_fraction, check_int, is_int


class MyError(ValueError):
    pass


class MyTypeError(TypeError):
    pass


def test_is_int():
    assert all(is_int(v) for v in (0, -3, 2**70, np.int64(5), np.uint64(2**64 - 1), np.int8(-1)))
    assert not any(is_int(v) for v in (True, False, np.bool_(True), 1.0, "1", None, np.array(5), np.array([1])))


def test_check_int_accepts_and_converts():
    v = check_int("n", np.uint64(7), 0, 10)
    assert v == 7 and type(v) is int
    assert check_int("n", -5) == -5 and check_int("n", 2**70, 0) == 2**70


@pytest.mark.parametrize("value, lo, hi, exc, text", [
    (True, None, None, TypeError, "n must be an integer, got bool True"),
    (2.0, None, None, TypeError, "n must be an integer, got float 2.0"),
    ("3", None, None, TypeError, "n must be an integer, got str '3'"),
    (np.array(3), None, None, TypeError, "n must be an integer, got ndarray"),
    (-1, 0, None, ValueError, "n=-1 must be >= 0"),
    (11, None, 10, ValueError, "n=11 must be <= 10"),
    (11, 1, 10, ValueError, "n=11 must be in [1, 10]"),
    (0, 1, 10, ValueError, "n=0 must be in [1, 10]"),
])
def test_check_int_refuses_with_name_and_value(value, lo, hi, exc, text):
    with pytest.raises(exc) as info:
        check_int("n", value, lo, hi)
    assert str(info.value) == text or str(info.value).startswith(text)


def test_components_pass_their_own_exceptions():
    with pytest.raises(MyError, match="n=5 must be <= 4"):
        check_int("n", 5, hi=4, error=MyError, type_error=MyTypeError)
    with pytest.raises(MyTypeError, match="n must be an integer"):
        check_int("n", 5.5, error=MyError, type_error=MyTypeError)
    with pytest.raises(MyError, match=r"x=2.0 must be in \[0.0, 1.0\]"):
        check_fraction("x", 2.0, error=MyError)
    with pytest.raises(MyError, match="mode='z'"):
        check_choice("mode", "z", ("a", "b"), error=MyError)


def test_check_float_bounds_and_openness():
    assert check_float("x", 3) == 3.0 and type(check_float("x", np.float32(0.5))) is float
    assert check_float("x", 0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match=r"x=0.0 must be > 0.0"):
        check_float("x", 0.0, 0.0, lo_open=True)
    assert check_float("x", 1.0, 0.0, 1.0) == 1.0
    with pytest.raises(ValueError, match=r"x=1.0 must be in \(0.0, 1.0\)"):
        check_float("x", 1.0, 0.0, 1.0, lo_open=True, hi_open=True)
    with pytest.raises(ValueError, match=r"x=-0.5 must be in \[0.0, 1.0\)"):
        check_float("x", -0.5, 0.0, 1.0, hi_open=True)
    with pytest.raises(ValueError, match=r"x=2.0 must be < 2"):
        check_float("x", 2.0, hi=2, hi_open=True)


def test_check_float_refuses_nan_inf_and_non_numbers():
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="must be finite"):
            check_float("x", bad)
    assert check_float("x", math.inf, 0.0, finite=False) == math.inf  # "unlimited" where the caller allows it
    with pytest.raises(ValueError, match="x=nan must be finite"):
        check_float("x", math.nan, finite=False)  # NaN never passes
    for bad in (True, np.bool_(False), "1.0", None, [1.0]):
        with pytest.raises(TypeError, match="x must be a number"):
            check_float("x", bad)


def test_check_choice():
    assert check_choice("mode", "a", ("b", "a")) == "a"
    with pytest.raises(ValueError) as info:
        check_choice("mode", "c", ("b", "a"))
    assert str(info.value) == "mode='c' must be one of ['a', 'b']"  # choices listed sorted
    with pytest.raises(ValueError, match="mode=3"):
        check_choice("mode", 3, ("b", "a"))
