"""Lower-precision copies of a model's experts: uniform quants, companions, importance matrices, prepare."""
