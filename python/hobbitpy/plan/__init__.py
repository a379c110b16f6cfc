"""Plans made before anything runs: memory and budgets, placement by importance, per-layer pools, profiles."""
