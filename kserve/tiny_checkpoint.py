"""Compatibility name for `kserve.tiny` (the tiny checkpoint now lives in the package kserve/tiny/)."""

from kserve.tiny import *
from kserve.tiny import __all__  # noqa: F401
