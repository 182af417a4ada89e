"""The errors a request can end with, torch-free so the front door can tell them apart."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the server refuses: ``param`` names the offending field (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailed(RuntimeError):
    """A request whose data made an engine step fail; it alone was ended, the message names the cause."""
