"""hydraloop: a Hydra-configured PyTorch research template."""
