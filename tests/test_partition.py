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
