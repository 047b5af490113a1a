"""M2R2 training: self-distillation data, the training loop (accelerate) and checkpoints."""
