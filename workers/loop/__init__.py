"""What each Ray Train worker runs: load the model, load the data, train (one optimizer step at a time, the online
micro-batch tuner, evaluation, collectives that keep ranks in lockstep, fault hooks) and finish; and the Ray Train
trainer the drivers start worker groups with."""
