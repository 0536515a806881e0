"""The rank runtime's tests that run real ranks use the trainer suite's launcher and fake
agent (``tests/trainer/conftest.py``)."""

from __future__ import annotations

from tests.trainer.conftest import launch, make_spec

__all__ = ["launch", "make_spec"]
