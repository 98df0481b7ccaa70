"""Layer 2: planner interfaces and plan types, the standard planners, the save dedup and
the load replica plan (a named pair), all pure."""
