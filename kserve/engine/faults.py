"""Injected step failures, for tests and the fault harness only.

Put a `StepFaults` in `EngineConfig.extra["step_faults"]`; the engine then asks it before each model
step whether that step should fail, and the failure takes the same path as a real one (a CUDA error
raised by the forward, say). Nothing reads the environment: a user's server never has one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from kserve.engine.errors import FatalEngineError

STEP_FAULTS_KEY = "step_faults"


class InjectedStepFailure(RuntimeError):
    """A model step failed because a `StepFaults` said so."""


class InjectedFatalError(InjectedStepFailure, FatalEngineError):
    """An injected failure the engine must treat as fatal at once (like a sticky device error)."""


@dataclass
class StepFaults:
    """Which model steps fail.

    - `fail_steps`: fail this many steps (each one counted when it fails), then run normally again;
      None with `armed` means every step fails from then on.
    - `trigger_file`: the faults arm only once this file exists (the harness creates it when its
      requests are in flight), so a server can start and pass its self-check first.
    - `fatal`: raise `InjectedFatalError`, which the engine treats as unrecoverable on the first step.
    """

    fail_steps: int | None = None
    trigger_file: str | None = None
    fatal: bool = False
    armed: bool = True
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def before_step(self) -> None:
        """Raise if this step is to fail."""
        with self._lock:
            if self.trigger_file is not None:
                if not Path(self.trigger_file).exists():
                    return
                self.trigger_file = None  # armed from now on; stop looking at the file system
                self.armed = True
            if not self.armed:
                return
            if self.fail_steps is not None and self.failed >= self.fail_steps:
                return
            self.failed += 1
            number = self.failed
        error = InjectedFatalError if self.fatal else InjectedStepFailure
        raise error(f"injected step failure #{number}")
