import pytest

from gbmpo.registry import Registry, UnknownNameError


def test_unknown_name_lists_valid_names():
    reg: Registry[int] = Registry("widget")
    reg.register("b", 2)
    reg.register("a", 1)
    with pytest.raises(UnknownNameError) as err:
        reg.get("c")
    msg = str(err.value)
    assert "unknown widget 'c'" in msg and "valid names: a, b" in msg
    # usable both as KeyError and ValueError by callers
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)


def test_decorator_registration_and_duplicates():
    reg: Registry = Registry("thing")

    @reg.register("f")
    def f():
        return 3

    assert reg.get("f") is f and "f" in reg and reg.names() == ["f"] and len(reg) == 1
    with pytest.raises(ValueError, match="already registered"):
        reg.register("f", f)


def test_build_calls_the_factory_and_names_bad_parameters():
    reg: Registry = Registry("widget")
    reg.register("pair", lambda a, b=2: (a, b))
    reg.register("bare", lambda: "x")
    reg.register("open", lambda **kw: sorted(kw))
    assert reg.build("pair", a=1) == (1, 2) and reg.build("bare") == "x"
    assert reg.build("open", z=1, y=2) == ["y", "z"]  # **kwargs takes any parameter
    with pytest.raises(TypeError, match=r"widget 'pair'.*'c'.*valid parameters: a, b"):
        reg.build("pair", a=1, c=3)
    with pytest.raises(TypeError, match=r"valid parameters: \(none\)"):
        reg.build("bare", a=1)
    with pytest.raises(UnknownNameError, match="valid names: bare, open, pair"):
        reg.build("nope")
