"""The unit kinds, one module each: Study A's cell (study_a.py), its load levels, vLLM's replay, the
routers, document length, Study B's blocks and where the pool pays (crossover)."""
