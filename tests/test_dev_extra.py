"""A missing test-only dependency fails with a sentence naming the dev extra (it used to skip)."""

import pytest

from tests.dev_extra import require_dev


def test_a_missing_dev_dependency_names_the_dev_extra():
    assert require_dev("json").dumps([1]) == "[1]"
    with pytest.raises(ImportError, match=r"no_such_module_for_tests is missing: .*dev extra"):
        require_dev("no_such_module_for_tests")
