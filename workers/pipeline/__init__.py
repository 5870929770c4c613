"""Pipeline stages: a model's decoder layers split into consecutive stages of whole layers (`split`), and each
stage's module (`stages`: its family's, workers.families.stage) that torch.distributed.pipelining's schedules run:
the first stage embeds the token ids, the last applies the final norm and the output layer, and what crosses a
boundary is the tuple of tensors the next layer needs (the hidden states, or what the family's layers carry)."""
