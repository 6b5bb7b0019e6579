"""User-facing errors: one line that names the problem and the fix.

Every error a user can cause (bad bundle, bad option, bad prompt) is a SpectrError;
the CLI prints `error: <message>` and exits with status 2, never a traceback.
"""


class SpectrError(Exception):
    """A problem the user can fix; str(err) is one line naming the problem and the fix."""


class BundleError(SpectrError):
    """Missing, corrupt or inconsistent bundle."""


class ProviderError(SpectrError, ValueError):
    """Unknown or unavailable execution provider."""


class InputError(SpectrError, ValueError):
    """Bad generation input: prompt, sampling or speculation parameters (a ValueError too, so
    code that catches ValueError for bad arguments catches it)."""


class ExportError(SpectrError):
    """Export failed (source not found, parity check failed, checksum mismatch...)."""
