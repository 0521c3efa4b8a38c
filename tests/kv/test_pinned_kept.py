"""Every method name of the pre-parts code keeps exactly the positions it kept then (pinned file)."""

import json

import pytest

from tests.kv.pinned_kept import PINNED, compute, kept_for_current_code


@pytest.fixture(scope="module")
def current():
    return compute(kept_for_current_code)


def test_pinned_file_covers_every_old_method(current):
    pinned = json.loads(PINNED.read_text())
    assert set(pinned) == set(current) and len(pinned) == 48


def test_kept_positions_are_unchanged(current):
    pinned = json.loads(PINNED.read_text())
    changed = [key for key in pinned if pinned[key] != current[key]]
    assert not changed, f"kept positions changed for {changed}"
