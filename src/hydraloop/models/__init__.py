"""Models: each option is an nn.Module taking `input_shape` and `num_classes` (filled in from the data config)."""
