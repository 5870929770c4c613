"""Training sessions in the control plane: their tables, the calls' queue, the Ray job that holds each group."""
