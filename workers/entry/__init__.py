"""The Ray job's driver: every check that can fail before a worker starts, the Ray Train TorchTrainer of the job's
worker group, and the translation of failures into job errors."""
