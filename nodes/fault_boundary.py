"""The line between Carnator's own code and the host's inside a sampling run.

Carnator must never fail a prompt that the graph without it would run. Its own code inside a run is marked with
`carnator_code(what)`: any exception from it becomes a `CarnatorFault` carrying the original, which the entry point
around it turns into a clean miss (plain sampling, the error in the run's report in one line, the traceback in the log
once). Calls into the host from inside Carnator's code (a probe's model evaluation through the guider) are marked
with `host_code()`: what they raise is the user's (a model or sampler that fails without Carnator too) and passes
through unchanged, as ComfyUI's interrupt always does, so a user's error fails the prompt as the host would.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import comfy.model_management

log = logging.getLogger("carnator")

_RAISED_BY_HOST = "_carnator_raised_by_host"  # set on an exception that left a `host_code` block
_LINE_LIMIT = 300


class CarnatorFault(Exception):
    """An unexpected exception from Carnator's own code; `original` is what was raised."""

    def __init__(self, what: str, original: Exception, heading: str = "Carnator error while {}") -> None:
        message = " ".join(f"{type(original).__name__}: {original}".split())
        if len(message) > _LINE_LIMIT:
            message = message[:_LINE_LIMIT] + "..."
        super().__init__(f"{heading.format(what)}: {message}")
        self.original = original
        self._logged = False

    @property
    def line(self) -> str:
        """The error in one line, as the run's report gives it."""
        return str(self)

    def log_once(self, consequence: str) -> None:
        """Log the error with its traceback, once however many handlers see it."""
        if not self._logged:
            self._logged = True
            log.error("%s; %s", self.line, consequence, exc_info=self.original)


def fault_of(what: str, error: Exception, expected: tuple[type[Exception], ...] = ()) -> CarnatorFault | None:
    """The `CarnatorFault` ("while <what>") for an exception Carnator's own code raised; None for one that passes
    through: a fault already, an interrupt, the host's own error, or an `expected` one (which the caller turns into a
    clean miss itself). The attention override's hot path uses it in a plain try/except."""
    if (isinstance(error, (CarnatorFault, comfy.model_management.InterruptProcessingException, *expected))
            or getattr(error, _RAISED_BY_HOST, False)):
        return None
    return CarnatorFault(what, error)


def host_failure_in_altered_run(error: Exception) -> CarnatorFault | None:
    """The fault for an error the host raised while sampling a run Carnator altered (served, replayed or skipped a
    call): what Carnator handed the host may be what it failed on, so the run is sampled again plain. None for an
    interrupt, which stops the prompt as it would without Carnator."""
    if isinstance(error, comfy.model_management.InterruptProcessingException):
        return None
    return CarnatorFault("a run Carnator altered", error, heading="the sampler failed in {}")


@contextlib.contextmanager
def carnator_code(what: str, expected: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Mark Carnator's own code: an exception from it is re-raised as a `CarnatorFault` (`fault_of`)."""
    try:
        yield
    except Exception as error:
        fault = fault_of(what, error, expected)
        if fault is None:
            raise
        raise fault from error


@contextlib.contextmanager
def host_code() -> Iterator[None]:
    """Mark a call into the host from inside `carnator_code`: what it raises is the host's (the user's) error and
    reaches the host unchanged."""
    try:
        yield
    except Exception as error:
        if not isinstance(error, CarnatorFault):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(error, _RAISED_BY_HOST, True)
        raise
