"""Test support a third-party plug-in can import (needs the ``test`` extra: pytest)."""
