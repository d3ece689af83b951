"""Data sets: each option is a function returning (train, val) datasets whose samples are shaped `input_shape`."""
