"""Training sessions: a worker group that holds one LoRA and runs the user's calls (forward_backward, optim_step,
sample, save/load) in the order the control plane hands them out, every rank in lockstep."""
