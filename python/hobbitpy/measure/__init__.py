"""Tools that run the model to measure it: evaluate, trace, tune, calibrate."""
