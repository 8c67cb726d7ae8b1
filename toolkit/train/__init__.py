"""Training: trainer loop, FastCLIP losses and state, optimisers, distributed losses, checkpoints."""
