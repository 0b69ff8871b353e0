"""Training: the policy network, training and fine-tuning, MLflow tracking and the registry."""
