"""Training applications and the training step they share."""
