"""What a contract suite does when the subclass forgot the fixture that names its plug-in."""

from __future__ import annotations

from typing import NoReturn

import pytest


def fixture_missing(suite: str, fixture: str, returns: str) -> NoReturn:
    """Fail the test with the fix: the suite cannot know which plug-in to check until it is told."""
    pytest.fail(f"{suite} checks the plug-in your subclass names: define `@pytest.fixture def {fixture}(self)` "
                f"in it, returning {returns} (see the suite's docstring)", pytrace=False)
