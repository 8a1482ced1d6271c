"""One error type for everything the user can cause; the CLI turns it into a one-line message."""


class GmtoolError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""


class CaptureError(GmtoolError):
    """Graph capture failed (an op that cannot be captured, or a host sync inside capture)."""


class OutOfMemory(GmtoolError):
    """The device ran out of memory; what was done before it is kept."""
