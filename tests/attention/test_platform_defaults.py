"""Per-platform execution defaults (DESIGN.md "References, implementations, kernels"): a knob tuned for one
platform (a tile budget, a chunk, a tile size) is declared beside the implementation that reads it, one value per
platform, and the method's config leaves it at ``dispatch.PLATFORM_DEFAULT`` so that the platform a run lands on
picks the value: a GPU run never inherits a CPU memory budget.

The laws, for every method (a method contributes declarations, not test code):

* every numeric execution knob of a method defaults to ``PLATFORM_DEFAULT`` and is declared by an implementation;
* an implementation declares only its method's execution keys, and every implementation that ``'auto'`` ranks on
  ``cuda`` or ``tpu`` declares an accelerator value of its own for each knob it declares (not the CPU one);
* a value written in the config is the value that runs, on every platform.
"""

from __future__ import annotations

import pytest

from longctx import attention
from longctx.attention import dispatch


def _knobs(cls) -> list[str]:
    defaults = cls.default_config()
    return [k for k in cls.EXECUTION_KEYS
            if isinstance(defaults[k], (int, float)) and not isinstance(defaults[k], bool)]


def _impls(cls):
    """Every declaration of each direction (a name may be declared once per direction, with its own knobs)."""
    out = []
    for causal in (True, False):
        if (causal and cls.supports_causal) or (not causal and cls.supports_bidirectional):
            out.extend(cls.implementations(causal=causal))
    return out


@pytest.mark.parametrize("name", attention.names())
def test_numeric_knobs_default_to_the_platform(name):
    cls = attention.get_class(name)
    defaults = cls.default_config()
    impls = list(_impls(cls))
    for key in _knobs(cls):
        assert defaults[key] == dispatch.PLATFORM_DEFAULT, (
            f"{name}: execution knob {key}={defaults[key]!r} is one value for every platform; leave it at "
            f"{dispatch.PLATFORM_DEFAULT} and declare it per platform beside the implementation that reads it")
        assert any(key in i.defaults for i in impls), f"{name}: no implementation declares a default for {key}"


@pytest.mark.parametrize("name", attention.names())
def test_accelerator_implementations_declare_accelerator_values(name):
    cls = attention.get_class(name)
    for impl in _impls(cls):
        assert set(impl.defaults) <= set(cls.EXECUTION_KEYS), (name, impl.name, set(impl.defaults))
        for key, table in impl.defaults.items():
            assert set(table) <= set(dispatch.ALL_PLATFORMS) | {"default"}, (name, impl.name, key, table)
            for plat in ("cuda", "tpu"):
                if plat in impl.auto:
                    assert plat in table or "default" in table, (
                        f"{name}: {impl.name} is 'auto' on {plat} but declares no {plat} value of {key}")
            for plat in [p for p in impl.platforms if p != "rocm"] + (["interpret"] if impl.kernel else []):
                value = impl.setting(key, dispatch.PLATFORM_DEFAULT, plat)
                assert value != dispatch.PLATFORM_DEFAULT, (name, impl.name, key, plat)
                assert impl.setting(key, 7, plat) == 7  # a written value runs as written


def test_setting_reads_the_platform_and_keeps_written_values():
    impl = dispatch.Implementation("x", defaults={"budget": {"cpu": 1 << 22, "cuda": 1 << 28, "default": 1 << 24}})
    assert impl.setting("budget", 0, "cpu") == 1 << 22
    assert impl.setting("budget", 0, "interpret") == 1 << 22
    assert impl.setting("budget", 0, "cuda") == 1 << 28
    assert impl.setting("budget", 0, "tpu") == 1 << 24
    assert impl.setting("budget", 5, "cuda") == 5
    assert impl.setting("other", 0, "cuda") == 0  # not a knob this implementation reads
    assert impl.settings({"budget": 0, "other": 3}, "cuda") == {"budget": 1 << 28}
    assert impl.settings({"other": 3}, "cuda") == {}
