"""The fleet's error, below ports, processes and the fleet, so that all three raise the one a caller catches."""


class FleetError(RuntimeError):
    """A replica or pool server failed to start, died, or could not be reached."""
