"""What is measured on one unit and how it is judged: the unit's entry (unit.py), the timed fleet (timed.py),
the pool on its tier, the drive and power telemetry, the KV bytes, the recompute reference, the checks and the
provenance."""
