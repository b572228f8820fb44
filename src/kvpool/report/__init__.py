"""What a run's records become: the tables (tables.py), the gate (gate.py), the figures and the page."""
