"""What the release-fixture tests share: the fixture matches the port script that wrote it."""

from __future__ import annotations

import importlib.util

import numpy as np


def assert_fixture_is_port(script, fixture, commit: str) -> None:
    """``fixture`` (an .npz with a ``commit`` entry) is what ``script``'s ``build()`` returns now: no drift between
    the checked-in arrays and the port that wrote them (``script.COMMIT`` is the release commit it follows)."""
    spec = importlib.util.spec_from_file_location(f"release_port_{script.stem}", script)
    port = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(port)
    assert port.COMMIT == commit
    fresh = port.build()
    with np.load(fixture) as f:
        assert str(f["commit"]) == commit
        assert sorted(f.files) == sorted(fresh)
        for key in f.files:
            if key != "commit":
                np.testing.assert_allclose(f[key], fresh[key], rtol=0, atol=1e-12, err_msg=key)
