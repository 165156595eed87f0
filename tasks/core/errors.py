"""The one exception type users see from a stage."""


class StageError(Exception):
    """A problem the user can fix; its message names the bad value and the fix."""
