"""Meshes from a command line's text: every mistake named before any device is touched."""

import pytest

from localleap_jax.partition import mesh_from_text
from localleap_jax.rules import DecodeError


@pytest.mark.parametrize("text, message", [
    ("data=3", "data=3 does not divide the 4 devices"),
    ("model=3", "model=3 does not divide the 4 devices"),
    ("data=2,model=1", r"data x model = 2 devices, but there are 4"),
    ("data=4,model=2", r"data x model = 8 devices, but there are 4"),
    ("data=2,data=2", "data given twice"),
    ("rows=2", "expected data=D,model=M"),
    ("", "expected data=D,model=M"),
])
def test_mesh_mistakes_are_named(text, message):
    with pytest.raises(DecodeError, match=message):
        mesh_from_text(text, devices=[object()] * 4)  # refused before any device is touched


@pytest.mark.parametrize("kwargs, message", [
    (dict(data="a"), r"^make_mesh: data='a' must be a positive whole number \(or None: what the other axes leave\)$"),
    (dict(model=0), r"^make_mesh: model=0 must be a positive whole number$"),
    (dict(model=2.0), r"^make_mesh: model=2.0 must be a positive whole number$"),
    (dict(devices=[object()]), r"^make_mesh: devices must be a non-empty list of JAX devices"),
    (dict(devices=5), r"^make_mesh: devices=5 must be a list of devices"),
])
def test_make_mesh_names_a_bad_axis_or_device_list(kwargs, message):
    """Issue #47's siblings: ll.make_mesh(data="a") was a bare TypeError from comparing a str with an int."""
    import localleap_jax as ll

    with pytest.raises(ll.DecodeError, match=message):
        ll.make_mesh(**kwargs)
