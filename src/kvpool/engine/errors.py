"""The fleet's error, below ports, processes and the fleet, so that all three raise the one a caller catches."""


class FleetError(RuntimeError):
    """A replica or pool server failed to start, died, or could not be reached."""


class Refused(Exception):
    """Input only the running machine can judge (a configured port another process holds, a launch vLLM or
    LMCache would read otherwise than planned), refused before anything is measured: a job says it in one
    line (kvpool.measure.logs.to_log), never as a traceback."""


class PortsInUse(Refused, FleetError):
    """Configured ports another process holds."""


class LaunchRefused(Refused, ValueError):
    """A launch vLLM's or LMCache's own parsers read otherwise than kvpool planned it."""
